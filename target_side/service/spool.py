"""A turn's events, appended to a file on disk and read back from any seq.

Output is not held in memory beyond the last ``TAIL_BYTES`` of a running turn:
each event is one record of the file, and only the byte offset and kind of
each record are kept, so a reader can resume from any seq, and memory stays
flat whatever a turn prints. The tail serves the followers that keep up with
the turn from memory, without a read of the file.

A spool is frames (``TURN.frames``, ``shared.frames``): a turn's output is
stored as the bytes it wrote, and the frame stream serves the file's bytes as
they are; the event stream (SSE) turns each frame into the ``Event`` JSON it
has always sent. Spools of turns run before frames (``events.jsonl``, one
``Event`` JSON line per record) are read, served both ways, and finished the
same: a target upgraded in place keeps every turn it had.

Every append writes its whole record or nothing: a write the disk refuses
(full, over quota, failing) or cuts short is cut back off before ``append``
raises ``StorageError``, so no torn record is ever followed by another. The
target's own closing events (a notice, the terminal event) must reach the
turn's followers even then: ``append_kept`` holds what the disk refused in
memory, serves it to readers after what is on disk, and ``flush_held`` writes
it once the disk takes writes again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from array import array
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared import frames
from shared.frames import KIND_CODES, KINDS
from shared.wire import EVENTS, TERMINAL_KINDS, Event
from target_side.errors import StorageError
from target_side.fence.raw_syscalls import start_writeback
from target_side.safe_files import open_existing, open_to_read
from target_side.service.tails import Cut, cut_file, stamp, write_all

READ_BATCH = 256
"""Events per read for the event stream."""
FRAMES_BATCH_BYTES = 4 << 20
"""Bytes per read for the frame stream (whole frames; one larger frame goes alone)."""
TAIL_BYTES = 2 << 20
"""Recent records of a running turn kept in memory for the followers keeping up with it."""
WRITEBACK_BYTES = 4 << 20
"""Bytes appended before the disk is asked to start writing them out (``_write_back``)."""
CACHED_AFTER_SYNC = 2 * WRITEBACK_BYTES
"""A spool bigger than this, once synced, lets the page cache go of all it had written out; a
smaller one (most turns' few events) stays cached for whoever reads it next."""
FRAMES = "events.frames"
LINES = "events.jsonl"
OUTPUT_KINDS = frozenset({"stdout", "stderr"})

OnStorageError = Callable[[StorageError], None]
SpoolAtRest = tuple[str, int, "array[int]", bytearray]
"""An ended spool's file, size, record offsets and kinds (``EventSpool.at_rest``)."""


def now() -> datetime:
    return datetime.now(UTC)


def _ignore(_exc: StorageError) -> None:
    return None


class EventSpool:
    """Append-only event log of one turn, with waiters woken on every append.

    Its format follows its file name: frames (``TURN.frames``; ``events.frames``
    in a turn's own directory, as earlier versions kept it), or, for a turn
    spooled before frames, JSON lines (``events.jsonl``). Opening an existing
    spool cuts a torn tail (see ``_index``); ``cut`` says what was cut, for the
    ledger. ``on_storage_error`` hears of every write the disk refused, before
    the caller does.
    """

    def __init__(
        self, path: Path, on_storage_error: OnStorageError = _ignore, *, on_disk: bool = True
    ) -> None:
        self.path = path
        self._format: _Format = _Lines() if path.name.endswith(".jsonl") else _Frames()
        self._on_storage_error = on_storage_error
        # Eight bytes an event for where it starts and one for its kind: what a turn keeps
        # in memory for its whole retention grows with its events, and a chatty one has many.
        self._offsets = array("Q")
        self._kinds = bytearray()
        self._size = 0
        self._written_back = 0
        """Where the disk was last asked to start writing out what was appended."""
        self._uncached = 0
        """Up to where the spool's bytes were let go from the page cache."""
        self.cut: Cut | None = None
        self._fd = -1
        if on_disk:
            self.create()
        self._held: list[tuple[str, bytes]] = []
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        self._changed = asyncio.Event()
        self.finished = _ends_a_turn(self._kinds)

    @classmethod
    def new(cls, path: Path, on_storage_error: OnStorageError = _ignore) -> EventSpool:
        """The spool of a turn being made, not yet on disk: ``create`` makes it (blocking)."""
        return cls(path, on_storage_error, on_disk=False)

    def create(self, *, report: bool = True) -> None:
        """Open the spool's file (made if missing; a torn tail of one found is cut, see
        ``_index``), or raise ``StorageError``; ``report=False`` (off the event loop) leaves
        telling ``on_storage_error`` to the caller."""
        path = self.path
        try:
            self._offsets, self._kinds, self._size, self.cut = _index(path, self._format)
            self._written_back = self._uncached = self._size
            if not _ends_a_turn(self._kinds):
                # An ended spool takes no more events: a restart reopens thousands of them.
                self._fd = _open_for_appends(path)
        except OSError as exc:
            what = f"{path}: cannot open the event spool"
            if not report:
                raise StorageError(f"{what} ({exc.strerror or exc})") from exc
            raise self._refused(what, exc) from exc

    def at_rest(self) -> SpoolAtRest | None:
        """An ended spool as plain values (its file, size and index): all it needs to be read
        again, nothing open. None while it is not ended, or holds events the disk refused."""
        if not self.finished or self._held:
            return None
        self._close_file()
        return str(self.path), self._size, self._offsets, self._kinds

    @classmethod
    def woken(cls, rest: SpoolAtRest) -> EventSpool:
        """The ended spool ``at_rest`` described, read from its file from now on."""
        path, size, offsets, kinds = rest
        spool = cls(Path(path), on_disk=False)
        spool._offsets, spool._kinds, spool._size = offsets, kinds, size
        spool._written_back = spool._uncached = size
        spool.finished = True
        return spool

    @property
    def last_seq(self) -> int:
        return len(self._offsets) + len(self._held)

    @property
    def held(self) -> int:
        """Events the disk refused, kept in memory until ``flush_held`` writes them."""
        return len(self._held)

    def append(self, kind: str, **fields: Any) -> None:
        """Record one event on disk, or raise ``StorageError`` having written nothing of it.

        Output (``raw=`` bytes) goes to disk as it is: nothing validates or encodes it.
        """
        record = self._record(kind, fields)
        if self._held:
            # Order is the contract: nothing goes to disk ahead of an event still held.
            raise self._refused(f"{self.path}: events before this one wait for the disk", None)
        self._write(record)
        self._committed(kind, record)

    def append_kept(self, kind: str, **fields: Any) -> bool:
        """Record one event of the target's own; if the disk refuses it, hold it in memory.

        True if it is on disk. Held events reach readers all the same, in order.
        """
        record = self._record(kind, fields)
        if not self._held:
            try:
                self._write(record)
            except StorageError:
                pass
            else:
                self._committed(kind, record)
                return True
        self._held.append((kind, record))
        self._kinds.append(KIND_CODES[kind])
        self._settle(kind)
        return False

    def flush_held(self) -> bool:
        """Write the held events, oldest first; True when none is left."""
        while self._held:
            kind, record = self._held[0]
            try:
                self._write(record)
            except StorageError:
                return False
            self._held.pop(0)
            self._offsets.append(self._size)
            self._size += len(record)
            self._keep(record)
            if kind in TERMINAL_KINDS:
                self._close_file()
        return True

    def _record(self, kind: str, fields: dict[str, Any]) -> bytes:
        if self.finished:
            raise RuntimeError(f"{self.path}: no event may follow a terminal one")
        seq = self.last_seq + 1
        raw = fields.get("raw")
        if kind in OUTPUT_KINDS and isinstance(raw, bytes) and len(fields) == 1:
            return self._format.output(kind, seq, time.time_ns() // 1000, raw)
        if "raw" in fields:
            fields = {k: v for k, v in fields.items() if k != "raw"} | _text_or_b64(fields["raw"])
        event = EVENTS.validate_python({"seq": seq, "at": now(), "kind": kind, **fields})
        return self._format.event(event)

    def _write(self, record: bytes) -> None:
        try:
            write_all(self._fd, record)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise self._refused(f"{self.path}: an event could not be written", exc) from exc

    def _refused(self, what: str, exc: OSError | None) -> StorageError:
        why = f" ({exc.strerror or exc})" if exc is not None else ""
        error = StorageError(f"{what}{why}")
        self._on_storage_error(error)
        return error

    def _committed(self, kind: str, record: bytes) -> None:
        self._offsets.append(self._size)
        self._kinds.append(KIND_CODES[kind])
        self._size += len(record)
        if self._size - self._written_back >= WRITEBACK_BYTES:
            self._write_back()
        self._keep(record)
        self._settle(kind)

    def _write_back(self) -> None:
        """Have the disk start writing out what was appended since it was last asked, and let
        the page cache go of what it was asked to write out the time before.

        Only started (the call returns at once): the turn's closing ``sync``
        still waits for all of it, but finds little left to write. Left to the
        end, 200 MiB of output took the closing sync 0.12 s, every bit of it
        between the turn's last byte and its exit.

        Output is read back from memory (the tail) by the followers keeping up,
        and from the disk by the rest: cached, a turn's output only grew the
        page cache, 200 MiB a turn. On a VM that hands its free memory back to
        its host (free page reporting; the machine measured did), each newly
        cached page costs a fault on the host: after the first gigabyte or so,
        200 MiB turns streamed at 120-137 MiB/s instead of 224-331. The kernel
        drops only pages already written out (dirty ones it skips), so nothing
        waits and nothing is lost.
        """
        start, self._written_back = self._written_back, self._size
        with contextlib.suppress(OSError, AttributeError):  # a head start: ``sync`` answers
            start_writeback(self._fd, start, self._size - start)
        self._uncache(self._uncached, start)

    def _uncache(self, start: int, end: int) -> None:
        """Let the page cache go of the spool's bytes from ``start`` to ``end`` (written out)."""
        if end > start:
            with contextlib.suppress(OSError):  # only memory: nothing depends on it
                os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)
        self._uncached = max(self._uncached, end)

    def _keep(self, record: bytes) -> None:
        """Keep the newest record in the tail; the oldest go past ``TAIL_BYTES`` (one stays)."""
        self._tail.append(record)
        self._tail_bytes += len(record)
        while self._tail_bytes > TAIL_BYTES and len(self._tail) > 1:
            self._tail_bytes -= len(self._tail.popleft())

    def _settle(self, kind: str) -> None:
        if kind in TERMINAL_KINDS:
            self.finished = True
            if not self._held:
                self._close_file()
        self._wake()
        if self.finished:
            # Ended: who reads it now reads the file, but for the last record, which the
            # followers waiting live for the end take from memory (no read of the file).
            while len(self._tail) > 1:
                self._tail_bytes -= len(self._tail.popleft())

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
        if self._size > CACHED_AFTER_SYNC:
            # All written out now: what ``_write_back`` found still being written goes too.
            self._uncache(0, self._written_back)
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
        """Up to ``READ_BATCH`` events after ``after`` as (seq, kind, Event JSON), for SSE.

        Held events come after the last one on disk, from memory.
        """
        records = await self._records_after(after, READ_BATCH, None)
        return [(seq, kind, self._format.json(record)) for seq, kind, record in records]

    async def frames_after(self, after: int) -> tuple[int, str, bytes]:
        """The frames after ``after`` (up to ``FRAMES_BATCH_BYTES`` of them), as one block.

        Returns (last seq in it, its kind, the bytes); (``after``, "", b"") if
        there is none yet. A frame spool's bytes are served as they lie on disk.
        """
        if isinstance(self._format, _Frames):
            records = await self._records_after(after, None, FRAMES_BATCH_BYTES)
        else:
            records = await self._records_after(after, READ_BATCH, FRAMES_BATCH_BYTES)
        if not records:
            return after, "", b""
        block = b"".join(self._format.frame(record) for _, _, record in records)
        seq, kind, _ = records[-1]
        return seq, kind, block

    async def _records_after(
        self, after: int, count: int | None, size: int | None
    ) -> list[tuple[int, str, bytes]]:
        first = max(after, 0)
        on_disk = len(self._offsets)
        if first >= on_disk:
            held = self._held[first - on_disk :][: count or READ_BATCH]
            return [(first + i + 1, kind, record) for i, (kind, record) in enumerate(held)]
        last = self._last_record(first, on_disk, count, size)
        kept = on_disk - len(self._tail)
        if first >= kept:
            # In the tail: from memory, no read of the file.
            records = [self._tail[i - kept] for i in range(first, last)]
            if count is None:
                return [(last, KINDS[self._kinds[last - 1]], b"".join(records))]
            return [
                (i + 1, KINDS[self._kinds[i]], r)
                for i, r in zip(range(first, last), records, strict=True)
            ]
        start = self._offsets[first]
        data = await asyncio.to_thread(_read_range, self.path, start, self._boundary(last))
        if count is None:
            # Frames served as they lie: one block, named by its last record's seq and kind.
            return [(last, KINDS[self._kinds[last - 1]], data)]
        found = []
        for i in range(first, last):
            begin, finish = self._offsets[i] - start, self._boundary(i + 1) - start
            found.append((i + 1, KINDS[self._kinds[i]], data[begin:finish]))
        return found

    def _last_record(self, first: int, on_disk: int, count: int | None, size: int | None) -> int:
        """One past the last record to read from ``first``: within ``count`` and ``size``."""
        last = on_disk if count is None else min(first + count, on_disk)
        if size is None:
            return last
        start = self._offsets[first]
        # The most records whose bytes fit the budget (at least one, whatever its size).
        low, high = first + 1, last
        while low < high:
            middle = (low + high + 1) // 2
            if self._boundary(middle) - start <= size:
                low = middle
            else:
                high = middle - 1
        return low

    def _boundary(self, index: int) -> int:
        """Where record ``index`` (0-based) starts on disk: the end of the one before."""
        return self._offsets[index] if index < len(self._offsets) else self._size

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


class _Format:
    """How events are records of a spool file, and how a record is served."""

    def output(self, kind: str, seq: int, at_us: int, data: bytes) -> bytes:
        raise NotImplementedError

    def event(self, event: Event) -> bytes:
        raise NotImplementedError

    def json(self, record: bytes) -> bytes:
        """The record as the ``Event`` JSON the event stream sends."""
        raise NotImplementedError

    def frame(self, record: bytes) -> bytes:
        raise NotImplementedError

    def scan(self, block: bytes, position: int, seq: int) -> tuple[int, str] | None:
        """(end, kind) of the whole record ``seq`` at ``position``; None if it is not whole
        there (more bytes may make it whole); ``ValueError`` if it cannot be that record."""
        raise NotImplementedError


class _Frames(_Format):
    def output(self, kind: str, seq: int, at_us: int, data: bytes) -> bytes:
        return frames.encode_header(kind, seq, at_us, len(data)) + data

    def event(self, event: Event) -> bytes:
        payload = event.model_dump_json(exclude_none=True).encode()
        at = frames.micros(event.at)
        return frames.encode_header(event.kind, event.seq, at, len(payload)) + payload

    def json(self, record: bytes) -> bytes:
        code, _, seq, at_us = frames.header_of(record)
        payload = record[frames.HEADER.size :]
        if code not in frames.OUTPUT_CODES:
            return payload
        kind = frames.KINDS[code]
        at = frames.moment(at_us).isoformat().replace("+00:00", "Z")
        event: dict[str, Any] = {"seq": seq, "at": at, "kind": kind, **_text_or_b64(payload)}
        return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()

    def frame(self, record: bytes) -> bytes:
        return record

    def scan(self, block: bytes, position: int, seq: int) -> tuple[int, str] | None:
        if len(block) - position < frames.HEADER.size:
            return None
        try:
            code, length, found, _ = frames.header_of(block, position)
        except frames.FrameError as exc:
            raise ValueError(str(exc)) from exc
        if code == frames.HEARTBEAT or found != seq:
            raise ValueError(f"not event {seq}")
        end = position + frames.HEADER.size + length
        if end > len(block):
            return None
        kind = frames.KINDS[code]
        if code not in frames.OUTPUT_CODES:
            event = EVENTS.validate_json(block[position + frames.HEADER.size : end])
            if (event.kind, event.seq) != (kind, seq):
                raise ValueError("its payload is another event")
        return end, kind


class _Lines(_Format):
    """Spools written before frames: one ``Event`` JSON line per record."""

    def output(self, kind: str, seq: int, at_us: int, data: bytes) -> bytes:
        fields = _text_or_b64(data)
        return self.event(EVENTS.validate_python({"seq": seq, "at": now(), "kind": kind, **fields}))

    def event(self, event: Event) -> bytes:
        return event.model_dump_json(exclude_none=True).encode() + b"\n"

    def json(self, record: bytes) -> bytes:
        return record.rstrip(b"\n")

    def frame(self, record: bytes) -> bytes:
        event = EVENTS.validate_json(record)
        at = frames.micros(event.at)
        if event.kind in OUTPUT_KINDS:
            data = event.data.encode() if event.data is not None else b""  # type: ignore[union-attr]
            if event.data_b64 is not None:  # type: ignore[union-attr]
                data = base64.b64decode(event.data_b64)  # type: ignore[union-attr]
            return frames.encode_header(event.kind, event.seq, at, len(data)) + data
        payload = record.rstrip(b"\n")
        return frames.encode_header(event.kind, event.seq, at, len(payload)) + payload

    def scan(self, block: bytes, position: int, seq: int) -> tuple[int, str] | None:
        cut = block.find(b"\n", position)
        if cut < 0:
            return None
        try:
            event = EVENTS.validate_json(block[position:cut])
        except ValidationError as exc:
            raise ValueError("not an event") from exc
        if event.seq != seq:
            raise ValueError(f"not event {seq}")
        return cut + 1, event.kind


def _text_or_b64(data: bytes) -> dict[str, str]:
    """Output as the event stream carries it: text if it is UTF-8, else base64."""
    try:
        return {"data": data.decode()}
    except UnicodeDecodeError:
        return {"data_b64": base64.b64encode(data).decode()}


def _ends_a_turn(kinds: bytearray) -> bool:
    return bool(kinds) and KINDS[kinds[-1]] in TERMINAL_KINDS


def _open_for_appends(path: Path) -> int:
    """The spool's file for appending, made if missing (and its directory, the first time)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return os.open(path, flags, 0o600)


def _index(path: Path, form: _Format) -> tuple[array[int], bytearray, int, Cut | None]:
    """Offset and kind of every whole event of an existing spool, its size, and what was cut.

    Read in blocks, so memory stays flat whatever the spool's size. The spool
    is cut at its first record that is not the next event: a record torn by a
    crash mid-write, or anything after one. The bytes cut are kept beside it
    (``NAME.torn-STAMP``): they were never delivered to anyone.
    """
    offsets = array("Q")
    kinds = bytearray()
    f = open_to_read(path)
    if f is None:
        return offsets, kinds, 0, None
    start = 0
    pending = b""
    torn = False
    with f:
        while not torn and (block := f.read(1 << 20)):
            pending += block
            position = 0
            while True:
                try:
                    found = form.scan(pending, position, len(offsets) + 1)
                except ValueError:
                    torn = True
                    break
                if found is None:
                    break
                end, kind = found
                offsets.append(start + position)
                kinds.append(KIND_CODES[kind])
                position = end
            start += position
            pending = pending[position:]
        size = os.fstat(f.fileno()).st_size
    if start == size:
        return offsets, kinds, start, None
    return offsets, kinds, start, cut_file(path, start, f"{path.name}.torn-{stamp()}")


def records_on_disk(path: Path) -> list[bytes]:
    """Every record of a spool file as it lies on disk; ``ValueError`` if the file does not
    end on a whole record. Reads only (no torn tail is cut): for tools and tests."""
    form: _Format = _Lines() if path.name.endswith(".jsonl") else _Frames()
    data = path.read_bytes()
    found: list[bytes] = []
    position = 0
    while position < len(data):
        scanned = form.scan(data, position, len(found) + 1)
        if scanned is None:
            raise ValueError(f"{path} ends inside a record, at byte {position}")
        found.append(data[position : scanned[0]])
        position = scanned[0]
    return found


def events_on_disk(path: Path) -> list[Event]:
    """``records_on_disk`` as events (output as the event stream carries it)."""
    form: _Format = _Lines() if path.name.endswith(".jsonl") else _Frames()
    return [EVENTS.validate_json(form.json(record)) for record in records_on_disk(path)]


def _read_range(path: Path, start: int, end: int) -> bytes:
    with open_existing(path) as f:
        f.seek(start)
        return f.read(end - start)
