"""Canonical paths remembered across turns, each re-checked before it is believed.

Every turn's forbidden list canonicalises the same forty-odd host paths, one
``lstat`` per component: about a hundred system calls, each a round of the
interpreter lock when turns plan at once. A path's canonical form depends on
nothing but the entries of the directories its walk looked names up in
(``shared.walk.canonical_path_and_dirs``): a symlink cannot be made, removed
or replaced, nor a directory renamed or mounted over, without changing one of
those directories' device, inode, mtime or ctime. So a remembered answer
keeps those four for each such directory and is believed only while every one
is unchanged. One check of the ~15 directories the list shares replaces the
hundred lookups.

A change in the same clock tick as the look that remembered it would keep its
mtime and ctime; so nothing is remembered while any of its directories
changed less than ``RACY_NS`` ago (as git treats a file as changed when its
mtime is as new as the index).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from shared.walk import canonical_path_and_dirs

RACY_NS = 1_000_000_000
"""A directory changed more recently than this is not trusted to show a further change."""
SIZE = 1024
"""Paths remembered at most (the longest known go first)."""

Seen = tuple[int, int, int, int, int]
"""What identifies a directory's entries: device, inode, mode, mtime, ctime (ns)."""


class WalkCache:
    """Canonical paths and, for each, the directories that decided it as they were then."""

    def __init__(self, size: int = SIZE) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[str, tuple[tuple[str, Seen], ...]]] = OrderedDict()

    def batch(self) -> Callable[[str], str]:
        """``canonical_path`` for the paths of one plan: each directory is looked at once by
        the function returned, so it must not outlive the plan (it would see no change)."""
        looked: dict[str, Seen | None] = {}
        return lambda path: self._canonical(path, looked)

    def _canonical(self, path: str, looked: dict[str, Seen | None]) -> str:
        # Read without the lock (one dict lookup is atomic), and written in place: a plan asks
        # some forty paths, and this is the whole of the work when nothing changed.
        known = self._known.get(path)
        if known is not None and _unchanged(known[1], looked):
            return known[0]
        answer, consulted = canonical_path_and_dirs(path)
        settled = _settled(consulted)
        if settled is not None:
            with self._lock:
                self._known.pop(path, None)
                self._known[path] = (answer, settled)
                while len(self._known) > self._size:
                    self._known.popitem(last=False)  # the longest known: remembered again if asked
        return answer


def _unchanged(dirs: tuple[tuple[str, Seen], ...], looked: dict[str, Seen | None]) -> bool:
    """Whether every directory in ``dirs`` is as it was seen, each looked at once per plan."""
    for directory, seen in dirs:
        now = looked.get(directory, _UNLOOKED)
        if now is _UNLOOKED:
            now = looked[directory] = _look(directory)
        if now != seen:
            return False
    return True


_UNLOOKED: Any = object()


def _look(directory: str) -> Seen | None:
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mode, st.st_mtime_ns, st.st_ctime_ns)


def _settled(consulted: frozenset[str]) -> tuple[tuple[str, Seen], ...] | None:
    """The directories as they are now, or None if one is too fresh to be trusted.

    A directory that does not exist is left out: the walk stopped at its
    nearest existing ancestor, whose entry for it is among the others.
    """
    now = time.time_ns()
    dirs = []
    for directory in sorted(consulted):
        seen = _look(directory)
        if seen is None:
            continue
        if not stat.S_ISDIR(seen[2]) or now - max(seen[3], seen[4]) < RACY_NS:
            return None
        dirs.append((directory, seen))
    return tuple(dirs)
