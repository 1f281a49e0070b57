"""A turn fills the state disk (a 4 MiB tmpfs) with its output: it ends 125 naming the disk,
other turns still get their ends, new turns get 503, and freeing space brings it all back."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import events, wait_until
from process_support import OTHER_HEADERS, TargetProcess, write_config

from shared.walk import canonical_path
from shared.wire import Event
from target_side.service import ledger
from target_side.service.spool import events_on_disk

BALLAST = 1 << 20
"""Written on the small disk first, so that removing it is how the test frees space."""
FILLER = ["sh", "-c", "yes 0123456789abcdef0123456789abcdef"]
"""Prints until the disk is full (the role allows far more output than the disk holds)."""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs_state(tmp_path, "size=4m,mode=0700")


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """Space to spare, but room for only a few hundred files and directories."""
    yield from _tmpfs_state(tmp_path, "size=4m,nr_inodes=400,mode=0700")


def _tmpfs_state(tmp_path: Path, options: str) -> Iterator[Path]:
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    state = Path(canonical_path(tmp_path)) / "state"
    state.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(state)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def _causes(c: httpx.Client) -> set[str]:
    return {x["cause"] for x in c.get("/v1/health").json()["causes"]}


def _spool_events(state: Path, turn_id: str) -> list[Event]:
    """The spool as it lies on disk: every record must be a whole event (else ValueError)."""
    return events_on_disk(state / "turns" / f"{turn_id}.frames")


def _start_filling(target: TargetProcess, state: Path) -> tuple[str, str]:
    """A quiet turn of role other, then one that fills the disk; their ids once the disk is full."""
    (state / "ballast").write_bytes(b"\0" * BALLAST)
    with target.client(OTHER_HEADERS) as c:
        quiet = c.post("/v1/turns", json={"role": "other", "argv": ["sleep", "3"]}).json()
    with target.client() as c:
        filler = c.post("/v1/turns", json={"role": "builder", "argv": FILLER}).json()
        assert wait_until(lambda: "disk" in _causes(c), timeout=30)
    return quiet["turn_id"], filler["turn_id"]


def _fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no room left."""
    with open(path, "wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)


def test_full_disk_ends_the_filling_turn_and_refuses_new_ones_until_space_returns(
    tmp_path: Path, small_disk: Path
) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, state=small_disk, builder_limits={"output_mb": 1024})
    target = TargetProcess.start(config, url, root / "target.log")
    try:
        quiet_id, filler_id = _start_filling(target, small_disk)
        with target.client() as c, target.client(OTHER_HEADERS) as other:
            # The filling turn: killed, 125, a notice naming the disk, a stream that parses.
            filler_events = events(c, filler_id)
            notice, end = filler_events[-2:]
            assert notice.kind == "notice" and "No space left on device" in notice.message  # type: ignore[union-attr]
            assert str(small_disk) in notice.message  # type: ignore[union-attr]
            assert (end.kind, end.exit_code) == ("exit", 125)  # type: ignore[union-attr]
            assert c.get(f"/v1/turns/{filler_id}").json()["exit_code"] == 125
            # Another role's turn, ending while the disk is full, still gets its end.
            quiet_events = events(other, quiet_id)
            assert (quiet_events[-1].kind, quiet_events[-1].exit_code) == ("exit", 0)  # type: ignore[union-attr]
            # The filler's torn last frame was cut away, which may have freed as much as
            # one read of output: take that too, so the disk is full while this part runs.
            _fill(small_disk / "top-up")
            # New turns: refused cleanly, with a problem body and a time to come back.
            refused = other.post("/v1/turns", json={"role": "other", "argv": ["true"]})
            assert refused.status_code == 503
            assert refused.headers["content-type"] == "application/problem+json"
            assert int(refused.headers["retry-after"]) > 0
            assert refused.json()["reason"] == "disk"
            assert "disk" in _causes(c)

            (small_disk / "ballast").unlink()
            (small_disk / "top-up").unlink()
            assert wait_until(lambda: "disk" not in _causes(c), timeout=30)
            again = other.post("/v1/turns", json={"role": "other", "argv": ["echo", "back"]})
            assert again.status_code == 201
            assert events(other, again.json()["turn_id"])[-1].exit_code == 0  # type: ignore[union-attr]
    finally:
        target.kill()
    # What waited in memory is on disk now, whole: spools and the ledger's ends.
    ledger.verify(small_disk)
    ended = {
        line["turn"]["turn_id"]: line["turn"]
        for line in map(json.loads, (small_disk / ledger.LEDGER).read_text().splitlines())
        if line["kind"] == "end"
    }
    for turn_id, code in ((filler_id, 125), (quiet_id, 0)):
        on_disk = _spool_events(small_disk, turn_id)
        assert (on_disk[-1].kind, on_disk[-1].exit_code) == ("exit", code)  # type: ignore[union-attr]
        assert (ended[turn_id]["state"], ended[turn_id]["exit_code"]) == ("exited", code)


