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

Every turn leaves one, too: bubblewrap exits as soon as its sandbox's first
process reports the command's exit status, and that process, still exiting
or already a zombie, is handed to the subreaper. Left there, each turn's
stays a zombie for the server's life, its pid counted against the turns'
pids bound (``[server] pids``) until no bubblewrap can fork. So after every
bubblewrap it reaps, the reaper reaps these too (``reap_orphaned_sandboxes``),
killing any still alive: its command has ended with bubblewrap, and the pid
namespace goes with it.

Orphans are given to the subreaper's first live thread, its main thread (the
kernel's ``find_new_reaper``), so only that thread's children are looked at:
one file, not one per thread. The look and the reaping are one step under a
lock: a pid listed by one sweep is reaped by that sweep alone, so no other
can kill or reap it once its number may belong to someone else.

Standard library only: the privileged launcher imports it too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import signal
import threading

from target_side.fence import raw_syscalls

log = logging.getLogger("paddock.target")

PR_SET_CHILD_SUBREAPER = 36

DYING_S = 0.1
"""How long a sweep waits for an orphaned sandbox it killed to die before leaving it to the
next: one killed dies in microseconds, unless the kernel holds it (a hung file system)."""

_sweeping = threading.Lock()
_is_subreaper = False


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
    global _is_subreaper
    _is_subreaper = True
    return True


def reap_orphaned_sandboxes() -> list[int]:
    """After a bubblewrap was reaped: reap the sandboxes handed to this process, killing any
    still alive and waiting ``DYING_S`` at most for each to die (the next sweep reaps a
    slower one); their pids. Nothing to do in a process that takes in no orphans."""
    if not _is_subreaper:
        return []
    with _sweeping:
        return [pid for pid in _orphaned() if _end(pid, DYING_S)]


def end_orphaned_sandboxes() -> list[int]:
    """Kill and reap every child of this process that lives in a pid namespace below its
    own, waiting for each; their pids. For a bubblewrap whose sandbox was never held: its
    sandbox may wait at its gate, alive, and must be gone before the gate shuts.

    A child of ours cannot be reaped by anyone else (sweeps take turns), so its pid
    stays its own until we reap it here: no kill reaches a recycled pid.
    """
    with _sweeping:
        ended = [pid for pid in _orphaned() if _end(pid, None)]
    if ended:
        log.warning(
            "killed %d sandbox(es) whose bubblewrap had died before they were held: %s",
            len(ended),
            " ".join(map(str, ended)),
        )
    return ended


def _orphaned() -> list[int]:
    """Children of this process in a pid namespace below its own: only a sandbox's first
    process is (bubblewrap itself and every helper live in ours)."""
    return [pid for pid in children() if _namespace_depth(pid) > _own_depth()]


def _end(pid: int, within_s: float | None) -> bool:
    """SIGKILL ``pid`` (its whole pid namespace goes with it) and reap it once it has died,
    waiting ``within_s`` at most (None: for as long as it takes); whether it was reaped."""
    with contextlib.suppress(ChildProcessError, ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        if within_s is None:
            os.waitpid(pid, 0)
            return True
        _dead_within(pid, within_s)
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        return reaped == pid
    return False


def _dead_within(pid: int, within_s: float) -> None:
    """Wait until ``pid`` (a child of ours, not reaped: its number is its own) has died."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        poller.poll(within_s * 1000)
    finally:
        os.close(pidfd)


def children() -> set[int]:
    """The children of this process's main thread, to which the kernel gives its orphans
    (and which a single-threaded program starts its own from)."""
    with contextlib.suppress(OSError), open(f"/proc/self/task/{os.getpid()}/children", "rb") as f:
        return {int(pid) for pid in f.read().split()}
    return set()


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
