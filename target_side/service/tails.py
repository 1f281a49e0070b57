"""Torn tails: bytes a crash or a full disk left at the end of an append-only file.

Found by the file's owner (the ledger, a spool), kept beside the file and cut
off it here, so the file ends with a whole record again and nothing is lost
that anyone could want: the bytes are kept, their size and sha256 recorded.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from target_side.safe_files import fsync_dir, open_existing

log = logging.getLogger("paddock.target")


@dataclass(frozen=True)
class Cut:
    """Bytes cut off the end of a file, and where they were kept."""

    file: str
    """The name of the file cut (in its own directory)."""
    bytes: int
    sha256: str
    kept: str | None
    """The file beside it that holds the bytes; None if the disk could not take them."""

    def facts(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "sha256": self.sha256, "kept": self.kept}


def stamp() -> str:
    """A UTC time stamp for names of files kept aside."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` (``os.write`` may write fewer) or raise ``OSError``."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "the write made no progress")
        view = view[written:]


def cut_file(path: Path, start: int, kept_name: str) -> Cut:
    """Move the bytes of ``path`` from ``start`` into ``kept_name`` beside it, then cut them off.

    Kept first, cut second: a crash in between leaves both, never neither. If
    the disk cannot take the copy, the bytes are cut anyway (they are a torn
    write nobody was told about) and their sha256 still names them.
    """
    kept: Path | None = path.with_name(kept_name)
    try:
        digest = _copy_from(path, start, path.with_name(kept_name))
    except OSError as exc:
        log.error("could not keep the cut bytes of %s (%s); cutting them anyway", path, exc)
        kept, digest = None, _digest_from(path, start)
    size = path.stat().st_size - start
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, start)
        os.fsync(fd)
    finally:
        os.close(fd)
    return Cut(path.name, size, digest, None if kept is None else kept.name)


def _digest_from(path: Path, start: int) -> str:
    digest = hashlib.sha256()
    with open_existing(path) as f:
        f.seek(start)
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _copy_from(path: Path, start: int, kept: Path) -> str:
    """Copy ``path`` from ``start`` into a new file ``kept`` (fsynced); the copy's sha256."""
    digest = hashlib.sha256()
    fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open_existing(path) as f:
            f.seek(start)
            while block := f.read(1 << 20):
                digest.update(block)
                write_all(fd, block)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        kept.unlink(missing_ok=True)
        raise
    os.close(fd)
    fsync_dir(kept.parent)
    return digest.hexdigest()
