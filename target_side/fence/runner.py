"""A launched turn: its process I/O as events, its signals, its limits, its end.

Everything here is asynchronous: the server's event loop never waits on a child.
The fence runs in its own pid namespace, so "the whole turn" is a namespace:
a signal goes to every process in it, and when its first process (bubblewrap's
reaper) dies the kernel kills whatever the turn left running.

bubblewrap holds the fence's first process at ``--block-fd`` until it is in
the turn's limits (``fence.gate``), so no process of the command starts
outside them: the thread that started bubblewrap opens that gate where it
started it, else the runner does, on the event loop. A fence born inside its
limits has no gate, and is held once its command may already run.

The process is a ``FenceProcess``: the server's own child, or one the
privileged launcher started as the role (``fence.identity``); signals, kills and
the placement into limits go through it, the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.exit_status import ExitStatus, for_signal, signal_of
from shared.wire import Refusal
from target_side.errors import LauncherError, StorageError
from target_side.fence import pipes
from target_side.fence.gate import Gate, sandbox_of, status_record
from target_side.fence.identity import FenceProcess
from target_side.fence.limits import Usage
from target_side.fence.syscall_filter import FOREIGN_ABI_NOTICE
from target_side.policy import refusals

log = logging.getLogger("paddock.target")

STDERR_TAIL = 4096
KILL_FALLBACK_S = 1.0
"""After a kill that waits for the sandbox to be held: when bubblewrap itself is killed."""
DRAIN_S = 5.0
"""Once the turn's process was reaped, how long its output and status pipes get to close.
Nothing of a turn outlives that (its pid namespace dies with its reaper), so a pipe still
open after this is held by a process outside the turn: the turn ends all the same."""
SIGNALS = {
    "INT": signal.SIGINT,
    "TERM": signal.SIGTERM,
    "KILL": signal.SIGKILL,
    "HUP": signal.SIGHUP,
}

Emit = Callable[..., object]
"""``emit(kind, **fields)``: append one event to the turn's spool; ``StorageError`` if it cannot."""


@dataclass
class Outcome:
    """How a turn ended."""

    exit_code: int
    signal: int | None = None
    refusal: Refusal | None = None
    wall_s: float = 0.0
    output_truncated: bool = False
    cpu_s: float | None = None
    max_rss_kb: int | None = None
    failure: str | None = None
    """Why the target ended the turn itself (its spool could not take its output)."""
    clean: bool = False
    """Whoever reaped it found its protected paths as planned: no audit is left to ask for."""


@dataclass
class _Status:
    """What bubblewrap reported on its status descriptor."""

    child_pid: int | None = None
    pid_namespace: int | None = None
    exit_code: int | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)


def whole_characters(data: bytes) -> int:
    """Where ``data`` ends on a whole UTF-8 character: a character split by a read is held
    back for the next one, so each output event of UTF-8 text is text (event-stream clients
    get ``data``, not ``data_b64``). Bytes that are not UTF-8 are never held."""
    end = len(data)
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte < 0x80:
            return end
        if byte >= 0xC0:  # the lead byte of the last character: whole if all of it is here
            size = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return end if back >= size else end - back
    return end


class WholeCharacters:
    """A byte stream cut where reads cut it, but never inside a UTF-8 character.

    What ``feed`` returns is raw output for one event; the bytes of a character
    a read split are held for the next feed (``rest`` gives them at the end).
    """

    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk
        cut = whole_characters(data)
        self._held = data[cut:]
        return data[:cut]

    def rest(self) -> bytes:
        held, self._held = self._held, b""
        return held


def set_terminal_size(master: int, rows: int, cols: int) -> None:
    """A pty's window size; the kernel tells its foreground job (SIGWINCH)."""
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class _TerminalProtocol(asyncio.StreamReaderProtocol):
    """A pty master's reader: EIO (its other side is closed, every byte read) is its end.

    As an error, it would make the stream drop what it still buffers.
    """

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.EIO:
            exc = None
        super().connection_lost(exc)


