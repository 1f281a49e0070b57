"""Turns on disk: one directory per turn, holding its event spool.

``STATE/turns/TURN/events.frames`` is the turn's spool (``events.jsonl`` for
a turn spooled before frames). A restarted target reads the spools back, so a
turn outlives the process that ran it, as output at least. What the turn was
(its state, exit status, usage, the key of the request that made it) is in
the ledger, the turn's commit point: its ``launch`` line and its ``end`` line.
No other file is written per turn: a record of the ended turn would say
nothing the end line does not, and would cost a new file on every turn.

Targets of earlier versions wrote ``record.json`` beside the spool (replaced
through a temporary file and a rename). Such records are still read, and
believed as far as the ledger agrees; a temporary file a crash left is
removed, and a record that does not parse is kept aside
(``record.json.torn-STAMP``) for the target to rebuild the turn from the
ledger.
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

    def load_all(self) -> Iterator[StoredTurn | Unreadable | Unrecorded]:
        """Every turn on disk: just its id (the ledger holds the rest), or the record an
        earlier version wrote, or what became of such a record that does not parse."""
        if not self.root.is_dir():
            return
        for directory in sorted(self.root.iterdir()):
            if not is_turn_id(directory.name):
                continue
            _remove_unfinished_writes(directory)
            path = directory / RECORD
            try:
                yield StoredTurn.model_validate_json(path.read_bytes())
            except FileNotFoundError:
                yield Unrecorded(turn_id=directory.name)
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


class Unrecorded(BaseModel):
    """A turn with only its spool on disk, as every turn now is: the ledger says the rest."""

    turn_id: str


class Unreadable(BaseModel):
    """A turn whose record (an earlier version's) did not parse; kept aside under ``kept``."""

    turn_id: str
    kept: str | None
    reason: str


def _set_aside(turn_id: str, path: Path, exc: Exception) -> Unreadable:
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
