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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from target_side.errors import LedgerError
from target_side.safe_files import write_atomic

GENESIS = "0" * 64
LEDGER = "ledger.jsonl"
HEAD = "ledger.head"


@dataclass(frozen=True)
class Verified:
    """A ledger that checked out: how many records, and the hash of the last."""

    count: int
    head_hash: str
    note: str = ""


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


class Ledger:
    """Appends chained records to ``STATE/ledger.jsonl``; one writer at a time."""

    def __init__(self, state_root: Path) -> None:
        self.path = state_root / LEDGER
        self.head_path = state_root / HEAD
        state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        verified = verify(state_root, repair_head=True)
        self._count, self._last = verified.count, verified.head_hash
        self._lock = asyncio.Lock()

    async def append(self, kind: str, **fields: Any) -> None:
        """Write one record durably (off the event loop) before returning."""
        async with self._lock:
            await asyncio.to_thread(self._append_now, kind, fields)

    def _append_now(self, kind: str, fields: dict[str, Any]) -> None:
        record = {"seq": self._count + 1, "prev": self._last, "kind": kind, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str).encode()
        fd = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.write(fd, line + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        self._count, self._last = self._count + 1, _digest(line)
        _write_head(self.head_path, self._count, self._last)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first."""
        yield from (json.loads(line) for line in _lines(self.path))


def verify(state_root: Path, *, repair_head: bool = False) -> Verified:
    """Check the chain and the head; ``LedgerError`` names the first problem.

    A head one record behind is what a crash between the two writes leaves;
    with ``repair_head`` (the target starting up) it is brought forward.
    """
    path, head_path = state_root / LEDGER, state_root / HEAD
    count, last = 0, GENESIS
    for line in _lines(path):
        record = _parse(line, count + 1)
        if record.get("seq") != count + 1 or record.get("prev") != last:
            raise LedgerError(
                f"{path}: record {count + 1} does not chain to record {count} (edited or reordered)"
            )
        count, last = count + 1, _digest(line)
    head_count, head_hash = _read_head(head_path)
    if (count, last) == (head_count, head_hash):
        return Verified(count, last)
    if count == head_count + 1 and repair_head:
        _write_head(head_path, count, last)
        return Verified(count, last, "head was one record behind (crash between writes); repaired")
    if count == head_count + 1:
        return Verified(count, last, "head is one record behind (crash between writes)")
    raise LedgerError(
        f"{path}: holds {count} records but its head says {head_count}: records were "
        f"{'removed' if count < head_count else 'added without the head'}"
    )


def _parse(line: bytes, seq: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise LedgerError(f"record {seq} is not valid JSON (edited or torn)") from exc
    if not isinstance(record, dict):
        raise LedgerError(f"record {seq} is not a JSON object")
    return record


def _lines(path: Path) -> Iterator[bytes]:
    if not path.exists():
        return
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                raise LedgerError(f"{path}: the last record is torn (no newline)")
            yield raw[:-1]


def _read_head(path: Path) -> tuple[int, str]:
    if not path.exists():
        return 0, GENESIS
    try:
        head = json.loads(path.read_bytes())
        return int(head["count"]), str(head["hash"])
    except (ValueError, KeyError, TypeError) as exc:
        raise LedgerError(f"{path} is unreadable; the ledger cannot be checked against it") from exc


def _write_head(path: Path, count: int, last: str) -> None:
    write_atomic(path, json.dumps({"count": count, "hash": last}).encode())
