"""One turn run by the daemon for one ``paddock run``: what ``streaming.run_turn`` does, relayed.

The same ``drive`` (idempotent submit, follow with resume, final state), the
same ``Sink`` (what is printed, and when) and the same ``SignalForwarder``
(what a signal posts, and what is said about it) as a turn run in-process;
only their output goes into frames instead of to this process's stdout and
stderr. The client's frames (signals, stdin, deliveries) are read on a second
thread.

The agent's cursor is kept here, as in-process, but an event counts as
delivered only when the client says it wrote it: after each event's frames a
``seq`` frame goes out, and the client answers ``delivered`` once what came
before it is on its stdout.
"""

from __future__ import annotations

import contextlib
import queue
import threading

from agent_side.api import Target
from agent_side.client import TargetClient
from agent_side.cursors import CursorStore
from agent_side.errors import AgentError, UsageError
from agent_side.mux.frames import Channel, Message
from agent_side.request_options import RequestOptions
from agent_side.stdio import TERMINAL_STDIN_NOTE
from agent_side.streaming import POST_GRACE_S, SignalForwarder, Sink
from agent_side.turns import drive
from agent_side.views import refusal_sentence
from shared.wire import Event, TurnRequest


class ClientGone(Exception):
    """The ``paddock run`` this turn was relayed to has closed its connection."""


CONFIRM_WAIT_S = 1.0
"""How long the turn's end waits for the client to confirm its last event (a client whose
stdout closed confirms none)."""


class FrameOutput:
    """``streaming.Output`` as frames to the client; a client gone is ``ClientGone``.

    Never ``BrokenPipeError``: that would mean "nobody reads our stdout" and
    stop the turn, and a client whose own stdout closed says so itself.
    """

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.last_seq = 0
        """The last event shown, which the client is to confirm."""

    def stdout(self, data: bytes) -> None:
        self._send({"t": "stdout"}, data)

    def stderr(self, data: bytes) -> None:
        self._send({"t": "stderr"}, data)

    def say(self, message: str) -> None:
        self._send({"t": "say", "text": message})

    def show(self, sink: Sink, event: Event) -> None:
        """``sink`` shows ``event`` in frames; then the client is asked to confirm it."""
        sink.show(event)
        self._send({"t": "seq", "seq": event.seq})
        self.last_seq = event.seq

    def _send(self, message: Message, data: bytes = b"") -> None:
        try:
            self._channel.send(message, data)
        except OSError as exc:
            raise ClientGone(str(exc)) from exc


def relay_turn(target: Target, channel: Channel, message: Message) -> None:
    """Run the turn ``message`` asks for, sending its output and then its status to ``channel``."""
    output = FrameOutput(channel)
    request = _request(target, message)
    if message.get("stdin_note"):
        output.say(TERMINAL_STDIN_NOTE)
    client = target.client
    forwarder = RelayedSignals(client, output=output, channel=channel)
    feeder = FrameStdin(client, channel) if request.stdin == "open" else None
    sink = Sink(as_json=bool(message.get("json")), output=output)
    listener = threading.Thread(
        target=_listen, args=(channel, forwarder, feeder, sink), daemon=True, name="mux-client"
    )
    listener.start()
    store = _cursor_store(target, message)

    def submitted(turn_id: str) -> None:
        if store is not None:
            sink.cursor = store.open(turn_id)
        forwarder.attach(turn_id)
        if feeder is not None:
            feeder.start(turn_id)

    def event(shown: Event) -> None:
        output.show(sink, shown)

    try:
        try:
            finished = drive(client, request, event, on_submitted=submitted)
        finally:
            forwarder.settle()  # as leaving installed() does in-process: before what follows
        final = finished.turn
        if final.refusal is not None and not sink.refusal_shown:
            output.say(refusal_sentence(final.refusal))
        sink.turn(final)
        status = finished.exit_status
        if sink.cursor is not None:
            # The client confirms the last event as it writes it, while the turn's end is
            # already here: closed before that, the cursor lost it, and ``paddock logs
            # --follow`` showed the turn's last output again (once in a loaded CI run).
            sink.cursor.wait_for(output.last_seq, CONFIRM_WAIT_S)
    except ClientGone:
        return  # as when paddock run is killed: the turn goes on; nobody is told
    finally:
        if sink.cursor is not None:
            sink.cursor.close()
    with contextlib.suppress(OSError):
        channel.send({"t": "exit", "status": status})


