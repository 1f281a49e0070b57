"""The ledger: every launch and every outcome, durable and tamper-evident.

An append-only file of JSON lines, each fsynced before the turn moves on, and
each carrying the sha256 of the line before it, so an edit anywhere breaks the
chain from that point. A separate head file holds the count and the last hash:
cutting records off the end no longer matches it. (Whoever can rewrite both can
forge both; ``ledger verify`` prints the head hash so it can be kept elsewhere.)

A ledger line is a turn's commit point: its launch (with what a retried
request needs to find it) and its end are durable once their line is, and the
turn's record and the head are rebuilt from the ledger after a crash of the
machine. So only the ledger is fsynced: appends waiting together are written
together, under one fsync (group commit); the head is overwritten in place
after every write (one ``pwrite`` of a fixed-size record into a file held open,
so no file is made or removed per record), without waiting for the disk, and
fsynced when the ledger closes. What
a record vouches for (a spool's output) is made durable first, on the same
thread (``append(before=...)``).

Why lines and not SQLite: one ``write`` + ``fsync`` per record, nothing to
corrupt but the last line, readable with ``grep`` and ``jq`` by an operator at
3 a.m., and the chain needs no schema. Env values and tokens never enter it;
env *names* do.

What a crash or a full disk can leave, and what becomes of it:

- an append cut short (a crash mid-write, a short write on a full disk): an
  append that fails is cut back before it returns, so only a crash leaves a
  torn last line. The target cuts it when it starts, keeps the bytes in
  ``ledger.torn-STAMP`` and appends a ``recovery`` record naming their size
  and sha256. The torn record was never acknowledged to anyone.
- a record the disk refused: held in memory, in order, and written (chained
  then) when the disk takes writes again; a crash before that loses it, and
  the target, restarting, records again whatever the turn records say.
- a head behind the chain (a crash of the machine before the head reached the
  disk): brought forward when the target starts, the records beyond it checked.
- a record that does not chain in the middle (an edit, two servers writing at
  once): the target refuses to start. ``ledger verify`` says which record and
  why; ``ledger repair`` (README, "Repairing the ledger") keeps the records
  that check out, moves the rest aside and records the cut in the chain.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import pydantic_core

from target_side.errors import LedgerError, StorageError
from target_side.safe_files import open_private, open_to_read, write_atomic
from target_side.service.tails import Cut, cut_file, stamp, write_all

log = logging.getLogger("paddock.target")

GENESIS = "0" * 64
LEDGER = "ledger.jsonl"
BACKWARD_BLOCK = 64 << 10
"""Bytes read at a time by ``records_newest_first``."""
HEAD = "ledger.head"
HEAD_SIZE = 128
"""Bytes of a head as written in place: its JSON, padded with spaces (the largest count fits)."""
HEAD_READS = 5
REPAIR_HINT = (
    "stop the target and run `paddock-target ledger repair --config FILE` "
    '(README, "Repairing the ledger"): it keeps the records that check out, moves the '
    "rest aside and records the cut in the chain"
)


@dataclass(frozen=True)
class Verified:
    """A ledger that checked out: how many records, and the hash of the last."""

    count: int
    head_hash: str
    note: str = ""
    torn_bytes: int = 0
    """Bytes after the last whole record (a crash mid-append); the target cuts them at start."""


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


class Ledger:
    """Appends chained records to ``STATE/ledger.jsonl``; one writer at a time.

    Opening it cuts a torn last line (see the module docstring) and refuses a
    chain that does not check out.
    """

    def __init__(self, state_root: Path) -> None:
        self.path = state_root / LEDGER
        self.head_path = state_root / HEAD
        self._head = _Head(self.head_path)
        state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        cut = cut_torn_tail(state_root)
        verified = verify(state_root, repair_head=True)
        self._count, self._last = verified.count, verified.head_hash
        self._held: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        """The chain's: held records, count, last hash, the file and the head."""
        self._queue_lock = threading.Lock()
        self._queued: list[_Append] = []
        if cut is not None:
            log.warning(
                "ledger: cut a torn last record of %d bytes (sha256 %s), kept in %s",
                cut.bytes,
                cut.sha256,
                cut.kept,
            )
            self.append_now("recovery", cut=cut.facts())

    @property
    def held(self) -> int:
        """Records the disk refused, waiting in memory to be written."""
        return len(self._held)

    async def append(
        self, kind: str, *, before: Callable[[], object] | None = None, **fields: Any
    ) -> bool:
        """Write one record durably (off the event loop) before returning True.

        False: the disk refused it; it is held, after any held before it, until
        ``flush`` gets it written. ``before`` runs first on the writing thread:
        what the record vouches for is made durable before the record is. A
        caller that goes away does not take its record with it: the thread
        writes it all the same.
        """
        return await asyncio.to_thread(self.append_here, kind, before=before, **fields)

    def append_here(
        self, kind: str, *, before: Callable[[], object] | None = None, **fields: Any
    ) -> bool:
        """``append`` on the calling thread (blocking), committed together with whatever
        other threads append meanwhile."""
        return self._commit_with_others(_Append(kind, fields, before))

    def append_now(self, kind: str, **fields: Any) -> bool:
        """``append``, on the calling thread (start-up and ``repair``)."""
        with self._lock:
            self._held.append((kind, fields))
            return self._write_held()

    async def flush(self) -> bool:
        """Write every held record; True when none is left."""
        return await asyncio.to_thread(self._commit_with_others, _Append("", {}, None))

    async def close(self) -> None:
        """Write what waits, and put the head on the disk: a clean stop leaves it current."""
        await self.flush()
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        """Put the head on the disk and let it go (the calling thread; ``repair``, ``close``)."""
        with self._lock:
            self._head.write(self._count, self._last)
            self._head.close()

    def _commit_with_others(self, entry: _Append) -> bool:
        """Group commit: whoever holds the chain writes every record queued by then, under
        one fsync; a thread that gets it next finds its own record written already."""
        with self._queue_lock:
            self._queued.append(entry)
        with self._lock:
            if entry.outcome is None:
                batch = self._take_queued()
                try:
                    written: bool | BaseException = self._commit(batch)
                except BaseException as exc:
                    written = exc
                for queued in batch:
                    queued.outcome = written
        if isinstance(entry.outcome, BaseException):
            raise entry.outcome
        return bool(entry.outcome)

    def _take_queued(self) -> list[_Append]:
        with self._queue_lock:
            batch, self._queued = self._queued, []
        return batch

    def _commit(self, batch: list[_Append]) -> bool:
        for entry in batch:
            if entry.before is not None:
                try:
                    entry.before()
                except Exception:
                    # Its own failure is its owner's to report; the record is still true.
                    log.exception("ledger: what a record vouches for could not be made durable")
            if entry.kind:
                self._held.append((entry.kind, entry.fields))
        return self._write_held()

    def _write_held(self) -> bool:
        """Every held record, chained, in one write and one fsync; or none of them."""
        if not self._held:
            return True
        count, last = self._count, self._last
        lines = []
        for kind, fields in self._held:
            count += 1
            record = {"seq": count, "prev": last, "kind": kind, **fields}
            line = json.dumps(record, separators=(",", ":"), default=str).encode()
            lines.append(line)
            last = _digest(line)
        try:
            self._append_lines(lines, count, last)
        except StorageError as exc:
            log.warning("ledger: %s; %d record(s) held until it can", exc, len(self._held))
            return False
        self._held.clear()
        self._count, self._last = count, last
        return True

    def _append_lines(self, lines: list[bytes], count: int, last: str) -> None:
        """Write the records and the head, or neither: a failure cuts the records back off."""
        fd = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            before = os.fstat(fd).st_size
            try:
                write_all(fd, b"".join(line + b"\n" for line in lines))
                os.fsync(fd)
                self._head.write(count, last)
            except OSError as exc:
                # A head that did reach the disk keeps the records: cutting them would leave
                # a head ahead of the chain.
                if _read_head_leniently(self.head_path) != (count, last):
                    _cut_back(fd, before)
                    raise StorageError(
                        f"{self.path}: record {count} could not be written ({exc.strerror or exc})"
                    ) from exc
        finally:
            os.close(fd)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every whole record, oldest first (a line being appended right now is not one yet)."""
        return read_records(self.path.parent)

    def records_newest_first(self) -> Iterator[dict[str, Any]]:
        """Every whole record, newest first, read from the end (``records_newest_first``)."""
        return records_newest_first(self.path.parent)

    def records_of(self, kind: str) -> Iterator[dict[str, Any]]:
        """Every whole record of ``kind``, oldest first; other lines are passed over unparsed."""
        # Inside a JSON string a quote is escaped, so only a record's own kind has this text.
        marker = f'"kind":{json.dumps(kind)}'.encode()
        for _, line in _whole_lines(self.path):
            if marker in line:
                record = parse_record(line)
                if record.get("kind") == kind:
                    yield record

    def latest_turns(self, turn_ids: set[str]) -> dict[str, Latest]:
        """For each of ``turn_ids`` in the ledger: its last record's kind and turn, its key.

        Read from the end, and only until each turn's first record: its launch,
        or the only record of one never launched (a refusal). A restart reads
        back as far as its oldest kept turn, not through the target's whole life.
        """
        found: dict[str, Latest] = {}
        unfinished = set(turn_ids)
        for record in self.records_newest_first():
            turn = record.get("turn")
            if not isinstance(turn, dict) or turn.get("turn_id") not in unfinished:
                continue
            turn_id = turn["turn_id"]
            later = found.get(turn_id)
            key = record.get("idempotency")
            if later is None:
                found[turn_id] = Latest(str(record.get("kind")), turn, key)
            elif later.idempotency is None and key is not None:
                found[turn_id] = replace(later, idempotency=key)  # the launch keeps it
            if record.get("kind") == "launch" or turn.get("started_at") is None:
                unfinished.discard(turn_id)
                if not unfinished:
                    break
        return found


@dataclass(frozen=True)
class Latest:
    """What the ledger last said of a turn."""

    kind: str
    """``launch`` or ``end`` (or ``recovery``)."""
    turn: dict[str, Any]
    idempotency: str | None = None
    """The digest of the key its request came with (the launch record keeps it)."""


@dataclass
class _Append:
    """A record queued for the next commit (``kind`` empty: only a flush), and how it went."""

    kind: str
    fields: dict[str, Any]
    before: Callable[[], object] | None
    outcome: bool | BaseException | None = None
    """Set by the thread that committed it: written, held, or what the commit raised."""


def parse_record(line: bytes) -> Any:
    """One ledger line as Python values, as ``json.loads`` gives them.

    pydantic's parser takes 6 us where ``json`` takes 15 for a turn's record, and a restart
    reads one or two records per kept turn. It refuses what ``json`` reads (a lone surrogate
    escape, which ``json.dumps`` writes for a name decoded with ``surrogateescape``): such
    a line is read the old way.
    """
    try:
        return pydantic_core.from_json(line)
    except ValueError:
        return json.loads(line)


def read_records(state_root: Path) -> Iterator[dict[str, Any]]:
    """Every whole record of the ledger in ``state_root``, oldest first, read without opening
    it for writing: a reader beside a running server never sees a line half-appended."""
    for _, line in _whole_lines(state_root / LEDGER):
        yield parse_record(line)


def records_newest_first(state_root: Path) -> Iterator[dict[str, Any]]:
    """Every whole record of the ledger in ``state_root``, newest first, read from the end in
    blocks: a reader that wants the latest few reads only the end of a ledger that keeps
    growing for as long as the target lives."""
    for line in _whole_lines_newest_first(state_root / LEDGER):
        yield parse_record(line)


def _whole_lines_newest_first(path: Path) -> Iterator[bytes]:
    f = _open_ledger(path)
    if f is None:
        return
    with f:
        position = _whole_end(f)
        carry = b""
        while position > 0:
            step = min(BACKWARD_BLOCK, position)
            position -= step
            f.seek(position)
            lines = (f.read(step) + carry).split(b"\n")
            carry = lines[0]  # it may begin in the block before
            for line in reversed(lines[1:]):
                if line:
                    yield line
        if carry:
            yield carry


def _open_ledger(path: Path) -> BinaryIO | None:
    """The ledger opened to be read (None if there is none), never through a link."""
    try:
        return open_to_read(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LedgerError(
                f"{path} is a symbolic link, not the ledger the target writes there; nothing "
                "it points to was read. Put the ledger itself in its place"
            ) from exc
        raise


def _whole_end(f: BinaryIO) -> int:
    """Just past the file's last newline: what follows is a record being appended (or torn)."""
    return _line_start_before(f, f.seek(0, os.SEEK_END))


