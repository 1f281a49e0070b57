"""Sandboxes whose bubblewrap died before they were held: taken in as children, and killed.

bubblewrap's child, the first process of a turn's sandbox (pid 1 of its pid
namespace), waits at the gate (``fence.gate``) before the command runs, and
asks for its parent-death signal only once it is past it. When bubblewrap
dies before that child was held (killed as the turn started, or ended on its
own before its status line named the child), the child outlives it, and the
gate, once closed, lets it go on: it runs the command, out of sight of the
turn, its wall time, its kill and (moved in at its gate) its cgroups.

A child subreaper (``PR_SET_CHILD_SUBREAPER``) is given the orphans of its
descendants as its own children, the moment their parent exits. So the
processes that start bubblewrap (the target's ``serve`` and the launcher)
become subreapers, and whoever reaps a bubblewrap whose sandbox was never
held looks among its own children, before the gate closes, for processes in
a pid namespace below its own (which only a sandbox's first process is),
and kills and reaps each. A target embedded in another process (the tests,
``paddock run --local``) does not change that process into a subreaper:
there the orphan goes to the process that already is one, or to init.

Standard library only: the privileged launcher imports it too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal

from target_side.fence import raw_syscalls

log = logging.getLogger("paddock.target")

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans; whether it now is."""
    try:
        raw_syscalls.call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, LookupError) as exc:
        log.warning(
            "cannot take in orphaned sandboxes (%s): a sandbox whose bubblewrap dies before "
            "it is held would be left to run",
            exc,
        )
        return False
    return True


def end_orphaned_sandboxes() -> list[int]:
    """Kill and reap every child of this process that lives in a pid namespace below its
    own; their pids.

    A child of ours cannot be reaped by anyone else, so its pid stays its own
    until we reap it here: no kill reaches a recycled pid.
    """
    ended = []
    for pid in _children():
        if _namespace_depth(pid) <= _own_depth():
            continue  # bubblewrap itself, or a helper: in our own pid namespace
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its whole pid namespace goes with it
            os.waitpid(pid, 0)
            ended.append(pid)
    if ended:
        log.warning(
            "killed %d sandbox(es) whose bubblewrap had died before they were held: %s",
            len(ended),
            " ".join(map(str, ended)),
        )
    return ended


def _children() -> set[int]:
    """Every child of this process, whichever of its threads it was given to."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            path = f"/proc/self/task/{task}/children"
            with contextlib.suppress(OSError), open(path, "rb") as children:
                found.update(int(pid) for pid in children.read().split())
    return found


@functools.cache
def _own_depth() -> int:
    return _namespace_depth(os.getpid())


def _namespace_depth(pid: int) -> int:
    """How many pid namespaces ``pid`` is seen in (``NSpid``); 0 if it cannot be read."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status", "rb") as status:
        for line in status:
            if line.startswith(b"NSpid:"):
                return len(line.split()) - 1
    return 0
