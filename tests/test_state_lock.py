"""One server per state root: a second one refuses, even while the first is stopping."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import wait_until
from process_support import TargetProcess, follow_into, wait_for_exit, write_config

from shared.walk import canonical_path
from shared.wire import Event
from target_side.errors import StateRootBusy
from target_side.service import ledger
from target_side.service.state_lock import StateLock


def test_second_server_on_the_same_state_root_refuses_naming_the_holder(tmp_path: Path) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    first = TargetProcess.start(config, url, root / "first.log")
    try:
        second = TargetProcess.start(config, url, root / "second.log", wait=False)
        status = wait_for_exit(second.proc, timeout=30)
        said = (root / "second.log").read_text()
        assert status not in (None, 0), said
        assert f"in use by another paddock-target (pid {first.proc.pid}, started " in said
        assert first.up()  # the first one never noticed
    finally:
        first.kill()


def test_state_lock_is_taken_once_and_freed_with_its_holder(tmp_path: Path) -> None:
    held = StateLock.acquire(tmp_path, "127.0.0.1:1")
    with pytest.raises(StateRootBusy, match=r"listening on 127\.0\.0\.1:1"):
        StateLock.acquire(tmp_path)
    held.release()
    StateLock.acquire(tmp_path).release()


def test_quick_restart_after_sigterm_refuses_instead_of_forking_the_ledger(
    tmp_path: Path,
) -> None:
    """What a supervisor does: SIGTERM, then start again at once, while a client follows a turn."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"stop_grace_s": 10.0})
    first = TargetProcess.start(config, url, root / "first.log")
    seen: list[Event] = []
    try:
        with first.client() as c:
            script = "for i in $(seq 1 20); do echo line $i; sleep 0.1; done"
            turn = c.post("/v1/turns", json={"role": "builder", "argv": ["sh", "-c", script]})
            turn_id = turn.json()["turn_id"]
            follower = follow_into(c, turn_id, seen)
            assert wait_until(lambda: bool(seen), timeout=10)
            first.proc.terminate()
            second = TargetProcess.start(config, url, root / "second.log", wait=False)
            assert wait_for_exit(second.proc, timeout=30) not in (None, 0)
            follower.join(timeout=30)
        assert wait_for_exit(first.proc, timeout=30) is not None
    finally:
        first.kill()
    said = (root / "second.log").read_text()
    assert f"pid {first.proc.pid}" in said
    # The client saw a whole stream, to its exit event, from the one server that ran it.
    assert seen[-1].kind == "exit"
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    third = TargetProcess.start(config, url, root / "third.log")
    try:
        with third.client() as c:
            assert c.get(f"/v1/turns/{turn_id}").json()["state"] == "exited"
    finally:
        third.terminate()
    assert ledger.verify(root / "state").count >= 2
