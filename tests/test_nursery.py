"""A turn's bubblewrap born inside its cgroups (cgroup v1) with no gate to wait at, a gate
opened by the thread that started it where a fence is moved in, and the server kept out of
its limits.

The nursery's workers are threads of the server sitting in a turn's cgroups;
nothing that reads a cgroup's members may ever take the server for the turn's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme
from conftest import launch_planned, local_settings, make_settings
from test_durability import served
from test_limits import PIDS_PROBE

from shared.walk import canonical_path
from shared.wire import PlannedLimits, TurnRequest
from target_side.errors import BackendError, RefusedError
from target_side.fence.cgroupfs import TURN_PREFIX
from target_side.fence.gate import Gate, StartWatch
from target_side.fence.identity import InProcess
from target_side.fence.launch import find_bwrap
from target_side.fence.limits import Hierarchy, Limiter, TurnLimits
from target_side.fence.nursery import IDLE_WORKERS, Worker
from target_side.service import turns as turns_module
from target_side.service.app import create_app

LIMITS = PlannedLimits(wall_s=30, memory_mb=256, pids=16, cpu=1.0, output_mb=1, scratch_mb=1)

KILL_WITH_SERVER_LISTED = """
import os, sys
from pathlib import Path
from target_side.fence.limits import Hierarchy, Limiter, TurnLimits
from shared.walk import canonical_path
from shared.wire import PlannedLimits, TurnRequest
cgroup = Path(sys.argv[1])
(cgroup / "cgroup.procs").write_text(f"{os.getpid()}\\n")
limits = PlannedLimits(wall_s=1, memory_mb=1, pids=1, cpu=1.0, output_mb=1, scratch_mb=1)
hierarchy = Hierarchy(1, cgroup.parent, frozenset({"pids"}))
turn = TurnLimits(Limiter([hierarchy]), cgroup.name, limits, {cgroup: hierarchy})
turn.kill()
print("still here")
"""


def _limiter() -> Limiter:
    """This machine's cgroups, as a root server finds them (CI runs as root, with v1 cgroups)."""
    limiter = Limiter.detect()
    if os.getuid() != 0 or not limiter.hierarchies:
        pytest.skip("needs root and writable cgroups")
    return limiter


def _v1_limiter() -> Limiter:
    limiter = _limiter()
    if any(h.version != 1 for h in limiter.hierarchies):
        pytest.skip("the nursery is for cgroup v1 only")
    return limiter


def test_killing_a_turns_cgroup_never_kills_the_server_listed_in_it(tmp_path: Path) -> None:
    # Under cgroup v1 a cgroup lists the process of every thread in it: a worker's, the server.
    cgroup = tmp_path / "paddock-1-t-0"
    cgroup.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", KILL_WITH_SERVER_LISTED, str(cgroup)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "still here\n"), done.stderr


async def test_a_taken_slot_becomes_the_turns_cgroups_with_pids_for_what_is_not_the_turns() -> None:
    limiter = _v1_limiter()
    limiter.start_nursery(asyncio.get_running_loop())
    try:
        assert limiter.nursery is not None
        turn = await _turn_with_worker(limiter)
        assert turn.slot is not None
        for path, hierarchy in turn.dirs.items():
            assert path.name == f"paddock-{os.getpid()}-t-{'f' * 32}"
            assert path.parent == hierarchy.turn_parent
            tasks = (path / "tasks").read_text().split()
            assert tasks == [str(worker_tid(turn.slot))]
            if "pids" in hierarchy.controllers:
                assert (path / "pids.max").read_text().strip() == str(LIMITS.pids + 2)
        turn.remove_now()
        assert not any(path.exists() for path in turn.dirs) and not turn.dirs
    finally:
        limiter.close()


def worker_tid(worker: Worker) -> int | None:
    return worker.tid


async def test_a_process_started_by_a_settled_worker_is_born_in_its_cgroups() -> None:
    limiter = _v1_limiter()
    limiter.start_nursery(asyncio.get_running_loop())
    try:
        turn = await _turn_with_worker(limiter)
        nobody = (65534, 65534)
        process = await InProcess().spawn("nobody", nobody, ["sleep", "30"], (), False, turn)
        try:
            assert turn.born_inside
            seen = Path(f"/proc/{process.pid}/cgroup").read_text()
            for hierarchy in limiter.hierarchies:
                path = _path_in(seen, hierarchy)
                assert path.endswith(f"/paddock-turns/{turn.name}"), (hierarchy, seen)
        finally:
            process.kill()
            await process.wait()
            process.release()
        await turn.remove()
        assert not turn.dirs
    finally:
        limiter.close()