def _line_start_before(f: BinaryIO, before: int) -> int:
    """Just past the last newline in ``f`` before offset ``before`` (0 if none): where the
    line that ``before`` ends or falls in begins."""
    position = before
    while position > 0:
        step = min(BACKWARD_BLOCK, position)
        position -= step
        f.seek(position)
        newline = f.read(step).rfind(b"\n")
        if newline >= 0:
            return position + newline + 1
    return 0


def _cut_back(fd: int, size: int) -> None:
    """Cut a half-written append back off, so no torn line stays behind (needs no free space)."""
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as exc:
        log.error("could not cut a failed append back to %d bytes: %s", size, exc)


def cut_torn_tail(state_root: Path) -> Cut | None:
    """Cut a torn last record off the ledger, keeping its bytes beside it; None if none.

    Torn: bytes after the last newline, and a last line that is not JSON (a
    crash can leave a block of zeros). Only the end is ever cut; damage before
    the last line is for ``verify`` to report.
    """
    path = state_root / LEDGER
    start = _torn_start(path)
    if start is None:
        return None
    return cut_file(path, start, f"{LEDGER}.torn-{stamp()}")


def _torn_start(path: Path) -> int | None:
    """Where a torn tail of ``path`` begins, or None if it ends with a whole JSON line.

    Read from the end: only the last whole line and what follows it, however
    long the ledger has grown.
    """
    f = _open_ledger(path)
    if f is None:
        return None
    with f:
        size = f.seek(0, os.SEEK_END)
        end = _whole_end(f)
        start = _line_start_before(f, end - 1) if end else 0
        f.seek(start)
        last_line = f.read(max(end - 1 - start, 0))
    # A crash can leave a block of zeros as the last "line", and a partial one after it.
    if last_line and not _is_json(last_line):
        return start
    return end if end < size else None


