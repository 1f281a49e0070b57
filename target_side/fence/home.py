"""A role's home: made, checked and repaired by descriptor, never by following a name.

``STATE/roles/ROLE`` belongs to the server and no fence ever sees it; inside it,
``home`` belongs to the role's own uid and is the one directory of the state
root a fence mounts (writable). bubblewrap, running as that uid, reaches the
home by its path, so the directories above it may be searched by anyone
(0711) but listed by no one: everything else in the state root is private
(0700 directories, 0600 files). Turns can change anything inside their home
but not the home itself, since its parent is not theirs. Whatever is found
where the home should be, every step here opens relative to its parent's
descriptor with ``O_NOFOLLOW``: a symlink is never followed, it is moved aside.

Standard library and the error tree only: where the server is not root, the
privileged launcher runs this for it, as root, with ``server`` naming the ids
the server's own directories belong to. Root then makes the home, sets its
mode while it still owns it, and only then gives it away, so no step needs
``CAP_FOWNER``; a home the role itself left with a wrong mode is repaired by
``fix_mode``, which the launcher runs as the role.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from target_side.errors import HomeError

log = logging.getLogger("paddock.target")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
LOOK_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Opened only to be looked at: needs no read permission, so the server may look at a home
that is its role's alone (0700)."""
HOME = "home"
SEARCHABLE = 0o711
"""The server's directories above a home: searched by anyone, listed by no one."""
HOME_MODE = 0o700
"""A home: its role's alone."""
OTHERS_SEARCH = 0o011
"""What the state root must let group and others do: search it, on the way to a home."""


def open_state_root(state_root: Path) -> None:
    """Make the state root (if missing) and let others search it, never list or write it."""
    state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(state_root, DIR_FLAGS)
    try:
        _at_least_searchable(fd)
    finally:
        os.close(fd)


def _at_least_searchable(fd: int) -> None:
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not _searchable(mode):
        os.fchmod(fd, (mode | OTHERS_SEARCH) & ~0o066)


def _searchable(mode: int) -> bool:
    return mode & OTHERS_SEARCH == OTHERS_SEARCH


FixMode = Callable[[int, int], None]
"""``fix_mode(fd, mode)``: set the mode of the role's own home, open at ``fd``."""


def prepare_home(
    state_root: Path,
    role: str,
    uid: int,
    gid: int,
    *,
    server: tuple[int, int] | None = None,
    fix_mode: FixMode = os.fchmod,
) -> str | None:
    """Make ``STATE/roles/ROLE/home`` a directory of ``uid:gid``, mode 0700.

    ``server`` is the uid and gid the state root's own directories belong to
    (default: this process's). Returns a sentence when something had to be
    repaired (for the turn's notice and the log), else None. Raises
    ``HomeError`` if it cannot be made.
    """
    owner = server if server is not None else (os.getuid(), os.getgid())
    # Most turns find it as it should be, which takes no lock to see: turns starting together
    # queued for it, each holding it through a dozen system calls.
    if looks_ready(state_root, role, uid, gid, owner):
        return None
    with _LOCKS.setdefault((str(state_root), role), threading.Lock()):
        return _prepare(state_root, role, uid, gid, owner, fix_mode)


_LOCKS: dict[tuple[str, str], threading.Lock] = {}
"""One at a time per role: turns starting together must not each make (or move) its home."""


def _prepare(
    state_root: Path, role: str, uid: int, gid: int, owner: tuple[int, int], fix_mode: FixMode
) -> str | None:
    try:
        state = os.open(state_root, DIR_FLAGS)
    except OSError as exc:
        raise HomeError(f"cannot open the state root {state_root}: {exc.strerror}") from exc
    try:
        if os.fstat(state).st_uid != owner[0]:
            raise HomeError(f"{state_root} is not owned by the server's uid {owner[0]}")
        _at_least_searchable(state)
        with _server_dir(state, "roles", owner) as roles, _server_dir(roles, role, owner) as mine:
            return _home(mine, f"{state_root}/roles/{role}", uid, gid, fix_mode)
    except OSError as exc:
        raise HomeError(f"cannot prepare the home of role {role!r}: {exc}") from exc
    finally:
        os.close(state)


