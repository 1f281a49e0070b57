"""The server's end of a session's fence: the host's frames, and the turn running in its shell.

A session's fence is launched as any turn is (``launch_turn``: held paths,
limits, the gate, the role's uid, by the launcher where there is one), with
the session host (``session_host``) as its program. ``SessionFence`` is that
launched process: a ``RunningTurn`` whose stdout carries the host's frames
instead of output, and whose wall-time limit is the session's ``session_s``.

``SessionTurn`` is one turn in it. To the turn manager it is what a
``RunningTurn`` is to a turn of its own: it streams output into the turn's
spool, takes stdin and signals, enforces the turn's own wall-time and output
limits, and says how the turn ended. The turn's command is the shell's to
run; only the session ends the fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from typing import Any

from shared.exit_status import ExitStatus, for_signal, signal_of
from shared.wire import Tty
from target_side.errors import StorageError
from target_side.fence import pipes
from target_side.fence import session_host as host
from target_side.fence.runner import SIGNALS, Emit, Outcome, RunningTurn, WholeCharacters

log = logging.getLogger("paddock.target")

ANSWER_GRACE_S = host.KILL_GRACE_S + 5.0
"""After KILL: how long the host has to report the turn's end before the fence itself goes."""


class SessionFence(RunningTurn):
    """A session's bubblewrap process, speaking frames with the host inside it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hello: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.turn: SessionTurn | None = None
        self.bye: dict[str, Any] | None = None
        self.ending: str | None = None
        """Why the server is ending the session, said to the turn it cuts short."""
        self.dropped = 0
        """Bytes of background output the host dropped, as it last said."""

    @property
    def timed_out(self) -> bool:
        return self._timed_out

    async def send(self, kind: bytes, payload: bytes | dict[str, Any]) -> None:
        """One frame to the host; ``BrokenPipeError`` when the host is gone."""
        stdin = self._proc.stdin
        if stdin is None or stdin.is_closing():
            raise BrokenPipeError("the session's host is gone")
        stdin.write(host.encode(kind, payload))
        await stdin.drain()

    def send_soon(self, kind: bytes, payload: bytes | dict[str, Any]) -> None:
        """``send`` from synchronous code; frames keep their order (one write each)."""
        stdin = self._proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write(host.encode(kind, payload))

    async def _pump(self, stream: asyncio.StreamReader | None, kind: str) -> None:
        if stream is None:
            return
        if kind == "stderr":
            await self._host_diagnostics(stream)
            return
        try:
            while True:
                header = await stream.readexactly(host.HEADER.size)
                frame, size = host.HEADER.unpack(header)
                if size > host.MAX_PAYLOAD:
                    log.error("session host sent a frame of %d bytes; ending the session", size)
                    self.kill()
                    return
                self._frame(frame, await stream.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._host_gone()

    async def _host_diagnostics(self, stream: asyncio.StreamReader) -> None:
        # Only the host writes here (the shell's stderr is its pty): bubblewrap's setup
        # failures, or a host that broke. Kept for the refusal, and logged.
        while chunk := await stream.read(pipes.READ_BYTES):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]
            for line in chunk.decode(errors="replace").splitlines():
                if line.strip():
                    log.warning("session host: %s", line)

    def _frame(self, kind: bytes, payload: bytes) -> None:
        turn = self.turn
        if kind in (host.STDOUT, host.STDERR):
            if turn is not None:
                turn.output("stdout" if kind == host.STDOUT else "stderr", payload)
            return
        try:
            message = json.loads(payload)
        except ValueError:
            log.error("session host sent a frame that is not JSON; ending the session")
            self.kill()
            return
        if kind == host.HELLO and not self.hello.done():
            self.hello.set_result(message)
        elif kind == host.ACCEPTED:
            self.dropped = int(message.get("dropped", 0))
            if turn is not None and message.get("turn") == turn.turn_id:
                turn.accepted(self.dropped)
        elif kind == host.EXIT and turn is not None and message.get("turn") == turn.turn_id:
            turn.exited(int(message.get("status", ExitStatus.PADDOCK_FAILED)))
        elif kind == host.NOTE and turn is not None and message.get("turn") == turn.turn_id:
            turn.notice(str(message.get("message", "")))
        elif kind == host.BYE:
            self.bye = message

    def _host_gone(self) -> None:
        if not self.hello.done():
            gone = BrokenPipeError("the session's host ended before it was ready")
            self.hello.set_exception(gone)
        turn = self.turn
        if turn is not None:
            turn.session_gone(self.ending, self._timed_out)

    @property
    def last_words(self) -> str | None:
        """The last line the host (or bubblewrap) wrote on stderr, if any."""
        said = self._stderr_tail.decode(errors="replace").strip().splitlines()
        return said[-1] if said else None

    @property
    def shell_reason(self) -> str | None:
        """What the host said when it ended, if it said anything."""
        return None if self.bye is None else str(self.bye.get("reason", ""))

    @property
    def shell_status(self) -> int | None:
        status = None if self.bye is None else self.bye.get("status")
        return status if isinstance(status, int) else None


class SessionTurn:
    """One turn run by a session's shell: its output, stdin, signals, limits and end."""

    def __init__(
        self,
        fence: SessionFence,
        turn_id: str,
        emit: Emit,
        wall_s: float,
        output_bytes: int,
        *,
        stdin_open: bool,
        tty: Tty | None = None,
    ) -> None:
        self._fence = fence
        self.turn_id = turn_id
        self._spool = emit
        self._wall_s = wall_s
        self._output_left = output_bytes
        self._stdin_open = stdin_open or tty is not None
        self._tty = tty
        self._eof_sent = False
        self._whole = {"stdout": WholeCharacters(), "stderr": WholeCharacters()}
        self._ended: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._started_at = time.monotonic()
        self._timed_out = False
        self._truncated = False
        self._killed = False
        self._spool_failure: str | None = None
        self._gone_because: str | None = None
        self._session_timed_out = False

    async def start(self, source: str) -> None:
        """Hand the turn's command to the shell (``BrokenPipeError`` if the session is gone)."""
        self._fence.turn = self
        await self._fence.send(
            host.RUN,
            {
                "turn": self.turn_id,
                "source": source,
                "stdin": self._stdin_open,
                "tty": None if self._tty is None else self._tty.model_dump(),
            },
        )

    # -- what the host says

    def accepted(self, dropped: int) -> None:
        if dropped:
            self._emit(
                "notice",
                message=f"{dropped} bytes that background processes of earlier turns wrote "
                "after their turn had ended were dropped (redirect their output to a file "
                "to keep it)",
            )

    def output(self, kind: str, data: bytes) -> None:
        # The bytes as the shell wrote them (a frame), never a character split in two.
        if raw := self._whole[kind].feed(self._within_output_limit(data)):
            self._emit(kind, raw=raw)

    def notice(self, message: str) -> None:
        self._emit("notice", message=message)

    def exited(self, status: int) -> None:
        if not self._ended.done():
            self._ended.set_result(status)

    def session_gone(self, why: str | None, timed_out: bool) -> None:
        """The fence ended under this turn (its session was ended, or ran out of time)."""
        self._gone_because = why
        self._session_timed_out = timed_out
        if not self._ended.done():
            self._ended.set_result(None)

    # -- what the turn manager asks

    async def wait(self) -> Outcome:
        """Follow the turn to its end, within its wall time; then say how it ended."""
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), self._wall_s)
        except TimeoutError:
            self._timed_out = True
            self._emit(
                "notice",
                message=f"wall-time limit of {self._wall_s:g}s reached; killing the turn's "
                "command (the session goes on)",
            )
            self.kill()
        try:
            status = await asyncio.wait_for(asyncio.shield(self._ended), ANSWER_GRACE_S)
        except TimeoutError:
            self._fence.ending = "the session's shell did not answer after its turn was killed"
            self._fence.kill()
            status = await self._ended
        for kind, whole in self._whole.items():
            if rest := whole.rest():
                self._emit(kind, raw=rest)
        if self._fence.turn is self:
            self._fence.turn = None
        return self._outcome(status)

    def _outcome(self, status: int | None) -> Outcome:
        wall = round(time.monotonic() - self._started_at, 6)
        if self._spool_failure is not None:
            failed = self._spool_failure
            code: int = ExitStatus.PADDOCK_FAILED
            return Outcome(code, None, None, wall, self._truncated, failure=failed)
        if status is None:
            # The fence went: its session ended (by request, its own limit, or the target).
            why = self._gone_because or self._fence.shell_reason or "the session ended"
            self._emit("notice", message=f"{why}; this turn ended with it")
            if self._session_timed_out:
                return Outcome(ExitStatus.TIMED_OUT, None, None, wall, self._truncated)
            code = for_signal(signal.SIGKILL)
            return Outcome(code, signal.SIGKILL, None, wall, self._truncated)
        if self._timed_out:
            return Outcome(ExitStatus.TIMED_OUT, None, None, wall, self._truncated)
        return Outcome(status, signal_of(status), None, wall, self._truncated)

    async def cleanup(self) -> None:
        """Nothing: the turn's processes are the session's, and so are its cgroups."""

    def signal(self, name: str) -> int:
        """Send ``name`` to the turn's command (the shell's foreground job)."""
        if SIGNALS[name] == signal.SIGKILL:
            self._killed = True
        self._fence.send_soon(host.SIGNAL, {"turn": self.turn_id, "signal": int(SIGNALS[name])})
        return 1

    def kill(self) -> None:
        self.signal("KILL")

    def kill_now(self) -> None:
        """The target is going away: the whole session goes with it."""
        self._fence.ending = self._fence.ending or "the target stopped"
        self._fence.kill_now()

    async def write_stdin(self, data: bytes, eof: bool) -> None:
        if not self._stdin_open or self._eof_sent or self._ended.done():
            raise BrokenPipeError("the turn's stdin is closed")
        if data:
            await self._fence.send(host.INPUT, data)
        if eof:
            self._eof_sent = self._tty is None
            await self._fence.send(host.INPUT_EOF, b"")

    def resize(self, rows: int, cols: int) -> None:
        self._fence.send_soon(host.RESIZE, {"rows": rows, "cols": cols})

    # -- limits and the spool

    def _within_output_limit(self, chunk: bytes) -> bytes:
        if self._output_left >= len(chunk):
            self._output_left -= len(chunk)
            return chunk
        kept = chunk[: max(self._output_left, 0)]
        self._output_left = -1
        if not self._truncated:
            self._truncated = True
            self._emit(
                "notice",
                message="output limit reached; output truncated and the turn's command killed",
            )
            self.kill()
        return kept

    def _emit(self, kind: str, **fields: object) -> None:
        if self._spool_failure is not None:
            return
        try:
            self._spool(kind, **fields)
        except StorageError as exc:
            self._spool_failure = (
                f"the state disk refused the turn's output ({exc}); the target killed the "
                "turn's command, and its output up to here is kept"
            )
            with contextlib.suppress(Exception):
                self.kill()
