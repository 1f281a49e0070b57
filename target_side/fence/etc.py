"""The fence's ``/etc``: one curated copy in the state root, mounted as one directory.

Binding thirty host files one by one cost a third of a fence's start, and a
routine ``useradd`` or package upgrade renaming ``/etc/passwd`` over itself
between the check and the mount refused turns as ``path-changed``. Instead the
target copies the curated entries (``policy.mounts.ETC_ENTRIES``) into
``STATE/etc/VERSION``, where ``VERSION`` is a digest of what was copied, and
every turn mounts that directory read-only at ``/etc``. A change to any source
makes a new version (built aside, renamed into place); turns already running
keep the one they mounted, and older versions are removed once replaced.

``passwd`` and ``group`` are the host's, plus one entry per role (its name,
uid, gid and home), so ``whoami`` and ``ls -l`` inside a fence name the role.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HOST_ETC = Path("/etc")
RECHECK_S = 2.0
"""How stale the copy may be: sources are looked at again at most this often."""
KEEP = 2
"""Versions kept besides the current one (a turn planning right now may still name one)."""


@dataclass(frozen=True)
class RoleEntry:
    """What ``passwd`` and ``group`` say of a role."""

    name: str
    uid: int
    gid: int
    home: str


class CuratedEtc:
    """The current version of the fence's ``/etc`` under ``root`` (``STATE/etc``)."""

    def __init__(self, root: Path, entries: Sequence[str], roles: Sequence[RoleEntry]) -> None:
        self.root = root
        self.entries = tuple(entries)
        self.roles = tuple(roles)
        self._lock = threading.Lock()
        self._current: Path | None = None
        self._checked = 0.0

    def current(self, now: float | None = None) -> Path:
        """The version to mount now, made first if the sources changed (thread-safe).

        One caller at a time looks at the sources (some 700 entries, tens of
        milliseconds when many turns plan at once); meanwhile the others take
        the version there is rather than queue behind it.
        """
        moment = time.monotonic() if now is None else now
        known = self._current
        if known is not None and moment - self._checked < RECHECK_S:
            return known
        if known is None:
            self._lock.acquire()
        elif not self._lock.acquire(blocking=False):
            return known
        try:
            if self._current is not None and moment - self._checked < RECHECK_S:
                return self._current
            version = self._digest()
            path = self.root / version
            if not path.is_dir():
                self._build(path)
            if self._current != path:
                self._current = path
                self._prune(keep=path)
            self._checked = moment
            return path
        finally:
            self._lock.release()

    def _sources(self) -> Iterator[tuple[str, os.stat_result]]:
        """Every host path copied, with its status, in a stable order.

        Looked at every ``RECHECK_S`` while turns run (some 700 entries): plain
        strings and ``scandir``, a fifth of what paths and ``os.walk`` cost.
        """
        for name in self.entries:
            try:
                st = os.lstat(f"{HOST_ETC}/{name}")
            except FileNotFoundError:
                continue
            yield name, st
            if stat.S_ISDIR(st.st_mode):
                yield from _tree(name)

    def _digest(self) -> str:
        digest = hashlib.sha256()
        for name, st in self._sources():
            digest.update(f"{name}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        for role in self.roles:
            digest.update(f"{role}\0".encode())
        return digest.hexdigest()[:24]

    def _build(self, final: Path) -> None:
        self.root.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.root, 0o755)  # noqa: S103 - read by every role's uid: a copy of /etc
        staging = self.root / f".new-{os.urandom(6).hex()}"
        staging.mkdir(mode=0o755)
        try:
            for name in self.entries:
                _copy(HOST_ETC / name, staging / name)
            _write(staging / "passwd", _passwd(HOST_ETC / "passwd", self.roles))
            _write(staging / "group", _group(HOST_ETC / "group", self.roles))
            os.chmod(staging, 0o755)  # noqa: S103 - as above
            os.rename(staging, final)
        except FileExistsError:
            shutil.rmtree(staging, ignore_errors=True)  # another thread built the same version
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not final.is_dir():
                raise

    def _prune(self, keep: Path) -> None:
        versions = sorted(
            (p for p in self.root.iterdir() if p != keep and not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
        )
        for old in versions[:-KEEP] if KEEP else versions:
            shutil.rmtree(old, ignore_errors=True)


def _tree(relative: str) -> Iterator[tuple[str, os.stat_result]]:
    """What lies below ``HOST_ETC/relative``, links not followed: a directory's entries in
    name order, then each of its directories' in turn."""
    try:
        with os.scandir(f"{HOST_ETC}/{relative}") as listing:
            entries = sorted(listing, key=lambda e: e.name)
    except OSError:
        return  # gone, or not for the server to read (/etc/ssl/private): as os.walk passes it
    below = []
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            st = entry.stat(follow_symlinks=False)
            yield f"{relative}/{entry.name}", st
            if stat.S_ISDIR(st.st_mode):
                below.append(f"{relative}/{entry.name}")
    for directory in below:
        yield from _tree(directory)


def _copy(source: Path, dest: Path) -> None:
    """Copy what anyone on the host may read: files, symlinks (as symlinks), directories.

    The copy is made as root and read by every role, so it must never widen what
    a role could read on the host: an entry others cannot read (``/etc/ssl/private``)
    is left out, as the fence's view of the host's would have refused it.
    """
    try:
        st = source.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), dest)
    elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o005 == 0o005:
        dest.mkdir(mode=0o755)
        os.chmod(dest, 0o755)  # noqa: S103 - a copy of what everyone may read
        for child in sorted(source.iterdir()):
            _copy(child, dest / child.name)
    elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:
        shutil.copyfile(source, dest, follow_symlinks=False)
        os.chmod(dest, 0o644)


def _write(path: Path, text: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.write_text(text)
    os.chmod(path, 0o644)


def _passwd(host: Path, roles: Sequence[RoleEntry]) -> str:
    lines = _lines(host)
    taken = {line.split(":")[2] for line in lines if line.count(":") >= 6}
    lines += [
        f"{r.name}:x:{r.uid}:{r.gid}:paddock role {r.name}:{r.home}:/bin/sh"
        for r in roles
        if str(r.uid) not in taken
    ]
    return "".join(f"{line}\n" for line in lines)


def _group(host: Path, roles: Sequence[RoleEntry]) -> str:
    lines = _lines(host)
    taken = {line.split(":")[2] for line in lines if line.count(":") >= 3}
    lines += [f"{r.name}:x:{r.gid}:" for r in roles if str(r.gid) not in taken]
    return "".join(f"{line}\n" for line in lines)


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []
