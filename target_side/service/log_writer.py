"""The server's log lines written out by threads of their own, never by the event loop.

Every request makes uvicorn's access line and every turn the line of its end,
both on the event loop, where writing one out (formatted, written, flushed to
stderr, a pipe or a file) measured 0.26 ms: half a millisecond of each turn
during which no other turn's stream moved, and more when the log's reader is
slow. Here each logger that has handlers gets a ``QueueHandler`` in their
place, and a ``QueueListener`` thread hands its records to the handlers it
had. Filters still run where the line is made (``log_repeats`` counts there).

Records cross as they are, arguments and all: uvicorn's access formatter
reads them, and what the server logs is strings, numbers and paths, which do
not change on the way.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterable
from logging.handlers import QueueHandler, QueueListener


class _Handoff(QueueHandler):
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # As it is: the base class would format it here and drop its arguments.
        return record


class LogWriters:
    """The writer threads of a set of loggers, started together and stopped together."""

    def __init__(self, loggers: Iterable[logging.Logger]) -> None:
        self._listeners: list[QueueListener] = []
        self._moved: list[tuple[logging.Logger, list[logging.Handler], logging.Handler]] = []
        for logger in loggers:
            handlers = [h for h in logger.handlers if not isinstance(h, QueueHandler)]
            if not handlers:
                continue
            records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
            handoff = _Handoff(records)
            listener = QueueListener(records, *handlers, respect_handler_level=True)
            for handler in handlers:
                logger.removeHandler(handler)
            logger.addHandler(handoff)
            self._moved.append((logger, handlers, handoff))
            self._listeners.append(listener)
            listener.start()

    def stop(self) -> None:
        """Write what is queued, end the threads, and give the loggers their handlers back."""
        for listener in self._listeners:
            listener.stop()
        for logger, handlers, handoff in self._moved:
            logger.removeHandler(handoff)
            for handler in handlers:
                logger.addHandler(handler)
        self._listeners.clear()
        self._moved.clear()


def every_logger() -> list[logging.Logger]:
    """The root logger and every logger made so far (uvicorn's, once it is configured)."""
    made = logging.Logger.manager.loggerDict.values()
    return [logging.getLogger(), *(m for m in made if isinstance(m, logging.Logger))]
