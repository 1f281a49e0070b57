"""Turns on disk: one directory per turn, holding its record and its event spool.

``STATE/turns/TURN/record.json`` is the ended turn and ``events.frames`` its
spool (``events.jsonl`` for a turn spooled before frames). A restarted target
reads them back, so a turn outlives the process that ran it, as output at least.
The ledger is the turn's commit point: a running turn has no record (its
``launch`` line holds all one would say), an ended turn's record is written after
its ``end`` line, without waiting for the disk, and a restarted target believes
the ledger over a record that missed the turn's end.

A record is replaced through a temporary file and a rename, so a crash leaves
the old record or the new one; what it can leave besides is the temporary file
(removed at start: it is an unfinished write), or, after a crash of the
machine itself, a record that does not parse. That one is kept aside
(``record.json.torn-STAMP``) for the target to rebuild the turn from the ledger.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.wire import Turn, is_turn_id
from target_side.safe_files import write_atomic
from target_side.service.spool import FRAMES, LINES
from target_side.service.tails import stamp

log = logging.getLogger("paddock.target")
RECORD = "record.json"
LOST_AND_FOUND = "lost+found"


class StoredTurn(BaseModel):
    """What the target keeps about a turn beyond the wire ``Turn``."""

    model_config = ConfigDict(extra="forbid")

    turn: Turn
    idempotency: str | None = None
    """sha256 of role and Idempotency-Key, so a retried POST finds its turn after a restart."""


class TurnStore:
    """The ``turns`` directory of a state root."""

    def __init__(self, state_root: Path) -> None:
        self.root = state_root / "turns"

    def dir(self, turn_id: str) -> Path:
        return self.root / turn_id

    def new_spool_path(self, turn_id: str) -> Path:
        """The spool of a turn being made now (frames; nothing on disk to look at)."""
        return self.dir(turn_id) / FRAMES

    def spool_path(self, turn_id: str) -> Path:
        """The turn's spool: frames, unless it was spooled as JSON lines before them."""
        legacy = self.dir(turn_id) / LINES
        return legacy if legacy.exists() else self.dir(turn_id) / FRAMES

    def save(self, stored: StoredTurn) -> None:
        directory = self.dir(stored.turn.turn_id)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(directory / RECORD, stored.model_dump_json().encode(), durable=False)

    def load_all(self) -> Iterator[StoredTurn | Unreadable]:
        """Every turn on disk: its record, or what became of a record that does not parse."""
        if not self.root.is_dir():
            return
        for directory in sorted(self.root.iterdir()):
            if not is_turn_id(directory.name):
                continue
            _remove_unfinished_writes(directory)
            path = directory / RECORD
            try:
                yield StoredTurn.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as exc:
                yield _set_aside(directory.name, path, exc)

    def move_to_lost_and_found(self, turn_id: str) -> Path:
        """Take a turn nothing can be rebuilt for out of the way, whole, for an operator to see."""
        place = self.root.parent / LOST_AND_FOUND
        place.mkdir(mode=0o700, exist_ok=True)
        moved = place / f"{turn_id}.{stamp()}"
        self.dir(turn_id).rename(moved)
        return moved

    def remove(self, turn_id: str) -> None:
        # The server's own directory: no turn ever wrote into it.
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.dir(turn_id))


class Unreadable(BaseModel):
    """A turn whose record did not parse; the record is kept aside under ``kept``."""

    turn_id: str
    kept: str | None
    reason: str


def _set_aside(turn_id: str, path: Path, exc: Exception) -> Unreadable:
    if isinstance(exc, FileNotFoundError):
        # The usual case after a crash: the turn was running (or never launched).
        log.info("turn %s: no record (it had not ended); rebuilt from the ledger if there", turn_id)
        return Unreadable(turn_id=turn_id, kept=None, reason="no record: the turn had not ended")
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    kept = None
    kept_path = path.with_name(f"{RECORD}.torn-{stamp()}")
    with contextlib.suppress(OSError):  # absent (never written), or the rename failed: kept = None
        path.rename(kept_path)
        kept = kept_path.name
    log.warning("turn %s: record unreadable (%s); kept aside as %s", turn_id, reason, kept)
    return Unreadable(turn_id=turn_id, kept=kept, reason=reason)


def _remove_unfinished_writes(directory: Path) -> None:
    """Remove temporary files of a record replacement a crash cut short (never acknowledged)."""
    for entry in directory.glob(f".{RECORD}.*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()


def expired(turn: Turn, now: datetime, retention_s: float) -> bool:
    """Whether a finished turn has been kept for its whole retention time."""
    return turn.ended_at is not None and (now - turn.ended_at).total_seconds() > retention_s
