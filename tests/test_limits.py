"""Limits: a fork bomb, a memory hog, an output flood and a busy loop each end only their turn."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import (
    PIDS_PROBE,
    Target,
    events,
    finished,
    launch_planned,
    local_settings,
    output,
    run,
    submit,
    wait_until,
)
from process_support import parent_pid

from shared.walk import canonical_path
from shared.wire import PlannedLimits, TurnRequest
from target_side.fence.cgroupfs import cgroup_mounts
from target_side.fence.limits import Hierarchy, Limiter, Totals

HOG = "x = b'x' * (400 << 20); print('survived')"


def _processes_seen(client: httpx.Client, pids: int) -> int:
    turn, evs = run(client, ["python3", "-c", PIDS_PROBE], limits={"pids": pids, "wall_s": 30})
    assert turn.exit_code == 0, output(evs, "stderr")
    return int(output(evs))


def test_pids_limit_caps_the_turns_processes(client: httpx.Client) -> None:
    assert _processes_seen(client, 32) <= 32


def test_pids_limit_is_exactly_the_turns_own(client: httpx.Client) -> None:
    # Neither bubblewrap's outer process nor the server thread that started the turn inside
    # its cgroups (fence.nursery) takes one of the turn's.
    assert [_processes_seen(client, pids) for pids in (8, 16)] == [8, 16]


def _in_cgroup_of(turn_id: str) -> int:
    """Host processes whose cgroup is the turn's (any hierarchy), but bubblewrap's outer one.

    That one is the server's own child (the server runs in this process), in the turn's
    cgroups when the turn was born inside them; ``pids.max`` counts it as a seat, not as
    one of the turn's own processes (``Worker.seats``).
    """
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if turn_id in Path(f"/proc/{entry}/cgroup").read_text():
                    count += parent_pid(entry) != os.getpid()
            except OSError:
                continue
    return count


def test_fork_bomb_ends_its_own_turn_and_others_carry_on(client: httpx.Client) -> None:
    # Launched only once the pids limit is seen to hold: unbounded, a bomb would take the machine.
    if _processes_seen(client, 32) > 32:
        pytest.fail("the pids limit does not hold here; not launching a fork bomb")
    bomb = submit(
        client,
        argv=["bash", "-c", ":(){ :|:& };:; exec sleep 60"],
        limits={"pids": 64, "wall_s": 5},
    )
    assert wait_until(lambda: _in_cgroup_of(bomb.turn_id) > 8)
    peak = max(_in_cgroup_of(bomb.turn_id) for _ in range(20))
    neighbour, evs = run(client, ["echo", "alive"])
    assert (neighbour.exit_code, output(evs)) == (0, "alive\n")
    assert client.get("/v1/health").status_code == 200
    done = finished(client, bomb.turn_id)
    assert done.exit_code == 124
    assert peak <= 64
    assert wait_until(lambda: _in_cgroup_of(bomb.turn_id) == 0)


def test_memory_hog_is_oom_killed_with_137(client: httpx.Client) -> None:
    turn, evs = run(client, ["python3", "-c", HOG], limits={"memory_mb": 64})
    assert (turn.exit_code, turn.signal) == (137, 9)
    assert "survived" not in output(evs)
    assert any(e.kind == "notice" and "out of memory" in e.message for e in evs)
    assert turn.usage is not None and turn.usage.max_rss_kb is not None
    assert turn.usage.max_rss_kb <= 64 * 1024


def test_an_oom_kill_ends_the_whole_turn_not_one_process(client: httpx.Client) -> None:
    """cgroup v2 ends the whole turn at its memory limit; v1 killed the one process and let
    the shell that started it carry on, reporting whatever it liked."""
    script = f'python3 -c "{HOG}"; echo carried on; exit 0'
    turn, evs = run(client, ["sh", "-c", script], limits={"memory_mb": 64})
    assert "carried on" not in output(evs)
    assert (turn.exit_code, turn.signal) == (137, 9)
    notices = [e.message for e in evs if e.kind == "notice"]
    assert any("out of memory" in n for n in notices), notices


def test_output_flood_is_cut_at_its_limit_and_a_concurrent_turn_carries_on(
    client: httpx.Client, target: Target
) -> None:
    results: dict[str, object] = {}

    def neighbour() -> None:
        with target.client() as c:
            results["turn"], results["events"] = run(c, ["sh", "-c", "sleep 1; echo fine"])

    other = threading.Thread(target=neighbour)
    other.start()
    flood = submit(client, argv=["yes"], limits={"output_mb": 1})
    flood_events = events(client, flood.turn_id)
    other.join()
    done = finished(client, flood.turn_id)
    assert done.output_truncated is True
    assert done.exit_code == 137
    assert len(output(flood_events).encode()) <= 1 << 20
    assert output(results["events"]) == "fine\n"  # type: ignore[arg-type]
    assert client.get("/v1/health").status_code == 200


def _busy_cpu_s(client: httpx.Client, cpu: float) -> float:
    """CPU seconds two 2 s busy loops get under ``cpu`` CPUs, as the turn's usage reports it."""
    started = time.monotonic()
    loops = ["timeout", "2", "sh", "-c", "while :; do :; done & while :; do :; done"]
    turn, _ = run(client, loops, limits={"cpu": cpu})
    assert time.monotonic() - started >= 2
    assert turn.usage is not None and turn.usage.cpu_s is not None
    return turn.usage.cpu_s


