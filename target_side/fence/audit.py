"""After a turn: protected names that appeared where nothing could be mounted over them.

Runs once every process of the turn is gone, so nothing of the turn can race
it. Each listed path must be as the plan saw it: still absent, or still the
same symlink. Whatever else stands there is renamed aside (never deleted,
never followed) before anyone is told the turn ended, and each move is said.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from collections.abc import Mapping

from target_side.errors import PathChanged
from target_side.fence.nofollow import open_no_follow

log = logging.getLogger("paddock.target")

QUARANTINE_SUFFIX = ".paddock-quarantined-"


def enforce(expected: Mapping[str, str | None], turn_id: str) -> list[str]:
    """Move aside each path not as ``expected`` says; returns one sentence per move."""
    by_parent: dict[str, list[tuple[str, str | None]]] = {}
    for path, link in expected.items():
        parent_path, name = posixpath.split(path)
        by_parent.setdefault(parent_path, []).append((name, link))
    moved = []
    for parent_path, entries in by_parent.items():
        for said in _check_in(parent_path, entries, turn_id):
            log.warning("turn %s: %s", turn_id, said)
            moved.append(said)
    return moved


def _check_in(parent_path: str, entries: list[tuple[str, str | None]], turn_id: str) -> list[str]:
    """The entries of one directory, opened once: nothing of the turn is left to change it."""
    try:
        parent = open_no_follow(parent_path)
    except (PathChanged, OSError):
        return []  # the directory is gone or was replaced: nothing there can be read
    try:
        found = (_check(parent, parent_path, name, link, turn_id) for name, link in entries)
        return [said for said in found if said is not None]
    finally:
        with contextlib.suppress(OSError):
            os.close(parent)


def _check(parent: int, parent_path: str, name: str, link: str | None, turn_id: str) -> str | None:
    path = posixpath.join(parent_path, name)
    try:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if link is not None and _same_link(parent, name, link):
            return None
        aside = f"{name}{QUARANTINE_SUFFIX}{turn_id}"
        os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)
        what = "changed" if link is not None else "appeared"
        return (
            f"{path} {what} during the turn and runs outside any fence "
            f"(mode {st.st_mode:o}); moved it to {posixpath.join(parent_path, aside)}"
        )
    except OSError as exc:
        return f"{path} is not as planned and could not be moved aside: {exc.strerror}"


def _same_link(parent: int, name: str, target: str) -> bool:
    try:
        return os.readlink(name, dir_fd=parent) == target
    except OSError:
        return False
