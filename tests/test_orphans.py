"""A sandbox whose bubblewrap died before it was held is killed, not let through its gate.

bubblewrap's child asks for its parent-death signal only once past the gate,
so it outlives a bubblewrap killed (or dead on its own) before the sandbox was
held, and the gate, shut, lets it run the command out of the turn's sight.
Each case runs in a process of its own that becomes a subreaper, as the
target's ``serve`` and the launcher do (the test process must not: it would
take in every orphan of the suite). The launcher's case is in
``test_launcher.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import events, processes_with, wait_until, zombies_of
from process_support import REPO, TargetProcess, write_config

from shared.walk import canonical_path

TURNS = 6
MARKER = "29.75"
"""The sandbox's command: ``sleep MARKER``, found on the host if it ever runs."""

BUBBLEWRAP_AT_ITS_GATE = """
import asyncio, json, os, signal, subprocess, sys, time
from target_side.fence import orphans
from target_side.fence.gate import Gate, StartWatch

def gated():  # bubblewrap started, its status pipe's read end and its gate's write end
    status_read, status_write = os.pipe()
    gate_read, gate_write = os.pipe()
    bwrap = subprocess.Popen(
        # A pid namespace is all it takes (no network one: slow to make on a busy machine).
        ["bwrap", "--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/",
         "--json-status-fd", str(status_write), "--block-fd", str(gate_read),
         "--", "sleep", sys.argv[2]],
        pass_fds=(status_write, gate_read),
    )
    os.close(status_write)
    os.close(gate_read)
    return bwrap, status_read, gate_write

def at_its_gate():
    bwrap, status_read, gate_write = gated()
    line = b""
    while b"\\n" not in line:  # a read may return part of the line
        line += os.read(status_read, 4096)
    os.close(status_read)
    return bwrap, json.loads(line.split(b"\\n")[0])["child-pid"], gate_write

def running(sandbox, marker):  # the command: a child of the sandbox's first process
    wanted = f"sleep\\0{marker}\\0".encode()
    try:
        children = open(f"/proc/{sandbox}/task/{sandbox}/children").read().split()
        return any(open(f"/proc/{c}/cmdline", "rb").read() == wanted for c in children)
    except OSError:
        return False

def anywhere(marker):  # the command running, whoever's child it is
    wanted = f"sleep\\0{marker}\\0".encode()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and open(f"/proc/{entry}/cmdline", "rb").read() == wanted:
                return True
        except OSError:
            pass
    return False

assert orphans.become_subreaper()
case = sys.argv[1]
bwrap, sandbox, gate = at_its_gate()
said = {"sandbox": sandbox}
if case == "watched":
    # bubblewrap dies before its status line is read: the watch's own status pipe says
    # nothing (an end of file), as bubblewrap's does when it dies before writing it.
    os.kill(bwrap.pid, signal.SIGKILL)
    silent, closed = os.pipe()
    os.close(closed)
    watch = StartWatch(asyncio.new_event_loop(), Gate(status=silent, block=gate))
    watch.started(bwrap)
    time.sleep(0.5)  # the thread slow to reap bubblewrap (a loaded machine): the gate holds
    said["ran"] = running(sandbox, sys.argv[2])
    bwrap.wait()
    watch.ended()
elif case == "killed_before_held":
    # The turn killed before its sandbox was held: the watch kills the sandbox as it holds
    # it, instead of opening its gate (bubblewrap alone killed would leave it to run).
    second, status_read, gate_write = gated()
    watch = StartWatch(asyncio.new_event_loop(), Gate(status=status_read, block=gate_write))
    said["deferred"] = watch.kill_when_held()
    watch.started(second)
    time.sleep(0.5)  # had its gate opened, its command would be running by now
    said["ran"] = anywhere(sys.argv[2])
    second.kill()
    second.wait()
    watch.ended()
    bwrap.kill()  # the first one, at its gate all along: not this case's
    bwrap.wait()
    orphans.end_orphaned_sandboxes()
    os.close(gate)
elif case == "bystanders":
    # A live bubblewrap (its sandbox at its gate) and a plain child are nobody's orphans.
    plain = subprocess.Popen(["sleep", sys.argv[2]])
    said["ended"] = orphans.end_orphaned_sandboxes()
    said["alive"] = [bwrap.poll() is None, os.path.exists(f"/proc/{sandbox}"), plain.poll() is None]
    plain.kill()
    bwrap.kill()
    bwrap.wait()
    said["after"] = orphans.end_orphaned_sandboxes()
    os.close(gate)
time.sleep(0.5)  # had the gate let it go, its command would be running by now
said["sandbox_alive"] = os.path.exists(f"/proc/{sandbox}")
print(json.dumps(said))
"""


def _case(name: str) -> dict[str, object]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", BUBBLEWRAP_AT_ITS_GATE, name, MARKER],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        said: dict[str, object] = json.loads(done.stdout)
        assert processes_with("sleep", MARKER) == [], said
        return said
    finally:
        for pid in processes_with("sleep", MARKER):
            os.kill(pid, signal.SIGKILL)


def test_a_watch_that_never_saw_its_sandbox_kills_it_before_the_gate_shuts() -> None:
    said = _case("watched")
    assert said["ran"] is False and said["sandbox_alive"] is False, said


def test_only_sandboxes_orphaned_by_their_bubblewrap_are_killed() -> None:
    said = _case("bystanders")
    # Nothing killed while bubblewrap lived; once it was killed, its sandbox (at its gate,
    # and so without a parent-death signal) came to this process, and was killed.
    assert said["ended"] == [] and said["alive"] == [True, True, True], said
    assert said["after"] == [said["sandbox"]] and said["sandbox_alive"] is False, said


def test_a_sandbox_killed_before_it_was_held_is_killed_at_its_gate() -> None:
    said = _case("killed_before_held")
    assert said["deferred"] is True and said["ran"] is False, said


def test_a_target_reaps_the_sandboxes_bubblewrap_leaves_it(tmp_path: Path) -> None:
    """bubblewrap exits as soon as its sandbox's first process reports the command's status,
    often before that process is gone; the target, a subreaper, is given it. Unreaped, each
    turn left a zombie, counted against the turns' pids bound until no turn could start."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    target = TargetProcess.start(config, url, root / "target.log")
    try:
        with target.client() as client:
            for _ in range(TURNS):
                turn = client.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
                assert events(client, turn.json()["turn_id"])[-1].kind == "exit"
        assert wait_until(lambda: not zombies_of(target.proc.pid), timeout=5), zombies_of(
            target.proc.pid
        )
    finally:
        target.terminate()
