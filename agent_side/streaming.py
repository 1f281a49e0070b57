"""``paddock run`` while the turn runs: its output, our signals, our stdin, a closed pipe.

    Sink              writes each event as it arrives: raw bytes to stdout/stderr, or JSON lines,
                      and records it in the turn's cursor once written (agent_side.cursors)
    SignalForwarder   Ctrl-C sends INT, a second KILL, a third stops waiting;
                      TERM (a supervisor stopping us) sends KILL, a second stops waiting
    StdinFeeder       copies our stdin to the turn's when it is a pipe or a file

When whoever reads our stdout goes away (``paddock run -- seq 1e9 | head``),
the turn gets TERM, and paddock ends as a local producer would: quietly, with
SIGPIPE's status, once the turn has ended.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from agent_side.client import TargetClient
from agent_side.cursors import Cursor, CursorStore
from agent_side.errors import AgentError
from agent_side.stdio import (
    BROKEN_PIPE,
    TERMINAL_STDIN_NOTE,
    Interrupts,
    silence_stdout,
    stdin_fd,
    stdin_is_terminal,
    write,
)
from agent_side.turns import drive, output_bytes
from agent_side.views import refusal_sentence, say
from shared.wire import Event, OutputEvent, Turn, TurnRequest

POST_GRACE_S = 5.0
"""How long leaving ``paddock run`` waits for a signal still being posted to the turn."""


def run_turn(
    client: TargetClient,
    request: TurnRequest,
    *,
    as_json: bool,
    cursors: CursorStore | None = None,
) -> int:
    """Run ``request`` on the target and return the status ``paddock run`` exits with.

    With ``cursors``, what reaches our stdout and stderr is recorded, so that
    ``paddock attach TURN`` goes on from there if this process is killed.
    """
    forwarder = SignalForwarder(client)
    feeder = StdinFeeder(client) if request.stdin == "open" else None
    sink = Sink(as_json=as_json, on_broken_pipe=lambda: forwarder.send("TERM", quiet=True))

    def submitted(turn_id: str) -> None:
        if cursors is not None:
            sink.cursor = cursors.open(turn_id)
        forwarder.attach(turn_id)
        if feeder is not None:
            feeder.start(turn_id)

    with forwarder.installed(), sink, feeder or contextlib.nullcontext():
        finished = drive(client, request, sink.event, on_submitted=submitted)
    final = finished.turn
    if final.refusal is not None and not sink.refusal_shown:
        say(refusal_sentence(final.refusal))
    sink.turn(final)
    status = finished.exit_status
    return BROKEN_PIPE if sink.pipe_broken else status


def with_stdin(request: TurnRequest, *, forward: bool) -> TurnRequest:
    """Open the turn's stdin when ours is a pipe or file (``echo x | paddock run -- cat``).

    A terminal is not forwarded (that needs a terminal on the target too):
    one line says so, unless ``forward`` is False (``--no-stdin``).
    """
    if not forward:
        return request
    if stdin_fd() is not None:
        return request.model_copy(update={"stdin": "open"})
    if stdin_is_terminal():
        say(TERMINAL_STDIN_NOTE)
    return request


class Output(Protocol):
    """Where a turn's output and paddock's own lines go: this process's, or a relay's."""

    def stdout(self, data: bytes) -> None:
        """Raises ``BrokenPipeError`` when nobody reads on."""

    def stderr(self, data: bytes) -> None: ...

    def say(self, message: str) -> None:
        """One ``paddock: ...`` line for a person."""


class LocalOutput:
    """This process's stdout and stderr."""

    def stdout(self, data: bytes) -> None:
        write(sys.stdout, data)

    def stderr(self, data: bytes) -> None:
        write(sys.stderr, data)

    def say(self, message: str) -> None:
        say(message)


class Sink:
    """Writes events as they arrive: raw bytes to stdout/stderr, or JSON lines.

    An event is recorded in ``cursor`` only once its write has returned, flushed:
    never one the user did not get. Use as a context manager to close the cursor.
    """

    def __init__(
        self,
        *,
        as_json: bool,
        on_broken_pipe: Callable[[], None] = lambda: None,
        cursor: Cursor | None = None,
        output: Output | None = None,
    ) -> None:
        self._as_json = as_json
        self._on_broken_pipe = on_broken_pipe
        self._output = output or LocalOutput()
        self.pipe_broken = False
        """Whoever read our stdout has gone; nothing more is written there."""
        self.refusal_shown = False
        self.cursor = cursor

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.cursor is not None:
            self.cursor.close()

    def event(self, event: Event) -> None:
        self.show(event)
        if self.cursor is not None and not self.pipe_broken:
            self.cursor.delivered(event.seq)

    def show(self, event: Event) -> None:
        """Write ``event`` out, recording nothing (a relay records what its client confirms)."""
        if event.kind == "refused":
            self._output.say(refusal_sentence(event.refusal))
            self.refusal_shown = True
        if self._as_json:
            self._stdout((event.model_dump_json() + "\n").encode())
        elif isinstance(event, OutputEvent):
            if event.kind == "stdout":
                self._stdout(output_bytes(event))
            else:
                self._output.stderr(output_bytes(event))
        elif event.kind == "notice":
            self._output.say(f"notice: {event.message}")

    def turn(self, turn: Turn) -> None:
        if self._as_json:
            self._stdout((turn.model_dump_json() + "\n").encode())

    def _stdout(self, data: bytes) -> None:
        if self.pipe_broken:
            return
        try:
            self._output.stdout(data)
        except BrokenPipeError:
            # Like SIGPIPE for a local pipeline: nobody reads on, so stop the producer.
            self.pipe_broken = True
            silence_stdout()
            self._on_broken_pipe()


