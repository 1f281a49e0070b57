"""Collapsing a log line repeated many times into one line per interval, with a count.

A flood of bad connections makes the same warning thousands of times a second
("Invalid HTTP request received.", a connection closed for sending nothing);
written out each time, it fills the disk the target needs for turns. The first
of a kind in each interval is written; the rest are counted, and the count
rides on the next one written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

INTERVAL_S = 10.0
MAX_KINDS = 1000
"""Distinct lines remembered at once; past it, the oldest are forgotten (their counts lost)."""

COLLAPSED_LOGGERS = ("uvicorn.error", "asyncio", "paddock.target.connections")
"""Loggers whose lines a flood of clients can repeat; the target's own turn logs are not here."""


@dataclass
class _Seen:
    since: float
    suppressed: int = 0


class CollapseRepeats(logging.Filter):
    """Pass the first record of each (logger, level, message) per interval; count the others."""

    def __init__(
        self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[tuple[str, int, str], _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.since < self.interval_s:
            seen.suppressed += 1
            return False
        if seen is not None and seen.suppressed:
            record.msg = (
                f"{record.msg} [and {seen.suppressed} more like it in the "
                f"{now - seen.since:.0f} s before]"
            )
        self._seen.pop(key, None)
        if len(self._seen) >= MAX_KINDS:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = _Seen(now)
        return True


def collapse_repeats(names: tuple[str, ...] = COLLAPSED_LOGGERS) -> None:
    """Install one ``CollapseRepeats`` on each of ``names`` (once per process)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, CollapseRepeats) for f in logger.filters):
            logger.addFilter(CollapseRepeats())
