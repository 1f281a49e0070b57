"""Sessions on disk: ``STATE/sessions/SESSION.json``, each replaced atomically on every change.

A restarted target reads them back: a session that was open is marked
``lost`` (its processes died with the server that ran them), and a finished
one is kept until its retention time, like a turn.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.wire import Session, is_session_id
from target_side.safe_files import read_whole, write_atomic
from target_side.service.tails import stamp

log = logging.getLogger("paddock.target")
SUFFIX = ".json"


class StoredSession(BaseModel):
    """What the target keeps about a session beyond the wire ``Session``."""

    model_config = ConfigDict(extra="forbid")

    session: Session
    idempotency: str | None = None
    """sha256 of role and Idempotency-Key, so a retried POST finds its session after a restart."""


class SessionStore:
    """The ``sessions`` directory of a state root."""

    def __init__(self, state_root: Path) -> None:
        self.root = state_root / "sessions"

    def path(self, session_id: str) -> Path:
        return self.root / f"{session_id}{SUFFIX}"

    def save(self, stored: StoredSession) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(self.path(stored.session.session_id), stored.model_dump_json().encode())

    def load_all(self) -> Iterator[StoredSession]:
        """Every session on disk; one whose record does not parse is kept aside, and skipped."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            if path.suffix != SUFFIX or not is_session_id(path.stem):
                continue
            try:
                yield StoredSession.model_validate_json(read_whole(path))
            except (OSError, ValidationError) as exc:
                kept = path.with_name(f"{path.name}.torn-{stamp()}")
                with contextlib.suppress(OSError):
                    path.rename(kept)
                log.warning("session record %s unreadable (%s); kept aside as %s", path, exc, kept)

    def remove(self, session_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(session_id).unlink()
