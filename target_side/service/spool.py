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
        self._offsets, self._kinds, self._size = _index(path)
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - held for the turn's life
        self._changed = asyncio.Event()
        self.finished = bool(self._kinds) and self._kinds[-1] in TERMINAL_KINDS
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
        self._kinds.append(event.kind)
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
        return [EVENTS.validate_json(line) for _, _, line in await self.raw_after(after)]

    async def raw_after(self, after: int) -> list[tuple[int, str, bytes]]:
        """Up to ``READ_BATCH`` events after ``after`` as (seq, kind, JSON line), unparsed.

        Streaming serves these as they lie on disk: parsing and re-encoding every
        output chunk would cost more than everything else on the way.
        """
        first = max(after, 0)
        if first >= self.last_seq:
            return []
        last = min(first + READ_BATCH, self.last_seq)
        start = self._offsets[first]
        end = self._offsets[last] if last < self.last_seq else self._size
        data = await asyncio.to_thread(_read_range, self.path, start, end)
        lines = data.split(b"\n")[: last - first]
        return [(first + i + 1, self._kinds[first + i], line) for i, line in enumerate(lines)]

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


def _index(path: Path) -> tuple[list[int], list[str], int]:
    """Offset and kind of every complete line of an existing spool, and its size.

    Read in blocks, so memory stays flat whatever the spool's size. A line torn
    by a crash mid-write is cut off: it was never delivered to anyone.
    """
    offsets: list[int] = []
    kinds: list[str] = []
    if not path.exists():
        return offsets, kinds, 0
    line_start = 0
    pending = b""
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            pending += block
            position = 0
            while (cut := pending.find(b"\n", position)) >= 0:
                offsets.append(line_start + position)
                kinds.append(EVENTS.validate_json(pending[position:cut]).kind)
                position = cut + 1
            line_start += position
            pending = pending[position:]
    if pending:
        os.truncate(path, line_start)
    return offsets, kinds, line_start


def _read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)