def _cursor_store(target: Target, message: Message) -> CursorStore | None:
    """The client's cursor store for this target, as ``commands.cursor_store`` makes it."""
    scope = message.get("cursor")
    if not isinstance(scope, dict):
        return None
    environ = {k: str(v) for k, v in scope.get("environ", {}).items() if v is not None}
    name, ssh = scope.get("name"), scope.get("ssh")
    return CursorStore.for_user(
        environ,
        target.client.base_url,
        name=name if isinstance(name, str) else None,
        ssh=ssh if isinstance(ssh, str) else None,
    )


def _request(target: Target, message: Message) -> TurnRequest:
    """The TurnRequest, built and checked here as ``paddock run`` does it in-process."""
    fields = message.get("options")
    if not isinstance(fields, dict):
        raise UsageError("the multiplexer was sent no turn to run")
    try:
        options = RequestOptions(
            argv=tuple(fields["argv"]),
            cwd=fields.get("cwd"),
            env=dict(fields.get("env") or {}),
            read=tuple(fields.get("read") or ()),
            write=tuple(fields.get("write") or ()),
            network=bool(fields.get("network")),
            wall_s=fields.get("wall_s"),
            lease=_lease_of(fields.get("lease")),
            session=fields.get("session"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"the multiplexer was sent a malformed turn: {exc}") from exc
    role = message.get("role")
    request = options.request(role if isinstance(role, str) and role else target.role)
    if message.get("stdin") == "open":
        request = request.model_copy(update={"stdin": "open"})
    return request


def _lease_of(sent: object) -> tuple[str, str, int] | None:
    """The (lease id, seat, generation) a client sent (as a JSON list), or None."""
    if sent is None:
        return None
    if not isinstance(sent, list) or len(sent) != 3:
        raise UsageError("the multiplexer was sent a malformed lease")
    lease_id, seat, generation = sent
    return str(lease_id), str(seat), int(generation)


class RelayedSignals(SignalForwarder):
    """``SignalForwarder``, telling the client when each signal has been dealt with.

    A client that gives up waiting first waits for those (``streaming``'s
    ``POST_GRACE_S``), so that what it sent reaches the turn and what was said
    about it reaches the user, as when the turn is run in-process.
    """

    def __init__(self, client: TargetClient, *, output: FrameOutput, channel: Channel) -> None:
        super().__init__(client, output=output)
        self._channel = channel

    def _deliver(self, turn_id: str, name: str, quiet: bool) -> None:
        try:
            super()._deliver(turn_id, name, quiet)
        finally:
            with contextlib.suppress(OSError, ClientGone):
                self._channel.send({"t": "signal-done"})

    def settle(self) -> None:
        """Wait for the signals being posted, as leaving ``installed()`` does in-process."""
        for thread in list(self._posting):
            thread.join(POST_GRACE_S)


def _listen(
    channel: Channel, forwarder: SignalForwarder, feeder: FrameStdin | None, sink: Sink
) -> None:
    """The client's frames while its turn runs: signals now, stdin in order, deliveries."""
    try:
        while (received := channel.receive()) is not None:
            message, data = received
            kind = message.get("t")
            if kind == "signal":
                forwarder.send(str(message.get("name")), quiet=bool(message.get("quiet")))
            elif kind == "stdin" and feeder is not None:
                feeder.put(data)
            elif kind == "stdin-eof" and feeder is not None:
                feeder.put(None)
            elif kind == "delivered" and sink.cursor is not None:
                sink.cursor.delivered(int(message.get("seq", 0)))
    except (OSError, AgentError):
        pass  # the client went away; the turn's own frames will find that out
    if feeder is not None:
        feeder.abandon()


class FrameStdin:
    """Writes the client's stdin chunks to the turn in order, acknowledging each one.

    The client sends a few chunks ahead and then waits for an acknowledgement,
    so what is held here is bounded however fast its stdin is and however
    slowly the turn reads.
    """

    def __init__(self, client: TargetClient, channel: Channel) -> None:
        self._client = client
        self._channel = channel
        self._chunks: queue.SimpleQueue[bytes | BaseException | None] = queue.SimpleQueue()

    def put(self, chunk: bytes | None) -> None:
        """A chunk to write, or None for the end of the client's stdin."""
        self._chunks.put(chunk)

    def abandon(self) -> None:
        self._chunks.put(ClientGone("the client went away"))

    def start(self, turn_id: str) -> None:
        threading.Thread(target=self._copy, args=(turn_id,), daemon=True, name="mux-stdin").start()

    def _copy(self, turn_id: str) -> None:
        try:
            while not isinstance(chunk := self._chunks.get(), BaseException):
                if chunk is None:
                    self._client.write_stdin(turn_id, b"", eof=True)
                    return
                self._client.write_stdin(turn_id, chunk)
                self._channel.send({"t": "ack"})
        except (AgentError, RuntimeError, OSError):
            # The turn ended without reading it all (like a closed pipe), or the client left.
            return
