"""Caps on running turns: 429 with Retry-After over a cap (the client waits for room), and all
turns together inside one parent cgroup whose memory and pids bound the target as a whole."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import BUILDER_TOKEN, events, output, processes_with, wait_until
from process_support import (
    OTHER_HEADERS,
    TargetProcess,
    follow_into,
    target_process,
    write_config,
)

from agent_side.client import TargetClient
from shared.walk import canonical_path
from shared.wire import Event, Turn, TurnRequest
from target_side.fence.cgroupfs import cgroup_mounts, memberships, under, v1_mount

SPAWN = """
import subprocess, sys, time
children = []
for _ in range(30):
    try:
        children.append(subprocess.Popen(["sleep", "{marker}"]))
    except OSError:
        break
print(len(children), flush=True)
time.sleep(4)
"""
"""Starts up to 30 processes, prints how many it could, and holds them for 4 s."""

HOLD = "x = b'x' * (100 << 20); print('holding', flush=True); import time; time.sleep(4)"


def _post(c: httpx.Client, argv: list[str], role: str = "builder") -> httpx.Response:
    return c.post("/v1/turns", json={"role": role, "argv": argv})


def test_over_the_target_cap_is_429_and_the_client_waits_for_room(tmp_path: Path) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"max_turns": 2})
    with target_process(config, url, root / "target.log") as target, target.client() as c:
        first, second = (Turn.model_validate(_post(c, ["sleep", "2"]).json()) for _ in range(2))
        over = _post(c, ["true"])
        assert over.status_code == 429
        assert over.headers["content-type"] == "application/problem+json"
        assert int(over.headers["retry-after"]) >= 1
        body = over.json()
        assert (body["cap"], body["limit"]) == ("server.max_turns", 2)
        assert "[server] max_turns = 2" in body["detail"]
        # The client waits out the Retry-After and asks again until one of the two has ended.
        with TargetClient(url, BUILDER_TOKEN) as client:
            third = client.submit(TurnRequest(role="builder", argv=["true"]))
        assert third.state == "running" or third.exit_code == 0
        ended = [
            Turn.model_validate(c.get(f"/v1/turns/{t.turn_id}").json()) for t in (first, second)
        ]
        assert any(t.ended_at is not None and t.ended_at <= third.created_at for t in ended)
        events(c, third.turn_id)


def test_over_the_role_cap_is_429_naming_it_while_other_roles_run(tmp_path: Path) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, builder_limits={"turns": 1})
    with (
        target_process(config, url, root / "target.log") as target,
        target.client() as c,
        target.client(OTHER_HEADERS) as other,
    ):
        running = _post(c, ["sleep", "2"])
        assert running.status_code == 201
        over = _post(c, ["true"])
        assert over.status_code == 429
        assert over.json()["cap"] == "roles.builder.limits.turns"
        assert "[roles.builder.limits] turns = 1" in over.json()["detail"]
        assert _post(other, ["true"], role="other").status_code == 201
        events(c, running.json()["turn_id"])
        assert _post(c, ["true"]).status_code == 201


@pytest.fixture
def own_cgroup() -> Iterator[tuple[Callable[[], None], dict[str, Path]]]:
    """Memory and pids cgroups of its own for a server process, as systemd would give it."""
    if os.getuid() != 0:
        pytest.skip("making cgroups needs root")
    mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    places = memberships(Path("/proc/self/cgroup").read_text())
    name = f"paddock-test-{uuid.uuid4().hex[:8]}"
    made: dict[str, Path] = {}
    for controller in ("memory", "pids"):
        mount = v1_mount(mounts, controller)
        base = under(mount, places[controller]) if mount and controller in places else None
        if base is None:
            pytest.skip(f"no cgroup v1 {controller} hierarchy here")
        (base / name).mkdir()
        made[controller] = base / name

    def enter() -> None:
        for path in made.values():
            (path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    try:
        yield enter, made
    finally:
        for path in made.values():
            for child in sorted(path.glob("**/"), key=lambda p: len(p.parts), reverse=True):
                if child != path:
                    child.rmdir()
            path.rmdir()


def test_all_turns_together_are_bounded_by_the_targets_memory_and_pids(
    tmp_path: Path, own_cgroup: tuple[Callable[[], None], dict[str, Path]]
) -> None:
    enter, cgroups = own_cgroup
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"pids": 40, "memory_mb": 150})
    target = TargetProcess.start(config, url, root / "target.log", preexec=enter)
    try:
        with target.client() as c:
            assert (cgroups["pids"] / "paddock-turns" / "pids.max").read_text().strip() == "40"
            marker = f"{uuid.uuid4().int % 1000 + 100}.5"
            script = SPAWN.replace("{marker}", marker)
            first = _post(c, ["python3", "-c", script]).json()
            assert wait_until(lambda: len(processes_with("sleep", marker)) == 30, timeout=30)
            # Every turn process sits below the one parent, in every hierarchy.
            for pid in processes_with("sleep", marker)[:3]:
                places = memberships(Path(f"/proc/{pid}/cgroup").read_text())
                for controller in ("memory", "pids"):
                    assert "/paddock-turns/paddock-" in places[controller]
            second = _post(c, ["python3", "-c", script]).json()
            started = [int(output(events(c, t["turn_id"]))) for t in (first, second)]
            # The role allows each turn 1024 pids; together they got no more than the target's 40.
            assert started[0] == 30
            assert sum(started) <= 40 - 4

            holders = [_post(c, ["python3", "-c", HOLD]).json()]
            seen: list[Event] = []
            with target.client() as watcher:
                follower = follow_into(watcher, holders[0]["turn_id"], seen)
                assert wait_until(lambda: "holding" in output(seen), timeout=30)
                holders.append(_post(c, ["python3", "-c", HOLD]).json())
                follower.join(timeout=30)
            for t in holders:
                events(c, t["turn_id"])
            ends = [c.get(f"/v1/turns/{t['turn_id']}").json() for t in holders]
            # Each may use 4096 MiB; two holding 100 MiB each are past the target's 150 MiB.
            assert 137 in [t["exit_code"] for t in ends]
    finally:
        target.kill()
