"""A turn on a terminal, driven from this one: ``paddock shell`` and ``paddock run -it``.

What ``ssh host`` does, over the target's API: the turn gets a pty of this
terminal's size (``tty`` on the request); this terminal goes raw, so every
keystroke (Ctrl-C, Ctrl-Z and Ctrl-D included) is sent as it is typed, and
the target's line discipline decides what each means; what the pty prints
is written here as it comes; a window resize (SIGWINCH) is sent on; the exit
status is the turn's. The terminal is put back as it was on every way out:
the turn's end, a failure, TERM, HUP, or a third Ctrl-C... which, raw, is
just a byte: to stop waiting, close this terminal or kill this process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import termios
import threading
import tty
import uuid
from collections.abc import Iterator
from types import FrameType

from agent_side.client import TargetClient
from agent_side.errors import AgentError
from agent_side.stdio import StopWaiting
from agent_side.turns import exit_status, output_bytes
from agent_side.views import refusal_sentence, say
from shared.exit_status import for_signal
from shared.wire import TERMINAL_KINDS, OutputEvent, Tty, TurnRequest

DEFAULT_SIZE = (24, 80)
KEY_CHUNK = 4096
"""At most this much typed (or pasted) at once goes in one request."""


def terminal_size(fd: int | None = None) -> tuple[int, int]:
    """Rows and columns of this terminal (stdout's, else stdin's), else 24 x 80."""
    for candidate in (fd, _fileno(sys.stdout), _fileno(sys.stdin)):
        if candidate is None:
            continue
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(candidate)
            if size.lines > 0 and size.columns > 0:
                return size.lines, size.columns
    return DEFAULT_SIZE


def on_terminal(request: TurnRequest, environ: dict[str, str] | None = None) -> TurnRequest:
    """``request`` on a pty of this terminal's size and kind (TERM), its stdin the keystrokes."""
    rows, cols = terminal_size()
    term = (environ if environ is not None else os.environ).get("TERM") or None
    if term is not None and not all(c.isalnum() or c in "._+-" for c in term):
        term = None
    return request.model_copy(update={"tty": Tty(rows=rows, cols=cols, term=term), "stdin": "open"})


@contextlib.contextmanager
def raw_mode(fd: int | None) -> Iterator[bool]:
    """``fd``'s terminal raw for the block (if it is one), and as it was after, whatever ends it.

    TERM and HUP end the block (as ``StopWaiting``) so that it is put back before this
    process goes; yields whether it went raw.
    """
    if fd is None or not os.isatty(fd):
        yield False
        return
    saved = termios.tcgetattr(fd)
    previous = {signum: signal.signal(signum, _leave) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _leave(signum: int, frame: FrameType | None) -> None:
    raise StopWaiting(for_signal(signum))


class Keys:
    """Copies what is typed here to the turn, on a helper thread, as soon as it is read."""

    def __init__(self, client: TargetClient, turn_id: str, fd: int | None) -> None:
        self._client = client
        self._turn_id = turn_id
        self._fd = fd
        self._thread = threading.Thread(target=self._copy, daemon=True, name="paddock-keys")

    def start(self) -> None:
        if self._fd is not None:
            self._thread.start()

    def _copy(self) -> None:
        fd = self._fd
        try:
            while fd is not None and (chunk := os.read(fd, KEY_CHUNK)):
                self._client.write_stdin(self._turn_id, chunk)
            self._client.write_stdin(self._turn_id, b"", eof=True)
        except (AgentError, RuntimeError, OSError, ValueError):
            return  # the turn has ended (its stdin is closed), or we are leaving


class Resizer:
    """Sends this terminal's new size to the turn on every SIGWINCH (from a helper thread)."""

    def __init__(self, client: TargetClient, turn_id: str) -> None:
        self._client = client
        self._turn_id = turn_id
        self._wanted = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True, name="paddock-resize")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGWINCH, lambda *_: self._wanted.set())
        self._thread.start()
        try:
            yield
        finally:
            signal.signal(signal.SIGWINCH, previous)
            self._done.set()
            self._wanted.set()

    def _send(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._done.is_set():
                return
            rows, cols = terminal_size()
            with contextlib.suppress(AgentError, RuntimeError):
                self._client.resize(self._turn_id, rows, cols)


def run_on_terminal(client: TargetClient, request: TurnRequest) -> int:
    """Run ``request`` on a terminal driven from this one; the status to exit with."""
    request = on_terminal(request)
    turn = client.submit(request, idempotency_key=str(uuid.uuid4()))
    stdin = _fileno(sys.stdin)
    out = _fileno(sys.stdout)
    terminal = None
    with raw_mode(stdin) as raw:
        Keys(client, turn.turn_id, stdin).start()
        with Resizer(client, turn.turn_id).installed():
            for event in client.follow(turn.turn_id):
                if isinstance(event, OutputEvent):
                    _write(out, output_bytes(event))
                elif event.kind == "notice":
                    _write(out, _line(f"paddock: notice: {event.message}", raw))
                if event.kind in TERMINAL_KINDS:
                    terminal = event
    final = client.turn(turn.turn_id)
    if final.refusal is not None:
        say(refusal_sentence(final.refusal))
    return exit_status(final, terminal)


def _line(text: str, raw: bool) -> bytes:
    # Raw, the terminal does not turn "\n" into a new line: say it with "\r\n".
    return ("\r\n" + text + "\r\n" if raw else text + "\n").encode()


def _write(fd: int | None, data: bytes) -> None:
    if fd is None:
        return
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fileno(stream: object) -> int | None:
    try:
        return int(stream.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return None
