"""Turns on disk: one directory per turn, holding its record and its event spool.

``STATE/turns/TURN/record.json`` is the turn as last known (replaced
atomically on every change) and ``events.jsonl`` its spool. A restarted target
reads them back, so a turn outlives the process that ran it, as output at least.
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

log = logging.getLogger("paddock.target")
RECORD = "record.json"
EVENTS = "events.jsonl"


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

    def spool_path(self, turn_id: str) -> Path:
        return self.dir(turn_id) / EVENTS

    def save(self, stored: StoredTurn) -> None:
        directory = self.dir(stored.turn.turn_id)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(directory / RECORD, stored.model_dump_json().encode())

    def load_all(self) -> Iterator[StoredTurn]:
        """Every readable turn record; an unreadable one is logged and left for retention."""
        if not self.root.is_dir():
            return
        for directory in sorted(self.root.iterdir()):
            if not is_turn_id(directory.name):
                continue
            try:
                yield StoredTurn.model_validate_json((directory / RECORD).read_bytes())
            except (OSError, ValidationError) as exc:
                log.warning("turn %s: record unreadable (%s); skipped", directory.name, exc)

    def remove(self, turn_id: str) -> None:
        # The server's own directory: no turn ever wrote into it.
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.dir(turn_id))


def expired(turn: Turn, now: datetime, retention_s: float) -> bool:
    """Whether a finished turn has been kept for its whole retention time."""
    return turn.ended_at is not None and (now - turn.ended_at).total_seconds() > retention_s
