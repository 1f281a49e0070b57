"""The ledger: every launch and every outcome, durable and tamper-evident.

An append-only file of JSON lines, each fsynced before the turn moves on, and
each carrying the sha256 of the line before it, so an edit anywhere breaks the
chain from that point. A separate head file holds the count and the last hash:
cutting records off the end no longer matches it. (Whoever can rewrite both can
forge both; ``ledger verify`` prints the head hash so it can be kept elsewhere.)

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
- a record that does not chain in the middle (an edit, two servers writing at
  once): the target refuses to start. ``ledger verify`` says which record and
  why; ``ledger repair`` (README, "Repairing the ledger") keeps the records
  that check out, moves the rest aside and records the cut in the chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from target_side.errors import LedgerError, StorageError
from target_side.safe_files import write_atomic
from target_side.service.tails import Cut, cut_file, stamp, write_all

log = logging.getLogger("paddock.target")

GENESIS = "0" * 64
LEDGER = "ledger.jsonl"
HEAD = "ledger.head"
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
        state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        cut = cut_torn_tail(state_root)
        verified = verify(state_root, repair_head=True)
        self._count, self._last = verified.count, verified.head_hash
        self._lock = asyncio.Lock()
        self._held: list[tuple[str, dict[str, Any]]] = []
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

    async def append(self, kind: str, **fields: Any) -> bool:
        """Write one record durably (off the event loop) before returning True.

        False: the disk refused it; it is held, after any held before it, until
        ``flush`` gets it written.
        """
        async with self._lock:
            return await asyncio.to_thread(self.append_now, kind, **fields)

    def append_now(self, kind: str, **fields: Any) -> bool:
        """``append``, on the calling thread (start-up and ``repair``)."""
        self._held.append((kind, fields))
        return self._write_held()

    async def flush(self) -> bool:
        """Write every held record; True when none is left."""
        async with self._lock:
            return await asyncio.to_thread(self._write_held)

    def _write_held(self) -> bool:
        while self._held:
            kind, fields = self._held[0]
            try:
                self._append_now(kind, fields)
            except StorageError as exc:
                log.warning("ledger: %s; %d record(s) held until it can", exc, len(self._held))
                return False
            self._held.pop(0)
        return True

    def _append_now(self, kind: str, fields: dict[str, Any]) -> None:
        """Write one record and the head, or neither: a failure cuts the record back off."""
        seq = self._count + 1
        record = {"seq": seq, "prev": self._last, "kind": kind, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str).encode()
        fd = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            before = os.fstat(fd).st_size
            try:
                write_all(fd, line + b"\n")
                os.fsync(fd)
                _write_head(self.head_path, seq, _digest(line))
            except OSError as exc:
                # A head that did reach the disk (only its directory's fsync failed) keeps
                # the record: cutting it would leave a head ahead of the chain.
                if _read_head_leniently(self.head_path) != (seq, _digest(line)):
                    _cut_back(fd, before)
                    raise StorageError(
                        f"{self.path}: record {seq} could not be written ({exc.strerror or exc})"
                    ) from exc
        finally:
            os.close(fd)
        self._count, self._last = seq, _digest(line)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every whole record, oldest first (a line being appended right now is not one yet)."""
        for _, line in _whole_lines(self.path):
            yield json.loads(line)

    def records_of(self, kind: str) -> Iterator[dict[str, Any]]:
        """Every whole record of ``kind``, oldest first; other lines are passed over unparsed."""
        # Inside a JSON string a quote is escaped, so only a record's own kind has this text.
        marker = f'"kind":{json.dumps(kind)}'.encode()
        for _, line in _whole_lines(self.path):
            if marker in line:
                record = json.loads(line)
                if record.get("kind") == kind:
                    yield record

    def latest_turns(self, turn_ids: set[str]) -> dict[str, tuple[str, dict[str, Any]]]:
        """For each of ``turn_ids`` in the ledger: the kind of its last record, and its turn."""
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        for record in self.records():
            turn = record.get("turn")
            if isinstance(turn, dict) and turn.get("turn_id") in turn_ids:
                found[turn["turn_id"]] = (str(record.get("kind")), turn)
        return found


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
    """Where a torn tail of ``path`` begins, or None if it ends with a whole JSON line."""
    if not path.exists():
        return None
    last_start, last_line, end = 0, b"", 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                # A partial last line; the line before it may be torn as well.
                return last_start if last_line and not _is_json(last_line) else end
            last_start, last_line, end = end, raw[:-1], end + len(raw)
    if last_line and not _is_json(last_line):
        return last_start
    return None


def _is_json(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def verify(state_root: Path, *, repair_head: bool = False) -> Verified:
    """Check the chain and the head; ``LedgerError`` names the first problem and the repair.

    A torn tail is reported (``torn_bytes``), not refused: the target cuts it
    when it starts. A head one record behind is what a crash between the two
    writes leaves; with ``repair_head`` (the target starting up) it is brought
    forward.
    """
    path, head_path = state_root / LEDGER, state_root / HEAD
    torn = _torn_start(path)
    chain = _walk_chain(path, torn)
    if chain.problem is not None:
        raise LedgerError(f"{path}: {chain.problem}; {_trusted(chain.kept)}. {REPAIR_HINT}")
    count, last = chain.count, chain.last
    torn_bytes = 0 if torn is None else path.stat().st_size - torn
    head_count, head_hash = _read_head(head_path)
    if (count, last) == (head_count, head_hash):
        return Verified(count, last, torn_bytes=torn_bytes)
    if count == head_count + 1 and repair_head:
        _write_head(head_path, count, last)
        note = "head was one record behind (crash between writes); repaired"
        return Verified(count, last, note, torn_bytes)
    if count == head_count + 1:
        return Verified(count, last, "head is one record behind (crash between writes)", torn_bytes)
    how = "removed" if count < head_count else "added without the head"
    raise LedgerError(
        f"{path}: holds {count} records but its head says {head_count}: records were {how}. "
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


def _whole_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of every newline-terminated line of ``path``."""
    if not path.exists():
        return
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            yield offset, raw[:-1]
            offset += len(raw)


def _read_head(path: Path) -> tuple[int, str]:
    if not path.exists():
        return 0, GENESIS
    try:
        head = json.loads(path.read_bytes())
        return int(head["count"]), str(head["hash"])
    except (ValueError, KeyError, TypeError) as exc:
        raise LedgerError(
            f"{path} is unreadable; the ledger cannot be checked against it. {REPAIR_HINT}"
        ) from exc


def _write_head(path: Path, count: int, last: str) -> None:
    write_atomic(path, json.dumps({"count": count, "hash": last}).encode())


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
    if not ledger.append_now("recovery", repair=facts):
        raise LedgerError(f"{path}: the repair record could not be written; free space and rerun")
    return Repaired(count, cut, reason)


def _read_head_leniently(path: Path) -> tuple[int, str]:
    try:
        return _read_head(path)
    except LedgerError:
        return -1, "unreadable"