class RunningTurn:
    """One launched bubblewrap process and the fence inside it."""

    def __init__(
        self,
        proc: FenceProcess,
        gate: Gate,
        emit: Emit,
        wall_s: float,
        output_bytes: int,
        explain_setup_failure: Callable[[bytes], Refusal] | None = None,
        *,
        terminal: int | None = None,
    ) -> None:
        self._proc = proc
        self._terminal = terminal
        """A terminal turn's pty master: its output and its keystrokes (the runner's to close)."""
        self._keys: asyncio.StreamWriter | None = None
        self._explain = explain_setup_failure
        self._gate = gate
        self._limit_failure: str | None = None
        self._spool = emit
        self._spool_failure: str | None = None
        self._wall_s = wall_s
        self._output_left = output_bytes
        self._status = _Status()
        self._stderr_tail = b""
        self._timed_out = False
        self._killed = False
        self._waiting_signals: list[int] | None = []
        """Signals asked for before the fence was taken (its pid namespace known); None after."""
        self._truncated = False
        self._started_at = proc.started_at
        """From bubblewrap's start: its gate may have opened before the loop got here."""
        self._out_of_memory_ended = False
        self._watch_oom()
        self._status_task = asyncio.create_task(self._read_status())
        # Opened now, not when the turn is followed: keystrokes may come before that.
        self._terminal_task = (
            asyncio.create_task(self._terminal_output()) if terminal is not None else None
        )

    @property
    def started_at(self) -> float:
        """When bubblewrap was started (``time.monotonic``)."""
        return self._started_at

    async def wait(self) -> Outcome:
        """Stream output until the turn ends (or its wall time runs out), then say how it ended."""
        terminal = await self._terminal_task if self._terminal_task else None
        streams = (
            (self._proc.stdout, "stdout"),
            (self._proc.stderr, "stderr"),
            (terminal, "stdout"),
        )
        pumps = asyncio.gather(*(self._pump(s, kind) for s, kind in streams if s is not None))
        try:
            left = self._started_at + self._wall_s - time.monotonic()
            # The process's wait is shielded itself: running out of time only stops waiting.
            async with asyncio.timeout(max(left, 0.0)):
                await self._proc.wait()
        except TimeoutError:
            self._timed_out = True
            self._emit(
                "notice", message=f"wall-time limit of {self._wall_s:g}s reached; killing the turn"
            )
            self.kill()
        try:
            await self._proc.wait()
            await self._drained(pumps)
        finally:
            self._unwatch_oom()
            self._close_gate()
            self._close_terminal()
            self._proc.release()
            usage = self._read_usage()
        outcome = self._outcome(self._proc.returncode or 0)
        if outcome.signal == signal.SIGSYS:
            self._emit("notice", message=FOREIGN_ABI_NOTICE)
        outcome.cpu_s, outcome.max_rss_kb = usage.cpu_s, usage.max_rss_kb
        outcome.clean = self._proc.clean
        return outcome

    async def _drained(self, pumps: asyncio.Future[list[None]]) -> None:
        """The output and the status read to their ends, or given up on after ``DRAIN_S``."""
        reading: dict[str, asyncio.Future[Any]] = {"output": pumps, "status": self._status_task}
        _, pending = await asyncio.wait(reading.values(), timeout=DRAIN_S)
        if pending:
            held = " and ".join(name for name, task in reading.items() if task in pending)
            log.error(
                "bubblewrap %d was reaped %g s ago, but its %s pipe is still open: held by a "
                "process outside the turn; no longer read",
                self._proc.pid,
                DRAIN_S,
                held,
            )
            self._emit(
                "notice",
                message=f"the turn's {held} pipe was still open {DRAIN_S:g} s after it ended, "
                "held by a process outside the turn; the target stopped reading it there",
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return
        await pumps
        await self._status_task

    def _emit(self, kind: str, **fields: object) -> None:
        """Spool one event; output the spool cannot keep ends the turn, rather than go missing."""
        if self._spool_failure is not None:
            return
        try:
            self._spool(kind, **fields)
        except StorageError as exc:
            self._spool_failure = (
                f"the state disk refused the turn's output ({exc}); the target killed the "
                "turn, and its output up to here is kept"
            )
            self.kill()

    def _read_usage(self) -> Usage:
        limits = self._gate.limits
        if limits is None:
            return Usage()
        usage = limits.usage()
        if usage.oom_kills or self._out_of_memory_ended:
            self._emit("notice", message=_oom_notice(usage.oom_kills, self._out_of_memory_ended))
        return usage

    def _watch_oom(self) -> None:
        limits = self._gate.limits
        if limits is not None and limits.oom_alarm is not None:
            # An OOM kill before now left the alarm set: the reader runs at once.
            asyncio.get_running_loop().add_reader(limits.oom_alarm, self._out_of_memory)

    def _out_of_memory(self) -> None:
        """The kernel OOM-killed a process of the turn (cgroup v1): the whole turn ends, as
        v2's ``memory.oom.group`` ends it, not the one process with the rest running on."""
        limits = self._gate.limits
        was_oom = limits is not None and limits.alarm_was_oom()
        self._unwatch_oom()
        if was_oom:
            self._out_of_memory_ended = True
            self.kill()

    def _unwatch_oom(self) -> None:
        limits = self._gate.limits
        if limits is not None and limits.oom_alarm is not None:
            asyncio.get_running_loop().remove_reader(limits.oom_alarm)
            limits.close_oom_alarm()

    async def cleanup(self) -> None:
        """Remove the turn's cgroups (once ``wait`` returned; its end need not wait for this)."""
        if self._gate.limits is not None:
            await self._gate.limits.remove()

    def _outcome(self, returncode: int) -> Outcome:
        wall = round(time.monotonic() - self._started_at, 6)
        failure = self._spool_failure or self._proc.lost
        if failure is not None:
            # The target lost the output's spool, or the process with its launcher.
            return Outcome(
                ExitStatus.PADDOCK_FAILED, None, None, wall, self._truncated, failure=failure
            )
        if self._limit_failure is not None:
            refusal = refusals.backend_unavailable(self._limit_failure)
            return Outcome(ExitStatus.REFUSED, None, refusal, wall, self._truncated)
        if self._timed_out:
            return Outcome(ExitStatus.TIMED_OUT, None, None, wall, self._truncated)
        if self._status.exit_code is None and self._killed:
            # Killed before bwrap could report: still a kill, not a setup failure.
            return Outcome(for_signal(signal.SIGKILL), signal.SIGKILL, None, wall, self._truncated)
        if self._status.exit_code is None:
            # bwrap itself failed (exit 1, no exit record): never the command's own 1.
            return Outcome(ExitStatus.REFUSED, None, self._setup_refusal(), wall, self._truncated)
        code = self._status.exit_code
        return Outcome(code, signal_of(code), None, wall, self._truncated)

    def _setup_refusal(self) -> Refusal:
        if self._explain is not None:
            return self._explain(self._stderr_tail)
        why = "the fence could not be set up"
        return refusals.backend_unavailable(why)

    async def _pump(self, stream: asyncio.StreamReader, kind: str) -> None:
        """The stream's bytes as output events, as read: never decoded, escaped or encoded."""
        whole = WholeCharacters()
        while chunk := await stream.read(pipes.READ_BYTES):
            if kind == "stderr":
                self._stderr_tail = (self._stderr_tail + chunk)[-STDERR_TAIL:]
            if data := whole.feed(self._within_output_limit(chunk)):
                self._emit(kind, raw=data)
        if rest := whole.rest():
            self._emit(kind, raw=rest)

    async def _terminal_output(self) -> asyncio.StreamReader | None:
        """The pty master as a stream (its keystrokes' writer alongside), for a terminal turn."""
        if self._terminal is None:
            return None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=pipes.READ_BYTES)
        await loop.connect_read_pipe(
            lambda: _TerminalProtocol(reader), os.fdopen(os.dup(self._terminal), "rb", 0)
        )
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(os.dup(self._terminal), "wb", 0)
        )
        self._keys = asyncio.StreamWriter(transport, protocol, None, loop)
        return reader

    def _close_terminal(self) -> None:
        if self._keys is not None:
            self._keys.close()
            self._keys = None
        if self._terminal is not None:
            with contextlib.suppress(OSError):
                os.close(self._terminal)
            self._terminal = None

    def _within_output_limit(self, chunk: bytes) -> bytes:
        if self._output_left >= len(chunk):
            self._output_left -= len(chunk)
            return chunk
        kept = chunk[: max(self._output_left, 0)]
        self._output_left = -1
        if not self._truncated:
            self._truncated = True
            self._emit(
                "notice", message="output limit reached; output truncated and the turn killed"
            )
            self.kill()
        return kept

    async def _read_status(self) -> None:
        # The lines the thread that started bubblewrap read, or the pipe, read here.
        reader = self._proc.status
        transport: asyncio.BaseTransport | None = None
        if reader is None:
            reader = asyncio.StreamReader()
            pipe = os.fdopen(self._gate.status, "rb", buffering=0)
            self._gate.status = -1
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), pipe
            )
        try:
            while line := await reader.readline():
                await self._absorb_status(line)
        finally:
            if transport is not None:
                transport.close()
            self._status.started.set()

    async def _absorb_status(self, line: bytes) -> None:
        record = status_record(line)
        with contextlib.suppress(ValueError, TypeError):
            if "exit-code" in record:
                self._status.exit_code = int(record["exit-code"])
        sandbox = sandbox_of(record)
        if sandbox is not None:
            self._status.child_pid, self._status.pid_namespace = sandbox
            await self._open_gate(*sandbox)
            self._status.started.set()

    async def _open_gate(self, sandbox_pid: int, pid_ns: int | None) -> None:
        """Hold the blocked fence, put it into its limits, then let it run; a failure kills it.

        Where the process opened its gate itself, this takes what it held.
        """
        try:
            await self._proc.adopt(sandbox_pid, pid_ns, self._gate.limits)
        except ProcessLookupError:
            # The fence died while setting up: its own failure says why, not the limits.
            self._close_gate()
            self._waiting_signals = None
            return
        except (OSError, ValueError, LauncherError) as exc:
            if self._gate.limits is not None and self._gate.limits.born_inside:
                # Nothing was to be moved, and its command may have ended already: only the
                # hold failed, and signals reach bubblewrap instead, which takes the fence along.
                log.info(
                    "fence %d of bubblewrap %d was not held: %s", sandbox_pid, self._proc.pid, exc
                )
                self._send_waiting_signals()
                return
            self._limit_failure = f"the turn's limits could not be applied; it did not run: {exc}"
            # The gate stays shut until bubblewrap's end: where only bubblewrap could be
            # killed, its child is killed as an orphan first (``fence.orphans``).
            self.kill()
            return
        if self._killed:
            # Killed before it was held (through the launcher: only bubblewrap could be, and
            # its child may outlive it). Held now, its whole pid namespace goes, gate shut.
            self.kill()
        elif self._gate.block >= 0:
            with contextlib.suppress(OSError):
                os.write(self._gate.block, b"\0")
        self._close_gate()
        self._send_waiting_signals()

    def _send_waiting_signals(self) -> None:
        """The fence is taken: the signals asked for before go to it now, in order."""
        waiting, self._waiting_signals = self._waiting_signals or [], None
        for signum in waiting:
            self._proc.signal_fence(signum)

    def _close_gate(self) -> None:
        if self._gate.block >= 0:
            with contextlib.suppress(OSError):
                os.close(self._gate.block)
            self._gate.block = -1

    def signal(self, name: str) -> int:
        """Send ``name`` to every process of the turn; returns how many were signalled, if known."""
        if SIGNALS[name] == signal.SIGKILL:
            self.kill()
            return 1
        if self._waiting_signals is not None:
            # A fence born inside its cgroups runs at once, maybe before the loop has taken it:
            # signalled now, its command would be missed (a turn run to its wall time).
            self._waiting_signals.append(SIGNALS[name])
            return 0
        return self._proc.signal_fence(SIGNALS[name])

    def kill(self) -> None:
        """SIGKILL the whole turn.

        Killing the fence's reaper makes the kernel kill everything in its pid
        namespace, and bwrap still reports the status. Before the sandbox is held,
        killing bubblewrap is not enough: its child asks for its parent-death signal
        only once it runs, and a turn killed as it started (7 times in 20 here) left
        its sandbox running. So a sandbox waiting at its gate is killed the moment it
        is held, the gate never opened (bubblewrap too, if it never gets that far);
        one born inside its cgroups is killed with them.
        """
        self._killed = True
        self._proc.kill_fence()
        if self._gate.limits is not None:
            self._gate.limits.kill()
        with contextlib.suppress(RuntimeError):  # no loop: nothing of the turn's is left
            asyncio.get_running_loop().call_later(KILL_FALLBACK_S, self._proc.kill)

    def kill_now(self) -> None:
        """SIGKILL the fence and bwrap together (the server is going away)."""
        self.kill()
        self._proc.kill()

    async def write_stdin(self, data: bytes, eof: bool) -> None:
        """Bytes for the turn's stdin; a terminal turn's are keystrokes (eof is ^D there)."""
        if self._terminal_task is not None:
            await self._terminal_task
        stdin = self._keys if self._terminal is not None else self._proc.stdin
        if stdin is None or stdin.is_closing():
            raise BrokenPipeError("the turn's stdin is closed")
        if self._terminal is not None and eof:
            data, eof = data + b"\x04", False
        if data:
            stdin.write(data)
            await stdin.drain()
        if eof:
            stdin.close()

    def resize(self, rows: int, cols: int) -> None:
        """A terminal turn's new window size (its foreground job is sent SIGWINCH)."""
        if self._terminal is None:
            raise BrokenPipeError("the turn has no terminal")
        set_terminal_size(self._terminal, rows, cols)


def _oom_notice(kills: int, ended_by_target: bool) -> str:
    """What a turn that reached its memory limit is told. Woken by the cgroup's OOM event,
    the target may kill the turn before the kernel has picked a process to kill (cgroup v1):
    then the kernel killed none, and the turn still ended out of memory."""
    if not kills:
        return "out of memory: the turn reached its memory limit, and the target ended it"
    rest = "; the target ended the rest of it" if ended_by_target else ""
    return (
        f"out of memory: the kernel killed {kills} process(es) of the turn at its memory "
        f"limit{rest}"
    )
