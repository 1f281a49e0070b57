"""The target's private files, read and written without trusting the path (docs/design.md).

Reads open with ``O_NOFOLLOW`` and judge the file by ``fstat`` of what was
opened, not by a ``stat`` of the name. Writes go to a private temporary file in
the same directory (``0600`` from birth, fsynced), whose identity is checked
again just before ``os.replace`` puts it in place: a reader sees the old file
or the new one, never a half-written one. Ancestors are checked so that no one
but root and the service user could have swapped a directory on the way. The
state root's own files are read without following a link, and judged no further
(``open_to_read``).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from target_side.errors import UnsafeFileError


def open_to_read(path: Path) -> BinaryIO | None:
    """``path`` opened for reading, never through a link (``OSError`` ELOOP if it is one);
    None if there is no such file.

    For the state root's files, which the server alone writes (the ledger, the spools, the
    sessions): a link in one's place is nothing the server made, and what it points to is
    never read. Nothing else about the file is judged (``read_private`` judges more).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    return os.fdopen(fd, "rb")


def read_whole(path: Path) -> bytes:
    """Every byte of ``path``, read as ``open_to_read`` opens it (``FileNotFoundError`` if
    there is no such file)."""
    with open_existing(path) as f:
        return f.read()


def open_existing(path: Path) -> BinaryIO:
    """``open_to_read``, where a missing file is an error (``FileNotFoundError``)."""
    f = open_to_read(path)
    if f is None:
        raise FileNotFoundError(errno.ENOENT, "No such file", str(path))
    return f


def check_ancestors(path: Path) -> None:
    """Refuse if a directory above ``path`` is others-writable (not sticky) or foreign-owned."""
    trusted = {0, os.getuid()}
    for directory in path.parents:
        st = os.stat(directory)
        if st.st_uid not in trusted:
            raise UnsafeFileError(
                f"{directory} (above {path}) is owned by uid {st.st_uid}; "
                f"it must belong to root or uid {os.getuid()} (chown it)"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeFileError(
                f"{directory} (above {path}) is writable by group or others; "
                f"run: chmod go-w {directory}"
            )


def read_private(path: Path, *, allow_group_read: bool = False) -> bytes:
    """The bytes of ``path``, refused if it is a symlink, not regular, foreign-owned or too open."""
    fd = open_private(path, os.O_RDONLY, allow_group_read=allow_group_read)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_private(path: Path, flags: int, *, allow_group_read: bool = False) -> int:
    """A descriptor for ``path`` opened with ``flags`` (``O_CREAT`` makes it ``0600``), judged
    as ``read_private`` judges: by ``fstat`` of what was opened, never through a symlink."""
    check_ancestors(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise UnsafeFileError(
                f"{path} is a symlink; point the config at the real file"
            ) from exc
        raise UnsafeFileError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        _check_opened(path, os.fstat(fd), allow_group_read)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_opened(path: Path, st: os.stat_result, allow_group_read: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} is not a regular file")
    if st.st_uid not in {0, os.getuid()}:
        raise UnsafeFileError(f"{path} is owned by uid {st.st_uid}; chown it to uid {os.getuid()}")
    too_open = 0o037 if allow_group_read else 0o077
    if st.st_mode & too_open:
        limit = "0640" if allow_group_read else "0600"
        raise UnsafeFileError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; run: chmod {limit} {path}"
        )


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: private temp, fchmod 0600, fsync, identity check, rename,
    and the directory synced: after a crash of the machine, the old file or the new one."""
    check_ancestors(path)
    directory = path.parent
    temp = directory / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask could only narrow 0600, but say it outright
        _write_all(fd, data)
        os.fsync(fd)
        written = os.fstat(fd)
        named = os.lstat(temp)
        if (named.st_dev, named.st_ino) != (written.st_dev, written.st_ino):
            raise UnsafeFileError(f"{temp} was replaced while being written; not installing it")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    fsync_dir(directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
