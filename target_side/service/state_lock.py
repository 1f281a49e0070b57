"""One server per state root: an exclusive lock on ``STATE/lock``, held for the server's life.

Two servers on one state root would both recover the same turns and both
append to the ledger, forking its chain. The lock is an ``flock`` on a file
inside the state root, taken before anything there is read or repaired; the
kernel drops it when the holder exits, however it exits (SIGKILL included), so
a stale lock cannot outlive its server. The file's content says who holds it,
for the message the next server prints; the lock itself, not the content, is
what counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from target_side.errors import StateRootBusy

LOCK = "lock"


class StateLock:
    """The held lock of one state root; ``release`` (or process exit) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, state_root: Path, listen: str = "") -> StateLock:
        """Take the lock, or raise ``StateRootBusy`` naming the server that holds it."""
        state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_root / LOCK
        # O_CLOEXEC: a turn (or bwrap) inheriting the descriptor would keep the lock alive.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateRootBusy(
                f"state root {state_root} is in use by another paddock-target ({holder}); "
                "stop that server first (if it is stopping, start this one again once it has "
                "exited), or give this one another [server] state_root"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        _describe_holder(fd, listen)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def _describe_holder(fd: int, listen: str) -> None:
    """Write who holds the lock; a full disk only costs the next server a vaguer message."""
    facts = {"pid": os.getpid(), "started_at": datetime.now(UTC).isoformat(), "listen": listen}
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(facts).encode() + b"\n", 0)
        os.fsync(fd)


def _holder(fd: int) -> str:
    try:
        facts = json.loads(os.pread(fd, 4096, 0))
        said = f"pid {int(facts['pid'])}, started {facts['started_at']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a server that has not yet said who it is"
    return f"{said}, listening on {facts['listen']}" if facts.get("listen") else said