class SignalForwarder:
    """Ctrl-C sends INT to the turn, a second KILL, a third stops waiting for it.

    TERM (a supervisor or ``kill`` stopping paddock) sends KILL at once, since
    whoever sent it wants the work gone, and a second TERM stops waiting. The
    handlers run on the main thread between bytecodes, so they only decide; a
    helper thread does the HTTP request and the talking.
    """

    def __init__(self, client: TargetClient, *, output: Output | None = None) -> None:
        self._client = client
        self._output = output or LocalOutput()
        self._turn_id: str | None = None
        self._pending: list[tuple[str, bool]] = []
        self._interrupts = Interrupts(self.send)
        self._posting: list[threading.Thread] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalForwarder]:
        """Handle SIGINT and SIGTERM while the block runs (only the main thread can)."""
        try:
            with self._interrupts.installed():
                yield self
        finally:
            # A KILL still on its way must reach the target before the client closes.
            for thread in self._posting:
                thread.join(POST_GRACE_S)

    def attach(self, turn_id: str) -> None:
        """The turn now exists; deliver what came before it did."""
        self._turn_id = turn_id
        pending, self._pending = self._pending, []
        for name, quiet in pending:
            self.send(name, quiet=quiet)

    def send(self, name: str, *, quiet: bool = False) -> None:
        """Post ``name`` to the turn from a helper thread; ``quiet``: say nothing either way."""
        turn_id = self._turn_id
        if turn_id is None:
            self._pending.append((name, quiet))
            return
        thread = threading.Thread(
            target=self._deliver, args=(turn_id, name, quiet), daemon=True, name="paddock-signal"
        )
        self._posting.append(thread)
        thread.start()

    def _deliver(self, turn_id: str, name: str, quiet: bool) -> None:
        try:
            self._client.signal(turn_id, name)
        except (AgentError, RuntimeError) as exc:
            if not quiet:
                self._output.say(f"could not send {name} to turn {turn_id}: {exc}")
            return
        if quiet:
            return
        if name == "INT":
            self._output.say(f"sent INT to turn {turn_id}; Ctrl-C again sends KILL")
        elif name == "KILL":
            self._output.say(f"sent KILL to turn {turn_id}")


class StdinFeeder:
    """Copies this process's stdin to the turn's, from a helper thread, then closes it.

    Used as a context manager, it stops when the block ends: the turn is over,
    and the client is about to close. A post still on its way is waited for
    (up to ``POST_GRACE_S``), and none starts after, so no request outlives
    the client: one that did would hold its connection open past the pool's
    close, and an embedded target (``--local``) would wait for it to stop.
    """

    CHUNK = 64 * 1024

    def __init__(self, client: TargetClient) -> None:
        self._client = client
        self._stopped = threading.Event()
        # Written to once, to wake a thread waiting on a stdin that never ends.
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StdinFeeder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, turn_id: str) -> None:
        self._thread = threading.Thread(
            target=self._copy, args=(turn_id,), daemon=True, name="paddock-stdin"
        )
        self._thread.start()

    def stop(self) -> None:
        """Post nothing more; wait for a post on its way."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(POST_GRACE_S)
        if self._thread is None or not self._thread.is_alive():
            # (One still posting after the grace may yet look at it: left open, as we leave.)
            os.close(self._stop_r)
        os.close(self._stop_w)

    def _copy(self, turn_id: str) -> None:
        fd = stdin_fd()
        try:
            while fd is not None and (chunk := self._read(fd)):
                self._client.write_stdin(turn_id, chunk)
            if self._stopped.is_set():
                return
            self._client.write_stdin(turn_id, b"", eof=True)
        except (AgentError, RuntimeError, OSError, ValueError):
            # The turn ended without reading it all (like a closed pipe), or we are closing.
            return

    def _read(self, fd: int) -> bytes:
        """The next chunk of stdin; nothing once stdin ends or the feeder stops."""
        waiting = select.poll()  # not select(): a descriptor may be numbered past its 1024
        waiting.register(fd, select.POLLIN)
        waiting.register(self._stop_r, select.POLLIN)
        waiting.poll()
        if self._stopped.is_set():
            return b""
        return os.read(fd, self.CHUNK)
