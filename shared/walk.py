"""The path walk every paddock component uses to decide what a path names.

``canonical_path`` resolves a path the way the kernel walks it: component by
component, following each symlink where it stands and applying ``..`` to the
*resolved* parent. A lexical clean-up first would be wrong: ``a/link/../x``,
with ``link -> ../secret/sub``, names ``secret/x``, not ``a/x``. Where the path
stops existing, the rest is normalised as text (like ``realpath -m``).

``mount_conflict`` compares two canonical paths on separator boundaries:
``/h/.ssh2`` is not inside ``/h/.ssh``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from enum import StrEnum

from shared.errors import PaddockError

MAX_SYMLINK_HOPS = 40
"""The kernel's limit on symlinks followed in one lookup (ELOOP beyond it)."""


class WalkError(PaddockError):
    """A path could not be walked."""


class RelativePathError(WalkError):
    """A relative path was given where an absolute one is required."""


class SymlinkLoopError(WalkError):
    """More than ``MAX_SYMLINK_HOPS`` symlinks on one walk: a loop, or a chain too long."""


class UnwalkablePathError(WalkError):
    """A component could not be examined (permission denied, I/O error)."""


class Conflict(StrEnum):
    """How a mount path meets a forbidden path."""

    EXACT = "exact"
    DESCENDANT = "descendant"
    PARENT = "parent"


def canonical_path(path: str | os.PathLike[str]) -> str:
    """Resolve ``path`` physically, following symlinks as far as the path exists.

    Raises ``RelativePathError`` for a relative path, ``SymlinkLoopError``
    after ``MAX_SYMLINK_HOPS`` symlinks, and ``WalkError`` for a path no
    system call could take.
    """
    return _walk(os.fspath(path), None)


def canonical_path_and_dirs(path: str | os.PathLike[str]) -> tuple[str, frozenset[str]]:
    """``canonical_path``, and every directory whose entries the walk looked up.

    Those entries decide the answer, and nothing else does: a symlink's target
    cannot change without its directory's entry being replaced.
    """
    consulted: set[str] = set()
    return _walk(os.fspath(path), consulted), frozenset(consulted)


def _walk(text: str, consulted: set[str] | None) -> str:
    if not text.startswith("/"):
        raise RelativePathError(f"{text!r} is relative; an absolute path is required")
    if "\0" in text:
        # Would surface as a ValueError from the first lstat, past callers
        # that catch WalkError to refuse a request.
        raise WalkError(f"{text!r} contains a NUL byte")
    resolved: list[str] = []
    pending = deque(text.split("/"))
    hops = 0
    while pending:
        name = pending.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            if resolved:
                resolved.pop()
            continue
        parent = "/" + "/".join(resolved)
        here = f"{parent.rstrip('/')}/{name}"
        if consulted is not None:
            consulted.add(parent)
        target = _link_target(here)
        if target is None:
            resolved.append(name)
            continue
        hops += 1
        if hops > MAX_SYMLINK_HOPS:
            raise SymlinkLoopError(
                f"{text!r} meets more than {MAX_SYMLINK_HOPS} symlinks (a loop?) at {here!r}"
            )
        if target.startswith("/"):
            resolved.clear()
        pending.extendleft(reversed(target.split("/")))
    return "/" + "/".join(resolved)


def _link_target(path: str) -> str | None:
    """The target of ``path`` if it is a symlink; None if it is anything else or missing."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        # Past the first missing (or non-directory) component the rest is only
        # text. A name too long to look up cannot be there either; realpath -m
        # carries on as text in that case too.
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            return None
        raise UnwalkablePathError(f"cannot look at {path!r}: {exc.strerror}") from exc
    if not stat.S_ISLNK(st.st_mode):
        return None
    return os.readlink(path)


def is_within(path: str, ancestor: str) -> bool:
    """Whether canonical ``path`` is ``ancestor`` or lies below it, on separator boundaries."""
    if ancestor == "/":
        return path.startswith("/")
    return path == ancestor or path.startswith(ancestor + "/")


def mount_conflict(mount: str, forbidden: str) -> Conflict | None:
    """How canonical ``mount`` collides with canonical ``forbidden``, if it does.

    ``PARENT`` counts as much as the others: binding ``$HOME`` exposes ``~/.ssh``.
    """
    if mount == forbidden:
        return Conflict.EXACT
    if is_within(mount, forbidden):
        return Conflict.DESCENDANT
    if is_within(forbidden, mount):
        return Conflict.PARENT
    return None
