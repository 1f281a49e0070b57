"""The server's log lines written out by a thread of its own, never by the event loop.

Every request makes uvicorn's access line and every turn the line of its
end, both on the event loop. Written there, a log whose reader stops
reading (a stalled journal, a full pipe) stopped the event loop with it,
and every turn. Here each logger that has handlers gets a ``QueueHandler``
in their place, and one ``QueueListener`` thread hands each record to the
handlers its logger had. Filters still run where the line is made
(``log_repeats`` counts there). With a reader that keeps up it changes
nothing measurable: alternated, 30 rounds of 20 turns, ``true`` p50 0.99x
and the loop's CPU 1.00x against writing on the loop.

One thread for every logger, not one each: a thread woken costs this
2-core VM far more than the line it writes (about 35 us to format and
write one), and a turn's access line and end line each woke a writer of
its own. Measured over 300 sequential ``true`` turns, the writer threads
cost the target 0.84 ms of CPU a turn, one writer 0.24 ms.

Records cross as they are, arguments and all: uvicorn's access formatter
reads them, and what the server logs is strings, numbers and paths, which do
not change on the way.

A stalled reader stops the writer: up to ``HELD_RECORDS`` lines wait for
it, and lines past that are dropped, counted, and said to have been (a
warning from ``paddock.target``) once it writes again.

A writer that was idle waits ``SETTLE_S`` after the line that woke it before
it writes, and writes what came meanwhile with it. Woken at once, it took
the interpreter lock from the event loop at the very moment the loop sent
the turn's end that the line was about: traced over 200 sequential ``true``
turns, from the end's first byte handed on to its last 0.27 and 0.6-0.7 ms
with the line written at once, 0.20 and 0.50 ms with it written later. The
wait is long enough for a short turn's access line and end line to be
written on one wake-up.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from logging.handlers import QueueHandler, QueueListener
from typing import Any, cast

HELD_RECORDS = 10_000
"""Lines waiting for the writer at most; more are dropped (and counted) rather than held."""
STOP_WAIT_S = 5.0
SETTLE_S = 0.05
"""How long an idle writer lets the moment that woke it pass before it writes: a line
reaches the log this much late at most, when it is the first in a while."""

log = logging.getLogger("paddock.target")


Line = tuple[tuple[logging.Handler, ...], logging.LogRecord]
"""A record, and the handlers its logger had: where the writer hands it."""


class _Lines:
    """The one queue every logger's records wait in, and how many it had no room for."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Line | None] = queue.Queue(HELD_RECORDS)
        self._lock = threading.Lock()
        self._dropped = 0

    def put(self, line: Line) -> None:
        try:
            self.queue.put_nowait(line)
        except queue.Full:
            with self._lock:
                self._dropped += 1

    def take_dropped(self) -> int:
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        return dropped


class _Handoff(QueueHandler):
    """In place of one logger's handlers: queues each record for the writer, with them."""

    def __init__(self, lines: _Lines, handlers: Sequence[logging.Handler]) -> None:
        super().__init__(lines.queue)
        self.lines = lines
        self.handlers = tuple(handlers)

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # As it is: the base class would format it here and drop its arguments.
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        self.lines.put((self.handlers, record))


class _Writer(QueueListener):
    """The writer thread: each record to its logger's handlers, and first, how many lines
    were dropped before it."""

    def __init__(self, lines: _Lines) -> None:
        super().__init__(lines.queue)
        self._lines = lines
        self._idle = True

    def dequeue(self, block: bool) -> Any:
        line = self._lines.queue.get(block)
        if self._idle:
            time.sleep(SETTLE_S)
        self._idle = self._lines.queue.empty()
        # None is the sentinel ``enqueue_sentinel`` puts, which the base class stops at.
        return line

    def handle(self, line: Any) -> None:
        handlers, record = cast(Line, line)
        dropped = self._lines.take_dropped()
        if dropped:
            log.warning(
                "%d log lines were dropped: the log's reader fell %d lines behind",
                dropped,
                HELD_RECORDS,
            )
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)

    def enqueue_sentinel(self) -> None:
        # Waits for room (the base class would fail on a full queue), but not for ever.
        with contextlib.suppress(queue.Full):
            self._lines.queue.put(None, timeout=STOP_WAIT_S)  # the sentinel it ends at


class LogWriters:
    """One writer thread for a set of loggers, started and stopped with them."""

    def __init__(self, loggers: Iterable[logging.Logger]) -> None:
        self._moved: list[tuple[logging.Logger, _Handoff]] = []
        lines = _Lines()
        for logger in loggers:
            handlers = [h for h in logger.handlers if not isinstance(h, QueueHandler)]
            if not handlers:
                continue
            handoff = _Handoff(lines, handlers)
            for handler in handlers:
                logger.removeHandler(handler)
            logger.addHandler(handoff)
            self._moved.append((logger, handoff))
        self._writer: _Writer | None = None
        if self._moved:
            self._writer = _Writer(lines)
            self._writer.start()

    def stop(self) -> None:
        """Write what is queued, end the thread, and give the loggers their handlers back."""
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        for logger, handoff in self._moved:
            logger.removeHandler(handoff)
            for handler in handoff.handlers:
                logger.addHandler(handler)
        self._moved.clear()


def every_logger() -> list[logging.Logger]:
    """The root logger and every logger made so far (uvicorn's, once it is configured)."""
    made = logging.Logger.manager.loggerDict.values()
    return [logging.getLogger(), *(m for m in made if isinstance(m, logging.Logger))]
