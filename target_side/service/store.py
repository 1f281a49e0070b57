"""Turns on disk: one file per turn, its event spool.

``STATE/turns/TURN.frames`` is the turn's spool. A restarted target reads the
spools back, so a turn outlives the process that ran it, as output at least.
What the turn was (its state, exit status, usage, the key of the request
that made it) is in the ledger, the turn's commit point: its ``launch`` line
and its ``end`` line. No other file is written per turn: a record of the
ended turn would say nothing the end line does not, and would cost a new
file on every turn.

Not a directory per turn either: a directory is one more inode to allocate
on every turn, and on ext4 without a journal the kernel looks over the
inodes freed in the last seconds each time it allocates one. Measured over
300 sequential ``true`` turns on such a disk, making the spool took 1.9 ms of
CPU with a directory and 1.2 ms without.

Targets of earlier versions kept each turn in a directory of its own:
``STATE/turns/TURN/events.frames``, or ``events.jsonl`` (spooled before
frames), with ``record.json`` beside it (replaced through a temporary file
and a rename). Such turns are still read where they are, and a record
believed as far as the ledger agrees; a temporary file a crash left is
removed, and a record that does not parse is kept aside
(``record.json.torn-STAMP``) for the target to rebuild the turn from the
ledger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Collection, Iterator
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.wire import Turn, is_turn_id
from target_side.safe_files import read_whole
from target_side.service.spool import FRAMES, LINES
from target_side.service.tails import stamp

log = logging.getLogger("paddock.target")
RECORD = "record.json"
SPOOL_SUFFIX = ".frames"
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

    def new_spool_path(self, turn_id: str) -> Path:
        """The spool of a turn being made now (nothing on disk to look at)."""
        return self.root / f"{turn_id}{SPOOL_SUFFIX}"

    def spool_path(self, found: Found) -> Path:
        """The spool of a turn ``load_all`` found: its file, or where an earlier version kept
        it. Found as its file, it is taken from there with nothing looked at (a restart
        asks this of every kept turn)."""
        turn_id = turn_id_of(found)
        spool = self.new_spool_path(turn_id)
        if isinstance(found, Unrecorded) and not found.in_own_directory:
            return spool
        if spool.exists():
            return spool
        for name in (LINES, FRAMES):
            legacy = self._legacy_dir(turn_id) / name
            if legacy.exists():
                return legacy
        return spool

    def load_all(self) -> Iterator[Found]:
        """Every turn on disk: just its id (the ledger holds the rest), or the record an
        earlier version wrote, or what became of such a record that does not parse."""
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            turn_id = entry.name.removesuffix(SPOOL_SUFFIX)
            if not is_turn_id(turn_id):
                continue  # a torn tail kept aside, or something that is no turn's
            if turn_id != entry.name:
                yield Unrecorded(turn_id=turn_id)
            elif entry.is_dir():
                yield _earlier(entry)

    def move_to_lost_and_found(self, turn_id: str) -> Path:
        """Take a turn nothing can be rebuilt for out of the way, whole (its spool and any
        tail cut off it), into a directory of its own, for an operator to see."""
        place = self.root.parent / LOST_AND_FOUND
        place.mkdir(mode=0o700, exist_ok=True)
        moved = place / f"{turn_id}.{stamp()}"
        legacy = self._legacy_dir(turn_id)
        if legacy.is_dir():
            legacy.rename(moved)
            return moved
        moved.mkdir(mode=0o700)
        for path in self._paths_of({turn_id}):
            path.rename(moved / path.name)
        return moved

    def remove(self, turn_ids: Collection[str]) -> None:
        """Remove these turns from disk: their spools, the tails cut off them, and an earlier
        version's directories. The server's own files: no turn ever wrote into them."""
        for path in self._paths_of(set(turn_ids)):
            with contextlib.suppress(FileNotFoundError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    def _paths_of(self, turn_ids: set[str]) -> list[Path]:
        """Every name in ``turns/`` that belongs to one of ``turn_ids``: ``TURN.frames``, its
        torn tails (``TURN.frames.torn-STAMP``), an earlier version's ``TURN/``. One listing
        for them all: a retention sweep removes thousands of turns from a directory of
        thousands, and a listing per turn would make it quadratic."""
        if not turn_ids:
            return []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as entries:
            return [Path(e.path) for e in entries if e.name.partition(".")[0] in turn_ids]
        return []

    def _legacy_dir(self, turn_id: str) -> Path:
        return self.root / turn_id


class Unrecorded(BaseModel):
    """A turn with only its spool on disk, as every turn now is: the ledger says the rest."""

    turn_id: str
    in_own_directory: bool = False
    """Kept as an earlier version kept it (``turns/TURN/``); else ``turns/TURN.frames``."""


class Unreadable(BaseModel):
    """A turn whose record (an earlier version's) did not parse; kept aside under ``kept``."""

    turn_id: str
    kept: str | None
    reason: str


Found = StoredTurn | Unreadable | Unrecorded
"""A turn ``TurnStore.load_all`` found on disk."""


def turn_id_of(found: Found) -> str:
    """The id of a turn ``load_all`` found, whichever form it was found in."""
    return found.turn.turn_id if isinstance(found, StoredTurn) else found.turn_id


def _earlier(directory: Path) -> Found:
    """A turn an earlier version kept in a directory of its own, with or without its record."""
    _remove_unfinished_writes(directory)
    path = directory / RECORD
    try:
        return StoredTurn.model_validate_json(read_whole(path))
    except FileNotFoundError:
        return Unrecorded(turn_id=directory.name, in_own_directory=True)
    except (OSError, ValidationError) as exc:
        return _set_aside(directory.name, path, exc)


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