def test_cpu_limit_bounds_cpu_time_and_usage_is_reported(client: httpx.Client) -> None:
    # Measured against an unlimited run of the same loops: a loaded machine gives them less
    # than two CPUs, but still far more than the 0.1 CPUs (0.2 s) the limit allows.
    unlimited = _busy_cpu_s(client, 2.0)
    limited = _busy_cpu_s(client, 0.1)
    assert 0.01 < limited < 0.35, (limited, unlimited)
    assert limited < unlimited * 0.5, (limited, unlimited)


def test_health_says_which_limits_are_degraded(client: httpx.Client) -> None:
    causes = {c["cause"]: c["detail"] for c in client.get("/v1/health").json()["causes"]}
    expected = Limiter.detect().degraded()
    assert causes.get("limits") == expected


def test_turn_cgroups_are_removed_when_turns_end(client: httpx.Client) -> None:
    turn, _ = run(client, ["true"])
    for hierarchy in Limiter.detect().hierarchies:
        assert hierarchy.turn_parent.name == "paddock-turns"
        # Removed just after the turn's end is out, not before it.
        parent = hierarchy.turn_parent
        assert wait_until(lambda p=parent: not [c for c in p.iterdir() if turn.turn_id in c.name])


# --- the rlimit fallback, and cgroup v2, where this machine cannot show them ------------------


async def test_without_cgroups_memory_falls_back_to_a_per_process_rlimit(tmp_path: Path) -> None:
    settings = local_settings(Path(canonical_path(tmp_path)))
    request = TurnRequest(role="builder", argv=["python3", "-c", HOG], limits={"memory_mb": 64})
    outcome, seen = await launch_planned(settings, request, limiter=Limiter(()))
    stderr = "".join(str(f.get("data", "")) for kind, f in seen if kind == "stderr")
    assert outcome.exit_code == 1
    assert "MemoryError" in stderr


def test_without_cgroups_health_names_each_degraded_limit() -> None:
    degraded = Limiter(()).degraded() or ""
    assert "memory_mb limits each process's address space (RLIMIT_AS)" in degraded
    assert "cpu is not enforced" in degraded
    # Turns run as their role's own uid, never root: RLIMIT_NPROC binds them (as a role).
    assert "pids limits all processes of the role's uid (RLIMIT_NPROC)" in degraded


