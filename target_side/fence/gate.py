"""A fence held at its start: bubblewrap's status pipe and its ``--block-fd``.

bubblewrap writes a JSON line naming its sandbox's first process to
``--json-status-fd`` once the sandbox exists; that process then waits for a
byte on ``--block-fd``. Until the byte comes nothing of the command has run,
and the server takes a pidfd on the process (so that no later kill can reach
a recycled pid), moves it into the turn's cgroups, and only then writes the
byte. At the end bubblewrap writes the command's exit status on the same
pipe, and exits.

A fence born inside its cgroups (a nursery worker started it,
``fence.nursery``) has no gate: nothing has to happen before its command
may run, and waiting for the server's thread to be scheduled and to take
the interpreter lock cost every such turn half a millisecond (bubblewrap's
life in the server 5.8-6.1 ms with a gate, 5.1-5.5 ms without; medians of
200 turns, twice each). Its first process is held all the same, once the
line naming it is read: a pidfd taken on that pid is its, and no recycled
pid's, only while that pid is still bubblewrap's child (unreaped, it cannot
have been reused), so that is checked after the pidfd is taken. By then its
command may have ended: nothing is held, as for a fence that died while it
was set up.

Who opens the gate depends on who started bubblewrap. The server's own child
(``fence.identity.InProcess``) is started by a thread of its own that then
only waits for it: that thread opens the gate (``StartWatch``), blocking, the
moment the status line is there. The event loop would get to the line only
after every other turn's pending step: with 200 turns started together, each
turn's command started that much later (200 concurrent ``sleep 1`` took 0.93
of the time once the thread did it, in two comparisons of eight alternated
rounds each). Through the launcher, the runner opens the gate on the event
loop (``fence.runner.RunningTurn``).

A command may so start before the event loop gets to its turn at all: its
wall time is counted from bubblewrap's start (``FenceProcess.started_at``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

from target_side.fence import orphans
from target_side.fence.limits import TurnLimits

STATUS_READ_BYTES = 4096


@dataclass
class Gate:
    """What holds one fence before its command starts."""

    status: int
    """The read end of bubblewrap's ``--json-status-fd``."""
    block: int
    """The write end of its ``--block-fd``: one byte lets the sandbox go on to the command.
    -1 once it is not the runner's to write or close."""
    limits: TurnLimits | None = None
    given: tuple[int, ...] = ()
    """The two ends, once given away: the taker's to close, no one else's."""

    def give_away(self) -> tuple[int, int]:
        """The status pipe's read end and the gate's write end, for whoever takes them over."""
        ends = (self.status, self.block)
        self.status = self.block = -1
        self.given = ends
        return ends


@dataclass
class Held:
    """How the thread that opened a gate left the sandbox."""

    reaper: int | None = None
    """A pidfd on the sandbox's first process, the caller's to close (None: never held)."""
    error: BaseException | None = None
    """``ProcessLookupError``: the sandbox died before it was held; another error: its
    limits could not be applied, and it was killed before its command could start."""


def status_record(line: bytes) -> dict[str, Any]:
    """One line of bubblewrap's status pipe as JSON; empty if it is not an object."""
    with contextlib.suppress(ValueError):
        record = json.loads(line)
        if isinstance(record, dict):
            return record
    return {}


def sandbox_of(record: dict[str, Any]) -> tuple[int, int | None] | None:
    """The sandbox's first process and pid namespace, if ``record`` is the line naming it."""
    with contextlib.suppress(ValueError, TypeError):
        if "child-pid" in record:
            return int(record["child-pid"]), int(record.get("pid-namespace", 0)) or None
    return None