def _path_in(listing: str, hierarchy: Hierarchy) -> str:
    """Where a ``/proc/PID/cgroup`` listing puts its process in ``hierarchy``."""
    (path,) = [
        where
        for _, named, where in (line.split(":", 2) for line in listing.splitlines())
        if hierarchy.controllers & set(named.split(",")) or (not named and hierarchy.version == 2)
    ]
    return path


async def _turn_with_worker(limiter: Limiter, *, keep: bool = True) -> TurnLimits:
    """A turn's limits with a settled worker, waiting up to 2 s for one; with ``keep``
    False only the wait (the worker is left to the nursery)."""
    nursery = limiter.nursery
    assert nursery is not None
    for _ in range(200):
        if not keep:
            if nursery.ready():
                return TurnLimits(limiter, "unused", LIMITS)
        else:
            turn = limiter.for_turn("t-" + "f" * 32, LIMITS)
            if turn.slot is not None:
                return turn
            turn.remove_now()
        await asyncio.sleep(0.01)
    pytest.fail("no worker settled in 2 s")


async def test_a_launch_that_fails_after_taking_a_worker_leaves_the_nursery_its_size(
    tmp_path: Path,
) -> None:
    """A worker taken for a launch that then fails is sent away; another must settle in its
    place, or every such failure (no descriptor left, say) would shrink the nursery for good
    and every later turn would wait for a move."""
    limiter = _v1_limiter()
    limiter.start_nursery(asyncio.get_running_loop())
    settings = local_settings(Path(canonical_path(tmp_path)))
    request = TurnRequest(role="builder", argv=["true"], limits={"wall_s": 30})

    def no_descriptors_left(seam: str) -> None:
        if seam == "open-to-launch":
            raise OSError(errno.EMFILE, "Too many open files")

    try:
        for _ in range(IDLE_WORKERS + 2):
            await _turn_with_worker(limiter, keep=False)  # one settled: the launch takes it
            with pytest.raises(RefusedError, match="Too many open files"):
                await launch_planned(settings, request, inject=no_descriptors_left, limiter=limiter)
        turn = await _turn_with_worker(limiter)
        turn.remove_now()
    finally:
        limiter.close()