def _fake_v2(tmp_path: Path) -> tuple[Path, Path]:
    """A /proc/self and a cgroup2 'mount' in plain directories, the server in /svc."""
    proc, mount = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (mount / "svc").mkdir(parents=True)
    (mount / "svc" / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (mount / "svc" / "cgroup.subtree_control").write_text("")
    (proc / "cgroup").write_text("0::/svc\n")
    (proc / "mountinfo").write_text(
        f"30 23 0:26 / {mount} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
    )
    return proc, mount / "svc"


def test_cgroup_v2_delegated_subtree_is_detected_and_written(tmp_path: Path) -> None:
    proc, base = _fake_v2(tmp_path)
    limiter = Limiter.detect(proc, totals=Totals(memory_mb=512, pids=100))
    parent = base / "paddock-turns"
    controllers = frozenset({"memory", "pids", "cpu"})
    assert limiter.hierarchies == (Hierarchy(2, base, controllers, turns=parent),)
    assert limiter.degraded() is None
    # The server left its own cgroup for a leaf, so the controllers could be handed down.
    assert (base / "paddock-server" / "cgroup.procs").read_text() == f"{os.getpid()}\n"
    # Every turn together: below one parent, whose limits are the target's totals.
    assert (parent / "memory.max").read_text() == str(512 << 20)
    assert (parent / "pids.max").read_text() == "100"
    turn = limiter.for_turn(
        "t-" + "a" * 32,
        PlannedLimits(wall_s=60, memory_mb=64, pids=32, cpu=0.5, output_mb=1, scratch_mb=1),
    )
    (cgroup,) = turn.dirs
    assert cgroup.parent == parent
    written = {f.name: f.read_text() for f in cgroup.iterdir()}
    assert written == {
        "memory.max": str(64 << 20),
        "memory.swap.max": "0",
        "memory.oom.group": "1",
        "pids.max": "32",
        "cpu.max": "50000 100000",
    }
    turn.place(4242)
    assert (cgroup / "cgroup.procs").read_text() == "4242\n"
    (cgroup / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (cgroup / "memory.peak").write_text(f"{10 << 20}\n")
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    usage = turn.usage()
    assert (usage.cpu_s, usage.max_rss_kb, usage.oom_kills) == (1.5, 10 * 1024, 1)


def test_stale_turn_cgroups_of_a_dead_server_are_reaped(tmp_path: Path) -> None:
    proc, base = _fake_v2(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = base / f"paddock-{dead.pid}-t-{'b' * 32}"
    stale_below = base / "paddock-turns" / f"paddock-{dead.pid}-t-{'d' * 32}"
    live = base / "paddock-turns" / f"paddock-{os.getpid()}-t-{'c' * 32}"
    stale.mkdir()
    stale_below.mkdir(parents=True)
    live.mkdir()
    Limiter.detect(proc)
    assert not stale.exists()
    assert not stale_below.exists()
    assert live.exists()


def _cgroup2_mount() -> Path | None:
    """Where this machine mounts a cgroup v2 tree, if it does."""
    mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    return next((Path(m.point) for m in mounts if m.version == 2), None)


class _Slot:
    """What a turn takes a slot for: its cgroups, and one task in them not the turn's."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.seats = 1


def test_a_slot_under_cgroup_v2_becomes_the_turns_under_its_own_name() -> None:
    # cgroup v2 renames no cgroup (EPERM): a prepared launch's slot is taken as it is named.
    mount = _cgroup2_mount()
    if os.getuid() != 0 or mount is None:
        if os.environ.get("PADDOCK_REQUIRE_CGROUPS"):
            pytest.fail("no cgroup v2 tree to make a slot in, and CI requires one")
        pytest.skip("needs root and a cgroup v2 tree")
    parent = mount / f"paddock-test-{os.getpid()}"
    slot = parent / f"paddock-{os.getpid()}-t-{'e' * 32}"
    slot.mkdir(parents=True)
    try:
        hierarchy = Hierarchy(2, parent, frozenset())
        limits = PlannedLimits(wall_s=5, memory_mb=64, pids=8, cpu=1.0, output_mb=1, scratch_mb=1)
        turn = Limiter([hierarchy]).make_for_turn("t-" + "1" * 32, limits, _Slot([slot]))
        assert turn.dirs == {slot: hierarchy}
        assert slot.is_dir()
    finally:
        for made in (slot, parent):
            if made.exists():
                made.rmdir()
