"""A turn's events, appended to a file on disk and read back from any seq.

Output is never held in memory beyond one read: each event is one JSON line,
and only the byte offset of each line is kept, so a reader can resume from any
seq, and memory stays flat whatever a turn prints.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shared.wire import EVENTS, TERMINAL_KINDS, Event

READ_BATCH = 256


def now() -> datetime:
    return datetime.now(UTC)


class EventSpool:
    """Append-only event log of one turn, with waiters woken on every append."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._offsets, self._size, last_kind = _index(path)
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - held for the turn's life
        self._changed = asyncio.Event()
        self.finished = last_kind in TERMINAL_KINDS
        if self.finished:
            self._file.close()

    @property
    def last_seq(self) -> int:
        return len(self._offsets)

    def append(self, kind: str, **fields: Any) -> Event:
        """Record one event; the spool assigns its seq and time."""
        if self.finished:
            raise RuntimeError(f"{self.path}: no event may follow a terminal one")
        event = EVENTS.validate_python(
            {"seq": self.last_seq + 1, "at": now(), "kind": kind, **fields}
        )
        line = event.model_dump_json(exclude_none=True).encode() + b"\n"
        self._file.write(line)
        self._offsets.append(self._size)
        self._size += len(line)
        if kind in TERMINAL_KINDS:
            self.finished = True
            os.fsync(self._file.fileno())
            self._file.close()
        self._wake()
        return event

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def read_after(self, after: int) -> list[Event]:
        """Up to ``READ_BATCH`` events with seq > ``after`` (the read runs off the event loop)."""
        first = max(after, 0)
        if first >= self.last_seq:
            return []
        last = min(first + READ_BATCH, self.last_seq)
        start = self._offsets[first]
        end = self._offsets[last] if last < self.last_seq else self._size
        data = await asyncio.to_thread(_read_range, self.path, start, end)
        return [EVENTS.validate_json(line) for line in data.splitlines()]

    async def wait_beyond(self, seq: int, timeout: float) -> bool:
        """Wait until an event after ``seq`` exists; False if ``timeout`` passed first."""
        changed = self._changed
        if self.last_seq > seq:
            return True
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            return self.last_seq > seq
        return True

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _index(path: Path) -> tuple[list[int], int, str | None]:
    """Offsets of every complete line of an existing spool, its size, and its last event's kind.

    Read in blocks, so memory stays flat whatever the spool's size. A line torn
    by a crash mid-write is cut off: it was never delivered to anyone.
    """
    if not path.exists():
        return [], 0, None
    offsets: list[int] = []
    line_start, position, last_line = 0, 0, b""
    pending = b""
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            pending += block
            while (cut := pending.find(b"\n")) >= 0:
                offsets.append(line_start)
                last_line, pending = pending[: cut + 1], pending[cut + 1 :]
                line_start += cut + 1
            position += len(block)
    if pending:
        os.truncate(path, line_start)
    kind = EVENTS.validate_json(last_line).kind if last_line else None
    return offsets, line_start, kind


def _read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)
