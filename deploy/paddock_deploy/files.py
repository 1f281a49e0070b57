"""Files and links written the safe way (docs/design.md, "Private files"), and put back."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from paddock_deploy.errors import DeployError


@dataclass(frozen=True)
class Snapshot:
    """A file as it was before this run touched it (None: it did not exist)."""

    data: bytes
    mode: int
    uid: int
    gid: int


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, mode: int, uid: int = 0, gid: int = 0) -> None:
    """Replace ``path`` atomically with owner and mode right from birth.

    A private temp file in the same directory, fsynced, its identity checked
    again, then renamed over ``path``: a reader sees the old file or the new.
    """
    temp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o600)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)  # after fchown, which may clear mode bits
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        written, named = os.fstat(fd), os.lstat(temp)
        if (written.st_dev, written.st_ino) != (named.st_dev, named.st_ino):
            raise DeployError(f"{temp} was replaced while being written; not installing it")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def snapshot(path: Path) -> Snapshot | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        return Snapshot(f.read(), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


def restore(path: Path, before: Snapshot | None) -> None:
    """Put ``path`` back as ``snapshot`` found it (remove it if it did not exist)."""
    if before is None:
        path.unlink(missing_ok=True)
    else:
        write_file(path, before.data, before.mode, before.uid, before.gid)


def point_link(link: Path, target: str | None) -> None:
    """Make ``link`` a symlink to ``target`` atomically (a new link renamed over it); None
    removes it."""
    if target is None:
        link.unlink(missing_ok=True)
        fsync_dir(link.parent)
        return
    temp = link.parent / f".{link.name}-{secrets.token_hex(6)}"
    os.symlink(target, temp)
    try:
        os.replace(temp, link)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)


def link_target(link: Path) -> str | None:
    """What the symlink ``link`` says (None: no such symlink)."""
    try:
        return os.readlink(link)
    except OSError:
        return None


def trusted_dir_problem(directory: Path) -> str | None:
    """Why root should not trust ``directory`` (someone else could swap what is inside), or None."""
    st = directory.lstat()
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symlink; give the real path"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != 0:
        return (
            f"{directory} belongs to uid {st.st_uid}; it must belong to root "
            f"(chown root {directory})"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{directory} is writable by group or others (chmod go-w {directory})"
    return None


def existing_ancestors(path: Path) -> Iterator[Path]:
    for parent in reversed(path.parents):
        if parent.exists():
            yield parent