async def test_turns_that_fail_after_their_cgroups_were_made_leave_none_behind(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cgroups are made while the turn is planned, before its launch: every way a turn
    can end between the two (the launch failing, bubblewrap gone, the seat lost) removes
    them, and sends its settled worker away to be replaced."""
    limiter = _limiter()
    failing: dict[str, str | None] = {"step": None}

    def fail(step: str) -> None:
        if step == failing["step"]:
            raise OSError(errno.EMFILE, "Too many open files")

    def no_bwrap() -> str:
        raise BackendError("bubblewrap is not installed")

    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca), inject=fail)
    ended: list[dict[str, object]] = []
    async with served(app) as client:

        async def submit() -> None:
            answer = await client.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            ended.append(answer.json())

        failing["step"] = "check-to-open"  # inside the launch, which owns them by then
        for _ in range(IDLE_WORKERS + 1):
            await submit()
        failing["step"] = None
        manager = app.state.manager
        monkeypatch.setattr(manager, "_bwrap", None)
        monkeypatch.setattr(turns_module, "find_bwrap", no_bwrap)  # before the launch
        for _ in range(IDLE_WORKERS + 1):
            await submit()
        monkeypatch.undo()
        nursery = manager.limiter.nursery
        for _ in range(200):
            if nursery is None or nursery.ready():
                break
            await asyncio.sleep(0.01)
        assert nursery is None or nursery.ready()
    assert [t["exit_code"] for t in ended] == [126] * (2 * IDLE_WORKERS + 2)
    assert {t["refusal"]["rule"] for t in ended} == {"backend-unavailable"}  # type: ignore[index]
    names = {f"{TURN_PREFIX}{os.getpid()}-{t['turn_id']}" for t in ended}
    left = [p for h in limiter.hierarchies for p in h.turn_parent.iterdir() if p.name in names]
    assert left == []


async def test_a_fence_born_inside_its_cgroups_runs_its_command_without_waiting_to_be_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is to be done before its command may run, so it has no gate: a thread slow to
    hold it (not yet scheduled, waiting for the interpreter lock) holds nothing back. With a
    gate, the command would start only once held, half a second later."""
    limiter = _v1_limiter()
    limiter.start_nursery(asyncio.get_running_loop())
    held_at: list[float] = []
    real_hold = StartWatch._hold

    def slow_hold(watch: StartWatch, process: subprocess.Popen[bytes], pid: int) -> object:
        time.sleep(0.5)
        held_at.append(time.time())
        return real_hold(watch, process, pid)

    monkeypatch.setattr(StartWatch, "_hold", slow_hold)
    settings = local_settings(Path(canonical_path(tmp_path)))
    request = TurnRequest(
        role="builder", argv=["python3", "-c", "import time; print(time.time())"], limits={}
    )
    try:
        await _turn_with_worker(limiter, keep=False)
        outcome, seen = await launch_planned(settings, request, limiter=limiter)
    finally:
        limiter.close()
    assert outcome.exit_code == 0, seen
    ran_at = float("".join(str(f.get("data", "")) for kind, f in seen if kind == "stdout"))
    assert held_at and ran_at < held_at[0]


async def test_without_a_gate_only_bubblewraps_own_child_is_held() -> None:
    """Held after its command may have run, the sandbox's pid may be another process's by
    then: a pidfd is kept only on a process that is still bubblewrap's child."""
    loop = asyncio.get_running_loop()
    parent = subprocess.Popen(  # stands for bubblewrap: one child, the sandbox
        ["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE
    )
    stranger = subprocess.Popen(["sleep", "30"])  # the pid's next owner, not its child
    assert parent.stdout is not None
    sandbox = int(parent.stdout.readline())
    try:
        for pid, ours in ((stranger.pid, False), (sandbox, True)):
            status_read, status_write = os.pipe()
            os.close(status_write)
            watch = StartWatch(loop, Gate(status_read, -1, None))
            held = watch._hold(parent, pid)
            os.close(status_read)
            if ours:
                assert held.error is None and held.reaper is not None
                os.close(held.reaper)
            else:
                assert isinstance(held.error, ProcessLookupError) and held.reaper is None
    finally:
        for process in (parent, stranger):
            process.kill()
            process.wait()
        parent.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(sandbox, signal.SIGKILL)


async def test_a_turn_started_without_a_worker_is_placed_in_its_cgroups(tmp_path: Path) -> None:
    limiter = Limiter.detect()  # no nursery: the fence is moved in once it is up, as under v2
    if os.getuid() != 0 or limiter.controller("pids") is None:
        pytest.skip("needs root and a pids cgroup")
    settings = local_settings(Path(canonical_path(tmp_path)))
    request = TurnRequest(
        role="builder", argv=["python3", "-c", PIDS_PROBE], limits={"pids": 8, "wall_s": 30}
    )
    outcome, seen = await launch_planned(settings, request, limiter=limiter)
    assert outcome.exit_code == 0
    # Moved in once up, bubblewrap's outer process stays outside: the turn has its 8.
    assert "".join(str(f.get("data", "")) for kind, f in seen if kind == "stdout") == "8\n"


async def test_a_turn_placed_after_it_started_runs_its_command_inside_its_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moved in while it waits at its gate, before it can start anything: a process forked
    before the move would stay outside, so the command's own cgroups are the turn's.

    The move is made as slow as a cgroup v1 move can be (it may wait out an RCU grace
    period): a gate opened before it would let the command start first."""
    limiter = _limiter()  # no nursery: the fence is moved in once it is up
    real_place = TurnLimits.place

    def slow_place(self: TurnLimits, pid: int) -> None:
        time.sleep(0.1)
        real_place(self, pid)

    monkeypatch.setattr(TurnLimits, "place", slow_place)
    settings = local_settings(Path(canonical_path(tmp_path)))
    request = TurnRequest(role="builder", argv=["cat", "/proc/self/cgroup"], limits={"wall_s": 30})
    for _ in range(3):
        outcome, seen = await launch_planned(settings, request, limiter=limiter)
        assert outcome.exit_code == 0
        cgroups = "".join(str(f.get("data", "")) for kind, f in seen if kind == "stdout")
        for hierarchy in limiter.hierarchies:
            path = _path_in(cgroups, hierarchy)
            assert f"/{TURN_PREFIX}{os.getpid()}-t-" in path, (hierarchy, cgroups)


async def test_a_turn_whose_limits_cannot_be_applied_is_refused_before_its_command_runs(
    tmp_path: Path,
) -> None:
    """Its cgroups gone just before bubblewrap starts: the move fails while the fence waits at
    its gate; it is killed there, so the command never runs, and the turn is refused."""
    limiter = _limiter()  # no nursery: the fence is moved in once it is up
    settings = local_settings(Path(canonical_path(tmp_path)))
    ran = Path(settings.roles["builder"].workspaces[0]) / "ran"

    def ours() -> set[Path]:
        pattern = f"{TURN_PREFIX}{os.getpid()}-t-*"
        return {c for h in limiter.hierarchies for c in h.turn_parent.glob(pattern)}

    earlier = ours()  # an earlier test's turn in this process, maybe not yet removed

    def remove_the_turns_cgroups(seam: str) -> None:
        if seam == "open-to-launch":
            for cgroup in ours() - earlier:
                cgroup.rmdir()

    request = TurnRequest(role="builder", argv=["touch", str(ran)], limits={"wall_s": 30})
    outcome, _ = await launch_planned(
        settings, request, inject=remove_the_turns_cgroups, limiter=limiter
    )
    assert outcome.exit_code == 126
    assert outcome.refusal is not None and outcome.refusal.rule == "backend-unavailable"
    assert "limits could not be applied" in outcome.refusal.detail
    await asyncio.sleep(0.2)  # a command let through would have touched it by now
    assert not ran.exists()


async def test_a_fence_whose_limits_fail_is_killed_while_it_waits_at_its_gate() -> None:
    """The thread holding the gate never opens it on a failed move: it kills the sandbox and
    bubblewrap first, and closes the gate unopened."""
    limiter = _limiter()
    turn = limiter.for_turn("t-" + "e" * 32, LIMITS)
    for cgroup in turn.dirs:
        cgroup.rmdir()  # the move into them fails
    status_read, status_write = os.pipe()
    block_read, block_write = os.pipe()
    gate_seen = os.dup(block_read)
    argv = [find_bwrap(), "--unshare-pid", "--ro-bind", "/", "/", "--json-status-fd",
            str(status_write), "--block-fd", str(block_read), "--", "true"]  # fmt: skip
    process = subprocess.Popen(argv, pass_fds=(status_write, block_read))
    os.close(status_write)
    os.close(block_read)
    watch = StartWatch(asyncio.get_running_loop(), Gate(status_read, block_write, turn))
    try:
        await asyncio.to_thread(watch.started, process)
        held = await watch.held
        assert isinstance(held.error, OSError) and not isinstance(held.error, ProcessLookupError)
        # Never got to run ``true`` (which would end it 0): killed itself, or, when its
        # sandbox's death reaches it before its own kill, ended 128 + SIGKILL saying so.
        assert process.wait(timeout=10) in (-signal.SIGKILL, 128 + signal.SIGKILL)
        assert os.read(gate_seen, 1) == b""  # closed, never opened
    finally:
        process.kill()
        process.wait()
        await asyncio.to_thread(watch.ended)
        os.close(gate_seen)
        if held_reaper := (watch.held.result().reaper if watch.held.done() else None):
            os.close(held_reaper)
        turn.remove_now()


async def test_the_wall_time_limit_counts_from_bubblewraps_start_however_busy_the_loop_is(
    tmp_path: Path,
) -> None:
    """The gate opens without the event loop: a loop kept busy for a second after the launch
    (as in a burst) must not add that second to the command's ``wall_s``."""
    settings = local_settings(Path(canonical_path(tmp_path)))
    request = TurnRequest(role="builder", argv=["sleep", "1.6"], limits={"wall_s": 1})
    outcome, seen = await launch_planned(settings, request, busy_loop_s=1.0)
    assert outcome.exit_code == 124, seen
    assert 1.0 <= outcome.wall_s < 1.5