class StartWatch:
    """One fence's status pipe and gate, in the hands of the thread that started bubblewrap.

    Made on the event loop, given to the thread: it takes the gate's two
    descriptors over (and closes them). ``started`` and ``ended`` run on the
    thread, after bubblewrap started and after it was reaped. The runner reads
    the status lines from ``lines``, as it would from the pipe, and learns how
    the gate went from ``held``, which resolves before the line naming the
    sandbox reaches ``lines``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: Gate) -> None:
        self._loop = loop
        self._limits = gate.limits
        self._status, self._block = gate.give_away()
        self.lines = asyncio.StreamReader(loop=loop)
        self.held: asyncio.Future[Held] = loop.create_future()
        self._deciding = threading.Lock()
        self._decided = self._block < 0  # no gate: its command goes on by itself
        self._kill_when_held = False
        self._named = False
        """Whether bubblewrap's status line named its sandbox."""

    def kill_when_held(self) -> bool:
        """Kill the sandbox as soon as it is held, instead of opening its gate; False when
        the gate has been opened already (or there is none), and it must be killed otherwise.

        Killing bubblewrap instead, before the sandbox is held, can leave the sandbox
        running: bubblewrap's child asks for its parent-death signal only once it runs.
        Outside its cgroups and out of anyone's sight, it then runs the command, or
        waits at the gate for ever (unless taken in as an orphan: ``fence.orphans``).
        """
        with self._deciding:
            if self._decided:
                return False
            self._kill_when_held = True
            return True

    def started(self, process: subprocess.Popen[bytes]) -> None:
        """Read up to the line naming the sandbox, hold the sandbox, open the gate (blocking).

        With no line naming it, bubblewrap has ended, and its child may still
        wait at the gate: the gate then stays shut until bubblewrap is reaped
        and such a child killed (``ended``).
        """
        data = b""
        held = Held()
        try:
            data = self._first_line()
            line, newline, _ = data.partition(b"\n")
            sandbox = sandbox_of(status_record(line)) if newline else None
            if sandbox is not None:
                self._named = True
                held = self._hold(process, sandbox[0])
        finally:
            with self._deciding:
                self._decided = True
            if self._named:
                _close(self._block)
                self._block = -1
            self._report(held, data)

    def ended(self) -> None:
        """What bubblewrap wrote after the first line (its command's exit status), then the end.

        bubblewrap has been reaped: everything it wrote is in the pipe, so the
        rest is read without waiting for an end of file that a descriptor left
        open elsewhere would hold back.
        """
        rest = b""
        try:
            if not self._named:
                # Never named, so never held: a child of bubblewrap's that outlived it is ours
                # now (``fence.orphans``), and is killed before the gate could let it go on.
                orphans.end_orphaned_sandboxes()
            fcntl.fcntl(self._status, fcntl.F_SETFL, os.O_NONBLOCK)
            while chunk := os.read(self._status, STATUS_READ_BYTES):
                rest += chunk
        except OSError:
            pass  # nothing more (EAGAIN), or never anything: the runner sees the end either way
        finally:
            _close(self._block)
            _close(self._status)
            self._call(self._feed_end, rest)

    def abandoned(self) -> None:
        """bubblewrap never started: nothing will be read or opened."""
        _close(self._status)
        _close(self._block)
        self._call(self._feed_end, b"")

    def _first_line(self) -> bytes:
        data = b""
        with contextlib.suppress(OSError):  # as an end: the runner then sees no sandbox
            while b"\n" not in data:
                chunk = os.read(self._status, STATUS_READ_BYTES)
                if not chunk:
                    break  # bubblewrap ended before its sandbox began: its stderr says why
                data += chunk
        return data

    def _hold(self, process: subprocess.Popen[bytes], pid: int) -> Held:
        try:
            reaper = os.pidfd_open(pid)
        except OSError as exc:
            return Held(error=ProcessLookupError(exc.errno, exc.strerror))
        if self._block < 0 and parent_of(pid) != process.pid:
            # No gate held it: it ran, ended and was reaped, and ``pid`` may be another's now.
            os.close(reaper)
            return Held(
                error=ProcessLookupError(errno.ESRCH, "the sandbox ended before it was held")
            )
        try:
            if self._limits is not None:
                self._limits.place(pid)
        except (OSError, ValueError) as exc:
            # Killed while it still waits at the gate: the command never starts outside its
            # limits. bubblewrap is not reaped yet (this thread reaps it), so its pid is its own.
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(reaper, signal.SIGKILL)
            with contextlib.suppress(OSError):
                process.send_signal(signal.SIGKILL)
            return Held(reaper, exc)
        with self._deciding:
            self._decided = True
            if self._kill_when_held:
                with contextlib.suppress(OSError):  # its pid namespace goes with it
                    signal.pidfd_send_signal(reaper, signal.SIGKILL)
            elif self._block >= 0:
                with contextlib.suppress(OSError):  # the sandbox died meanwhile: it says why
                    os.write(self._block, b"\0")
        return Held(reaper)

    def _report(self, held: Held, data: bytes) -> None:
        def deliver() -> None:
            self.held.set_result(held)
            self.lines.feed_data(data)

        self._call(deliver)

    def _feed_end(self, rest: bytes) -> None:
        self.lines.feed_data(rest)
        self.lines.feed_eof()

    def _call(self, callback: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self._loop.call_soon_threadsafe(callback, *args)


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` as ``/proc`` says now; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
