"""Each turn's delivery cursor: the last event this user was given, so the next process goes on.

    $XDG_STATE_HOME/paddock/            (else ~/.local/state/paddock)    0700
      cursors/TARGET/TURN               {"turn_id", "seq", "target", "delivered_at"}   0600

TARGET is ``name.NAME`` for a stored target (``-t NAME``), else ``url.`` and a
digest of the URL (and SSH destination). A cursor holds no output, only a
sequence number.

*Delivered* means written to our stdout or stderr and flushed (or, in Python,
handed to the caller's callback and returned from): ``Cursor.delivered`` is
called only after that, so an event is never recorded before it was seen.
Writing the file on every event would cost a fsync per line of a fast stream,
so a writer thread persists the newest delivered seq at most every
``interval_s``, and at once when the cursor closes. A process killed with
SIGKILL therefore loses at most ``interval_s`` of *recorded* progress: the next
process may show those last events again, and never skips one.

Cursors older than ``MAX_AGE_S``, and beyond ``MAX_PER_TARGET`` per target, are
pruned when a cursor is opened for writing, at most once per ``PRUNE_EVERY_S``
(``cursors/.pruned`` says when): the sweep reads every cursor of every target,
which a turn that takes milliseconds should not pay for each time.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent_side.errors import UsageError
from agent_side.sha256 import sha256_hex
from agent_side.user_files import private_dir, read_text, state_dir, write_private
from agent_side.views import say

INTERVAL_S = 0.2
"""At most this long between a delivery and its record on disk, while the process lives."""
MAX_AGE_S = 30 * 24 * 3600.0
MAX_PER_TARGET = 1000
PRUNE_EVERY_S = 3600.0
PRUNED_MARK = ".pruned"
_TURN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def target_key(url: str, *, name: str | None = None, ssh: str | None = None) -> str:
    """The directory name for one target's cursors: its stored name, else a digest of its route."""
    if name is not None:
        return f"name.{name}"
    route = f"{ssh or ''} {url}".encode()
    return f"url.{sha256_hex(route)[:20]}"


@dataclass(frozen=True)
class CursorStore:
    """The cursors of one target, under ``root/cursors/KEY``."""

    root: Path
    key: str
    url: str
    """The target's URL, written into each cursor so a person can tell which one it is."""

    @classmethod
    def for_user(
        cls,
        environ: Mapping[str, str],
        url: str,
        *,
        name: str | None = None,
        ssh: str | None = None,
    ) -> CursorStore:
        """This user's cursors of the target at ``url`` (``name``: stored as ``-t NAME``)."""
        return cls(state_dir(environ), target_key(url, name=name, ssh=ssh), url)

    @property
    def directory(self) -> Path:
        return self.root / "cursors" / self.key

    def path(self, turn_id: str) -> Path:
        if not _TURN_ID.fullmatch(turn_id):
            raise UsageError(f"{turn_id!r} is not a turn id")
        return self.directory / turn_id

    def last_delivered(self, turn_id: str) -> int:
        """The seq of the last event delivered, or 0 when none was (or the file is unusable)."""
        path = self.path(turn_id)
        try:
            text = read_text(path)
        except (OSError, UnicodeDecodeError) as exc:
            say(f"cannot read the cursor {path} ({exc}); showing the turn from its first event")
            return 0
        if text is None:
            return 0
        try:
            record = json.loads(text)
            seq = record["seq"]
            if record.get("turn_id") != turn_id or not isinstance(seq, int) or seq < 0:
                raise ValueError("it names another turn, or no sequence number")
        except (ValueError, KeyError, TypeError) as exc:
            # Starting over shows events twice; trusting a broken file could skip some.
            say(f"the cursor {path} is not usable ({exc}); showing the turn from its first event")
            return 0
        return seq

    def open(self, turn_id: str, start: int = 0) -> Cursor:
        """A cursor for ``turn_id`` whose events up to ``start`` were delivered already."""
        path = self.path(turn_id)
        private_dir(private_dir(private_dir(self.root) / "cursors") / self.key)
        prune_when_due(self.root / "cursors", keep=path)
        return Cursor(path, turn_id, self.url, start)