def _is_json(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def verify(state_root: Path, *, repair_head: bool = False) -> Verified:
    """Check the chain and the head; ``LedgerError`` names the first problem and the repair.

    A torn tail is reported (``torn_bytes``), not refused: the target cuts it
    when it starts. A head behind the chain is what a crash of the machine
    leaves (the head is written without waiting for the disk); with
    ``repair_head`` (the target starting up) it is brought forward.
    """
    path, head_path = state_root / LEDGER, state_root / HEAD
    # The head first: beside a running target the chain read after it can only be longer.
    head_count, head_hash = _read_head(head_path)
    torn = _torn_start(path)
    chain = _walk_chain(path, torn)
    if chain.problem is not None:
        raise LedgerError(f"{path}: {chain.problem}; {_trusted(chain.kept)}. {REPAIR_HINT}")
    count, last = chain.count, chain.last
    torn_bytes = 0 if torn is None else path.stat().st_size - torn
    if (count, last) == (head_count, head_hash):
        return Verified(count, last, torn_bytes=torn_bytes)
    behind = count - head_count
    if behind > 0 and repair_head:
        _write_head(head_path, count, last)
        note = f"head was {behind} record(s) behind (a crash before it reached the disk); repaired"
        return Verified(count, last, note, torn_bytes)
    if behind > 0:
        note = (
            f"head is {behind} record(s) behind (a crash before it reached the disk, or a "
            "target running); a starting target brings it forward"
        )
        return Verified(count, last, note, torn_bytes)
    if behind == 0:
        raise LedgerError(
            f"{path}: its last record is not the one its head names (record {count} was "
            f"edited or replaced). {REPAIR_HINT}"
        )
    raise LedgerError(
        f"{path}: holds {count} records but its head says {head_count}: records were removed. "
        f"{REPAIR_HINT}"
    )


@dataclass
class _Chain:
    """How far a ledger chains, and what a repair may keep of it."""

    count: int = 0
    last: str = GENESIS
    problem: str | None = None
    kept: int = 0
    """Records vouched for: each one's hash is in the next record (the last one's, in the head)."""
    kept_last: str = GENESIS
    cut_at: int | None = None


def _walk_chain(path: Path, torn: int | None) -> _Chain:
    """Follow the chain to its first problem (or to ``torn``, where a torn tail begins)."""
    chain = _Chain()
    last_offset, before_last = 0, GENESIS
    for offset, line in _whole_lines(path):
        if torn is not None and offset >= torn:
            break
        problem = _chain_problem(line, chain.count + 1, chain.last)
        if problem is not None:
            chain.problem = f"record {chain.count + 1} {problem}"
            if chain.count == 0 or _prev_of(line) == chain.last:
                # This record vouches for the one before it: the damage is its own.
                chain.kept, chain.kept_last, chain.cut_at = chain.count, chain.last, offset
            else:
                # Nothing vouches for the record before it any more: that one goes too.
                chain.kept, chain.kept_last = chain.count - 1, before_last
                chain.cut_at = last_offset
            return chain
        last_offset, before_last = offset, chain.last
        chain.count, chain.last = chain.count + 1, _digest(line)
    chain.kept, chain.kept_last = chain.count, chain.last
    return chain


def _trusted(kept: int) -> str:
    if kept == 0:
        return "no record before it can be trusted"
    return "record 1 checks out" if kept == 1 else f"records 1..{kept} check out"


def _prev_of(line: bytes) -> object:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("prev") if isinstance(record, dict) else None


def _chain_problem(line: bytes, seq: int, prev: str) -> str | None:
    """Why ``line`` is not record ``seq`` following a record hashing to ``prev``; None if it is."""
    if line.startswith(_chain_prefix(seq, prev)):
        # Exactly what ``_write_held`` writes first: seq and prev are right without parsing the
        # rest (parsing was two thirds of a start's verification). A line edited past its
        # prefix no longer hashes to the next record's prev, so it is caught there.
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return "is not valid JSON (edited, or a torn write was appended to)"
    if not isinstance(record, dict):
        return "is not a JSON object"
    if record.get("seq") != seq:
        return (
            f"does not chain to record {seq - 1}: it is numbered {record.get('seq')!r} "
            "(records removed or reordered, or two servers appending to one state root)"
        )
    if record.get("prev") != prev:
        return (
            f"does not chain to record {seq - 1}: its prev hash is not record {seq - 1}'s "
            f"(record {seq - 1} was edited, or another server appended in between)"
        )
    return None


def _chain_prefix(seq: int, prev: str) -> bytes:
    return f'{{"seq":{seq},"prev":"{prev}",'.encode()


def _whole_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of every newline-terminated line of ``path``."""
    f = _open_ledger(path)
    if f is None:
        return
    offset = 0
    with f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            yield offset, raw[:-1]
            offset += len(raw)


def _read_head(path: Path) -> tuple[int, str]:
    if not path.exists():
        return 0, GENESIS
    try:
        head = json.loads(_settled_bytes(path))
        return int(head["count"]), str(head["hash"])
    except (ValueError, KeyError, TypeError) as exc:
        raise LedgerError(
            f"{path} is unreadable; the ledger cannot be checked against it. {REPAIR_HINT}"
        ) from exc


def _write_head(path: Path, count: int, last: str) -> None:
    """Replace the head whole, durably (start-up and repair, with no ledger writing)."""
    write_atomic(path, _head_bytes(count, last))


def _head_bytes(count: int, last: str) -> bytes:
    text = json.dumps({"count": count, "hash": last}).encode()
    return text.ljust(HEAD_SIZE - 1) + b"\n"


class _Head:
    """The head as a running ledger keeps it: held open, overwritten in place.

    Replacing it through a new file and a rename cost a file made and one
    removed per record (on ext4, an inode search that grows with every inode
    freed recently: about a millisecond a record under load). One ``pwrite`` of
    ``HEAD_SIZE`` bytes at offset 0 lies inside one page and one disk sector:
    the page cache takes it whole, and a crash leaves the old head or the new
    one. A reader beside a running target reads until two reads agree
    (``_read_head``), since a read is not ordered against a write.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def write(self, count: int, last: str) -> None:
        if self._fd < 0:
            self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
            if os.fstat(self._fd).st_size > HEAD_SIZE:
                os.ftruncate(self._fd, HEAD_SIZE)
        data = _head_bytes(count, last)
        if os.pwrite(self._fd, data, 0) != len(data):
            raise OSError(errno.EIO, "short write of the ledger's head")

    def close(self) -> None:
        """fsync and close (a clean stop leaves the head on the disk)."""
        if self._fd < 0:
            return
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class Repaired:
    """What ``repair`` did: the records kept, and what was moved aside."""

    kept: int
    cut: Cut | None
    reason: str


def repair(state_root: Path) -> Repaired:
    """Keep the records that check out, move the rest aside, and record the cut in the chain.

    The caller holds the state root's lock (no server is running). The moved
    records stay, byte for byte, in ``ledger.cut-STAMP``; the ``recovery``
    record appended names their size and sha256 and why they were cut, and the
    head is rewritten to the records kept.
    """
    path, head_path = state_root / LEDGER, state_root / HEAD
    torn = _torn_start(path)
    chain = _walk_chain(path, torn)
    count, last, bad_at = chain.kept, chain.kept_last, chain.cut_at
    reason = chain.problem or "a torn last record"
    if chain.problem is None:
        bad_at = torn
    cut = None
    if bad_at is not None:
        cut = cut_file(path, bad_at, f"{LEDGER}.cut-{stamp()}")
    head_count, head_hash = _read_head_leniently(head_path)
    if cut is None and (head_count, head_hash) == (count, last):
        return Repaired(count, None, "nothing to repair: the chain and its head check out")
    if cut is None:
        reason = f"the head said {head_count} records, the ledger holds {count}"
    _write_head(head_path, count, last)
    facts: dict[str, Any] = {"reason": reason, "head_was": {"count": head_count, "hash": head_hash}}
    if cut is not None:
        facts["cut"] = cut.facts()
    ledger = Ledger(state_root)
    try:
        if not ledger.append_now("recovery", repair=facts):
            raise LedgerError(
                f"{path}: the repair record could not be written; free space and rerun"
            )
    finally:
        ledger.close_now()
    return Repaired(count, cut, reason)


def _settled_bytes(path: Path) -> bytes:
    """The file's bytes once two reads in a row agree: a running target writes it in place."""
    seen = path.read_bytes()
    for _ in range(HEAD_READS):
        again = path.read_bytes()
        if again == seen:
            break
        seen = again
    return seen


def _read_head_leniently(path: Path) -> tuple[int, str]:
    try:
        return _read_head(path)
    except LedgerError:
        return -1, "unreadable"