def test_a_target_killed_while_its_disk_is_full_comes_back_with_whole_tails(
    tmp_path: Path, small_disk: Path
) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, state=small_disk, builder_limits={"output_mb": 1024})
    first = TargetProcess.start(config, url, root / "first.log")
    try:
        quiet_id, filler_id = _start_filling(first, small_disk)
        with first.client() as c:
            events(c, filler_id)
    finally:
        first.kill()  # SIGKILL, with the disk still full
    second = TargetProcess.start(config, url, root / "second.log")
    try:
        with second.client() as c, second.client(OTHER_HEADERS) as other:
            # Up, on a full disk: every turn has an end to stream, and health says why it waits.
            for turn_id, client in ((filler_id, c), (quiet_id, other)):
                seen: list[Event] = []
                reader = threading.Thread(target=lambda: seen.extend(events(client, turn_id)))  # noqa: B023
                reader.start()
                reader.join(timeout=30)
                assert seen and seen[-1].kind == "exit", turn_id
                assert client.get(f"/v1/turns/{turn_id}").json()["state"] != "running"
            refused = other.post("/v1/turns", json={"role": "other", "argv": ["true"]})
            assert refused.status_code in (201, 503)
            (small_disk / "ballast").unlink()
            assert wait_until(lambda: "disk" not in _causes(c), timeout=30)
            again = other.post("/v1/turns", json={"role": "other", "argv": ["true"]})
            assert again.status_code == 201
            events(other, again.json()["turn_id"])
    finally:
        second.kill()
    for turn_id in (filler_id, quiet_id):
        assert _spool_events(small_disk, turn_id)[-1].kind == "exit"
    ledger.verify(small_disk)


def test_a_nearly_full_disk_refuses_new_turns_before_any_write_fails(
    tmp_path: Path, small_disk: Path
) -> None:
    """Below the low-water mark a new turn would only find the disk full: refused at once."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, state=small_disk)
    target = TargetProcess.start(config, url, root / "target.log")
    try:
        with target.client(OTHER_HEADERS) as other:
            _fill(small_disk / "top-up")
            refused = other.post("/v1/turns", json={"role": "other", "argv": ["true"]})
            assert refused.status_code == 503, refused.text
            assert refused.json()["reason"] == "disk"
            assert "MiB free" in refused.json()["detail"]
            (small_disk / "top-up").unlink()
            again = other.post("/v1/turns", json={"role": "other", "argv": ["true"]})
            assert again.status_code == 201, again.text
    finally:
        target.kill()


def test_a_spool_the_disk_cannot_make_leaves_nothing_of_the_turn(
    tmp_path: Path, few_inodes: Path
) -> None:
    """No inode left for the turn's spool: the submission gets 503 naming the disk, and
    nothing of the turn happened or stays counted."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, state=few_inodes)
    target = TargetProcess.start(config, url, root / "target.log")
    ran = root / "ws" / "ran"
    try:
        with target.client() as c:
            _use_every_inode(few_inodes / "ballast")
            refused = c.post("/v1/turns", json={"role": "builder", "argv": ["touch", str(ran)]})
            assert refused.status_code == 503, refused.text
            assert refused.json()["reason"] == "disk"
            assert "event spool" in refused.json()["detail"]
            assert c.get("/v1/turns").json() == []
            time.sleep(0.5)  # a command started regardless would have run by now
            assert not ran.exists()
    finally:
        target.kill()


def _use_every_inode(directory: Path) -> None:
    directory.mkdir()
    with contextlib.suppress(OSError):
        for n in itertools.count():
            (directory / str(n)).touch()