class Cursor:
    """Records delivered events of one turn; the newest is on disk within ``interval_s``."""

    def __init__(
        self, path: Path, turn_id: str, url: str, start: int = 0, interval_s: float = INTERVAL_S
    ) -> None:
        self._path = path
        self._turn_id = turn_id
        self._url = url
        self._interval_s = interval_s
        self._delivered = start
        self._written = start
        self._closed = False
        self._changed = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="paddock-cursor")
        self._writer.start()
        self.writes = 0
        """How many times the file was written (for the cost of a fast stream)."""

    @property
    def seq(self) -> int:
        """The last event delivered so far (whether or not it is on disk yet)."""
        return self._delivered

    def delivered(self, seq: int) -> None:
        """Event ``seq`` has reached the user; call only after the write that showed it."""
        with self._changed:
            if seq > self._delivered:
                self._delivered = seq
                self._changed.notify_all()  # the writer, and whoever waits in ``wait_for``

    def wait_for(self, seq: int, timeout: float) -> bool:
        """Until event ``seq`` is delivered (at most ``timeout`` seconds); whether it was."""
        with self._changed:
            return self._changed.wait_for(lambda: self._delivered >= seq, timeout)

    def close(self) -> None:
        """Write what is pending, now, and stop the writer."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._writer.join()
        self._persist()

    def __enter__(self) -> Cursor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._delivered != self._written)
                if self._closed:
                    return
            self._persist()
            with self._changed:
                # The batching: one write per interval at most (close does not wait for it).
                self._changed.wait_for(lambda: self._closed, timeout=self._interval_s)

    def _persist(self) -> None:
        seq = self._delivered
        if seq == self._written:
            return
        record = {
            "turn_id": self._turn_id,
            "seq": seq,
            "target": self._url,
            "delivered_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        try:
            write_private(self._path, json.dumps(record) + "\n")
        except OSError as exc:
            # Losing the record costs a repeat on the next attach, not the output: go on.
            say(f"cannot record the cursor {self._path}: {exc.strerror or exc}")
            return
        self._written = seq
        self.writes += 1


def prune_when_due(cursors: Path, keep: Path) -> None:
    """``prune`` if the last sweep is ``PRUNE_EVERY_S`` old (or was never made)."""
    mark = cursors / PRUNED_MARK
    with contextlib.suppress(OSError):
        if time.time() - mark.stat().st_mtime < PRUNE_EVERY_S:
            return
    with contextlib.suppress(OSError):
        # Marked first: processes opening cursors meanwhile skip the sweep this one makes.
        mark.touch(mode=0o600)
    prune(cursors, keep)


def prune(cursors: Path, keep: Path, now: float | None = None) -> None:
    """Remove cursors older than ``MAX_AGE_S`` or beyond ``MAX_PER_TARGET``, never ``keep``."""
    moment = time.time() if now is None else now
    with contextlib.suppress(OSError):
        for directory in cursors.iterdir():
            if directory.is_symlink() or not directory.is_dir() or directory == keep.parent:
                continue
            _prune_one(directory, moment)
            with contextlib.suppress(OSError):
                directory.rmdir()  # only when empty
        _prune_one(keep.parent, moment, keep)


def _prune_one(directory: Path, moment: float, keep: Path | None = None) -> None:
    with contextlib.suppress(OSError):
        files = sorted(_files(directory), key=lambda p: p[1], reverse=True)
        for rank, (path, mtime) in enumerate(files):
            if path != keep and (rank >= MAX_PER_TARGET or moment - mtime > MAX_AGE_S):
                with contextlib.suppress(OSError):
                    path.unlink()


def _files(directory: Path) -> Iterator[tuple[Path, float]]:
    with os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    yield Path(entry.path), entry.stat(follow_symlinks=False).st_mtime
