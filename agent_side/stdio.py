"""This process's own ends of ``paddock run``: its stdin, a stdout that went away, how it stops.

Standard library only: ``streaming`` (a turn run from this process) and
``mux.client`` (a turn run by the multiplexer for this process) both use it,
and the second must start without loading httpx or pydantic.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TextIO

from shared.exit_status import for_signal

INTERRUPTED = for_signal(signal.SIGINT)
TERMINATED = for_signal(signal.SIGTERM)
BROKEN_PIPE = for_signal(signal.SIGPIPE)

TERMINAL_STDIN_NOTE = (
    "note: stdin is a terminal, which is not forwarded (the turn's stdin is closed); "
    "give -it for a terminal on the target, pipe input in, or --no-stdin to skip this note"
)


class StopWaiting(KeyboardInterrupt):
    """The user gave up waiting for the turn (a third Ctrl-C, a second TERM)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Interrupts:
    """What Ctrl-C and TERM mean while this process waits on a turn, wherever it runs.

    The first Ctrl-C is INT for the turn, the second KILL, the third stops
    waiting (``StopWaiting``; the turn goes on). A TERM is KILL, since
    whoever sent it wants the work gone, and a second stops waiting. The
    handlers run on the main thread between bytecodes, so they only count and
    decide: ``send`` must hand the talking to another thread.
    """

    def __init__(self, send: Callable[[str], None]) -> None:
        self._send = send
        self._presses = 0
        self._terms = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM while the block runs (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous_int = signal.signal(signal.SIGINT, self._on_sigint)
        previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self._presses += 1
        if self._presses >= 3:
            raise StopWaiting(INTERRUPTED)
        self._send("INT" if self._presses == 1 else "KILL")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._terms += 1
        if self._terms >= 2:
            raise StopWaiting(TERMINATED)
        self._send("KILL")


def stdin_fd() -> int | None:
    """Our stdin's descriptor if it is something to forward: open, and not a terminal."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return None if os.isatty(fd) else fd


def stdin_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def write(stream: TextIO, data: bytes) -> None:
    """Write ``data`` to ``stream`` at once, after whatever text it already holds."""
    stream.flush()
    stream.buffer.write(data)
    stream.buffer.flush()


def silence_stdout() -> None:
    """Point fd 1 at /dev/null, so that nothing trips on the dead pipe at exit."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
