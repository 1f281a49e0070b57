"""A turn's events, appended to a file on disk and read back from any seq.

Output is never held in memory beyond one read: each event is one JSON line,
and only the byte offset of each line is kept, so a reader can resume from any
seq, and memory stays flat whatever a turn prints.

Every append writes its whole line or nothing: a write the disk refuses
(full, over quota, failing) or cuts short is cut back off before ``append``
raises ``StorageError``, so no torn line is ever followed by another. The
target's own closing events (a notice, the terminal event) must reach the
turn's followers even then: ``append_kept`` holds what the disk refused in
memory, serves it to readers after what is on disk, and ``flush_held`` writes
it once the disk takes writes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.wire import EVENTS, TERMINAL_KINDS, Event
from target_side.errors import StorageError
from target_side.service.tails import Cut, cut_file, stamp, write_all

READ_BATCH = 256

OnStorageError = Callable[[StorageError], None]


def now() -> datetime:
    return datetime.now(UTC)


def _ignore(_exc: StorageError) -> None:
    return None


class EventSpool:
    """Append-only event log of one turn, with waiters woken on every append.

    Opening an existing spool cuts a torn tail (see ``_index``); ``cut`` says
    what was cut, for the ledger. ``on_storage_error`` hears of every write the
    disk refused, before the caller does.
    """

    def __init__(self, path: Path, on_storage_error: OnStorageError = _ignore) -> None:
        self.path = path
        self._on_storage_error = on_storage_error
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._offsets, self._kinds, self._size, self.cut = _index(path)
            self._fd = os.open(
                path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise self._refused(f"{path}: cannot open the event spool", exc) from exc
        self._held: list[tuple[str, bytes]] = []
        self._changed = asyncio.Event()
        self.finished = bool(self._kinds) and self._kinds[-1] in TERMINAL_KINDS
        if self.finished:
            self._close_file()

    @property
    def last_seq(self) -> int:
        return len(self._offsets) + len(self._held)

    @property
    def held(self) -> int:
        """Events the disk refused, kept in memory until ``flush_held`` writes them."""
        return len(self._held)

    def append(self, kind: str, **fields: Any) -> Event:
        """Record one event on disk, or raise ``StorageError`` having written nothing of it."""
        event, line = self._event(kind, fields)
        if self._held:
            # Order is the contract: nothing goes to disk ahead of an event still held.
            raise self._refused(f"{self.path}: events before this one wait for the disk", None)
        self._write(line)
        self._committed(event, len(line))
        return event

    def append_kept(self, kind: str, **fields: Any) -> bool:
        """Record one event of the target's own; if the disk refuses it, hold it in memory.

        True if it is on disk. Held events reach readers all the same, in order.
        """
        event, line = self._event(kind, fields)
        if not self._held:
            try:
                self._write(line)
            except StorageError:
                pass
            else:
                self._committed(event, len(line))
                return True
        self._held.append((event.kind, line[:-1]))
        self._kinds.append(event.kind)
        self._settle(event.kind)
        return False

    def flush_held(self) -> bool:
        """Write the held events, oldest first; True when none is left."""
        while self._held:
            kind, line = self._held[0]
            try:
                self._write(line + b"\n")
            except StorageError:
                return False
            self._held.pop(0)
            self._offsets.append(self._size)
            self._size += len(line) + 1
            if kind in TERMINAL_KINDS:
                self._close_file()
        return True

    def _event(self, kind: str, fields: dict[str, Any]) -> tuple[Event, bytes]:
        if self.finished:
            raise RuntimeError(f"{self.path}: no event may follow a terminal one")
        event = EVENTS.validate_python(
            {"seq": self.last_seq + 1, "at": now(), "kind": kind, **fields}
        )
        return event, event.model_dump_json(exclude_none=True).encode() + b"\n"

    def _write(self, line: bytes) -> None:
        try:
            write_all(self._fd, line)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise self._refused(f"{self.path}: an event could not be written", exc) from exc

    def _refused(self, what: str, exc: OSError | None) -> StorageError:
        why = f" ({exc.strerror or exc})" if exc is not None else ""
        error = StorageError(f"{what}{why}")
        self._on_storage_error(error)
        return error

    def _committed(self, event: Event, length: int) -> None:
        self._offsets.append(self._size)
        self._kinds.append(event.kind)
        self._size += length
        self._settle(event.kind)

    def _settle(self, kind: str) -> None:
        if kind in TERMINAL_KINDS:
            self.finished = True
            if not self._held:
                self._close_file()
        self._wake()

    def sync(self) -> bool:
        """Put what was appended on the disk (blocking: the ledger runs it before a turn's end).

        The terminal event that follows is not synced: after a crash of the
        machine, a restarted target writes it again from the ledger.
        """
        if self._fd < 0:
            return True
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._refused(f"{self.path}: the turn's output could not be put on the disk", exc)
            return False
        return True

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def read_after(self, after: int) -> list[Event]:
        """Up to ``READ_BATCH`` events with seq > ``after`` (the read runs off the event loop)."""
        return [EVENTS.validate_json(line) for _, _, line in await self.raw_after(after)]

    async def raw_after(self, after: int) -> list[tuple[int, str, bytes]]:
        """Up to ``READ_BATCH`` events after ``after`` as (seq, kind, JSON line), unparsed.

        Streaming serves these as they lie on disk: parsing and re-encoding every
        output chunk would cost more than everything else on the way. Held
        events come after the last one on disk, from memory.
        """
        first = max(after, 0)
        on_disk = len(self._offsets)
        if first >= on_disk:
            held = self._held[first - on_disk : first - on_disk + READ_BATCH]
            return [(first + i + 1, kind, line) for i, (kind, line) in enumerate(held)]
        last = min(first + READ_BATCH, on_disk)
        start = self._offsets[first]
        end = self._offsets[last] if last < on_disk else self._size
        data = await asyncio.to_thread(_read_range, self.path, start, end)
        lines = data.split(b"\n")[: last - first]
        return [(first + i + 1, self._kinds[first + i], line) for i, line in enumerate(lines)]

    async def terminal(self) -> Event | None:
        """The terminal event, if the turn has one."""
        if not self.finished:
            return None
        [(_, _, line)] = await self.raw_after(self.last_seq - 1)
        return EVENTS.validate_json(line)

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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _index(path: Path) -> tuple[list[int], list[str], int, Cut | None]:
    """Offset and kind of every whole event of an existing spool, its size, and what was cut.

    Read in blocks, so memory stays flat whatever the spool's size. The spool
    is cut at its first line that is not the next event: a line torn by a
    crash mid-write, or anything after one. The bytes cut are kept beside it
    (``events.jsonl.torn-STAMP``): they were never delivered to anyone.
    """
    offsets: list[int] = []
    kinds: list[str] = []
    if not path.exists():
        return offsets, kinds, 0, None
    line_start = 0
    pending = b""
    torn = False
    with open(path, "rb") as f:
        while not torn and (block := f.read(1 << 20)):
            pending += block
            position = 0
            while (cut := pending.find(b"\n", position)) >= 0:
                kind = _kind_of(pending[position:cut], len(offsets) + 1)
                if kind is None:
                    torn = True
                    break
                offsets.append(line_start + position)
                kinds.append(kind)
                position = cut + 1
            line_start += position
            pending = pending[position:]
    size = path.stat().st_size
    if line_start == size:
        return offsets, kinds, line_start, None
    return offsets, kinds, line_start, cut_file(path, line_start, f"{path.name}.torn-{stamp()}")


def _kind_of(line: bytes, seq: int) -> str | None:
    """The kind of ``line`` if it is event ``seq``; None if it is not (torn, or out of place)."""
    try:
        event = EVENTS.validate_json(line)
    except ValidationError:
        return None
    return event.kind if event.seq == seq else None


def _read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)