def looks_ready(
    state_root: Path, role: str, uid: int, gid: int, owner: tuple[int, int] | None = None
) -> bool:
    """Whether the home and every directory above it are as ``_prepare`` leaves them (opened
    and looked at, nothing changed): when they are, there is nothing to make or repair.

    ``owner``: the ids the server's directories belong to (default: this process's). A
    server that is not root looks for itself, and asks the launcher only when this is False.
    """
    owner = owner if owner is not None else (os.getuid(), os.getgid())
    opened: list[int] = []
    try:
        opened.append(os.open(state_root, LOOK_FLAGS))
        st = os.fstat(opened[-1])
        if st.st_uid != owner[0] or not _searchable(st.st_mode):
            return False
        for name in ("roles", role):
            opened.append(os.open(name, LOOK_FLAGS, dir_fd=opened[-1]))
            st = os.fstat(opened[-1])
            if st.st_uid != owner[0] or stat.S_IMODE(st.st_mode) != SEARCHABLE:
                return False
        opened.append(os.open(HOME, LOOK_FLAGS, dir_fd=opened[-1]))
        st = os.fstat(opened[-1])
        return (st.st_uid, st.st_gid) == (uid, gid) and stat.S_IMODE(st.st_mode) == HOME_MODE
    except OSError:
        return False
    finally:
        for fd in opened:
            os.close(fd)


@contextlib.contextmanager
def _server_dir(parent: int, name: str, owner: tuple[int, int]) -> Iterator[int]:
    """The server's own private directory ``name`` under ``parent``, made if missing."""
    made = False
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, SEARCHABLE, dir_fd=parent)
        made = True
    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    try:
        st = os.fstat(fd)
        if made and st.st_uid != owner[0]:
            # Made by the launcher, as root: the mode first, while root still owns it.
            os.fchmod(fd, SEARCHABLE)
            os.fchown(fd, *owner)
            st = os.fstat(fd)
        if st.st_uid != owner[0]:
            raise HomeError(f"{name} is owned by uid {st.st_uid}, not the server's")
        if stat.S_IMODE(st.st_mode) != SEARCHABLE:
            os.fchmod(fd, SEARCHABLE)
        yield fd
    finally:
        os.close(fd)


def _home(parent: int, where: str, uid: int, gid: int, fix_mode: FixMode) -> str | None:
    repaired = None
    try:
        fd = os.open(HOME, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        fd = _make(parent, uid, gid)
    except OSError:
        # ELOOP or ENOTDIR: a symlink or a file stands where the home should be.
        repaired = _move_aside(parent, where, "was not a directory")
        fd = _make(parent, uid, gid)
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.close(fd)
            fd = -1
            repaired = _move_aside(parent, where, f"belonged to uid {st.st_uid}, not {uid}")
            fd = _make(parent, uid, gid)
        elif stat.S_IMODE(st.st_mode) != HOME_MODE:
            fix_mode(fd, HOME_MODE)
    finally:
        if fd >= 0:
            os.close(fd)
    return repaired


def _make(parent: int, uid: int, gid: int) -> int:
    """A new home, made whole under a private name and renamed into place.

    A turn whose fence binds the home by its path must never find one that is
    not yet its role's (made, but not yet handed over).
    """
    staging = f".{HOME}.new-{os.urandom(6).hex()}"
    os.mkdir(staging, HOME_MODE, dir_fd=parent)
    try:
        fd = os.open(staging, DIR_FLAGS, dir_fd=parent)
        # Before the chown: changing the mode of another's needs CAP_FOWNER.
        os.fchmod(fd, HOME_MODE)
        os.fchown(fd, uid, gid)
        os.close(fd)
        os.rename(staging, HOME, src_dir_fd=parent, dst_dir_fd=parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(staging, dir_fd=parent)
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        # Another process made it first: theirs is as good as ours.
    return os.open(HOME, DIR_FLAGS, dir_fd=parent)


def _move_aside(parent: int, where: str, why: str) -> str:
    aside = f"{HOME}.displaced-{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(3).hex()}"
    # rename never follows a symlink: what is moved is the entry itself.
    os.rename(HOME, aside, src_dir_fd=parent, dst_dir_fd=parent)
    said = f"{where}/{HOME} {why}; moved it to {where}/{aside} and made a new home"
    log.warning("%s", said)
    return said
