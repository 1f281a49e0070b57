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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from target_side.errors import PathChanged
from target_side.fence.nofollow import open_no_follow

log = logging.getLogger("paddock.target")

QUARANTINE_SUFFIX = ".paddock-quarantined-"
Protected = tuple[str, Mapping[str, str | None]]
"""A turn's id and the protected paths its audit checks (``FencePlan.audit``)."""


def enforce(expected: Mapping[str, str | None], turn_id: str) -> list[str]:
    """Move aside each path not as ``expected`` says; returns one sentence per move."""
    moved = []
    for parent_path, entries in _by_parent(expected).items():
        for said in _in_directory(parent_path, entries, _move_aside(turn_id)):
            log.warning("turn %s: %s", turn_id, said)
            moved.append(said)
    return moved


def deviations(expected: Mapping[str, str | None]) -> list[str]:
    """The paths not as ``expected`` says, changing nothing: what ``enforce`` would move.

    Only looks (``lstat``, ``readlink``), never opens a file or follows a link,
    so it may run with more privilege than the role: a view with more
    privilege sees at least what the role's would, so an empty answer means
    ``enforce`` as the role would move nothing either.
    """
    found = []
    for parent_path, entries in _by_parent(expected).items():
        found += _in_directory(parent_path, entries, _named)
    return found


@dataclass(frozen=True)
class _Found:
    """A path not as planned: its directory (open), its name there, what the plan said of it."""

    parent: int
    parent_path: str
    name: str
    link: str | None
    mode: int

    @property
    def path(self) -> str:
        return posixpath.join(self.parent_path, self.name)


Act = Callable[[_Found], str]
"""What is done with a path not as planned; a sentence saying what was done."""


def _by_parent(expected: Mapping[str, str | None]) -> dict[str, list[tuple[str, str | None]]]:
    by_parent: dict[str, list[tuple[str, str | None]]] = {}
    for path, link in expected.items():
        parent_path, name = posixpath.split(path)
        by_parent.setdefault(parent_path, []).append((name, link))
    return by_parent


def _in_directory(parent_path: str, entries: list[tuple[str, str | None]], act: Act) -> list[str]:
    """The entries of one directory, opened once: nothing of the turn is left to change it."""
    try:
        parent = open_no_follow(parent_path)
    except (PathChanged, OSError):
        return []  # the directory is gone or was replaced: nothing there can be read
    try:
        found = (_check(parent, parent_path, name, link, act) for name, link in entries)
        return [said for said in found if said is not None]
    finally:
        with contextlib.suppress(OSError):
            os.close(parent)


def _check(parent: int, parent_path: str, name: str, link: str | None, act: Act) -> str | None:
    try:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if link is not None and _same_link(parent, name, link):
            return None
        return act(_Found(parent, parent_path, name, link, st.st_mode))
    except OSError as exc:
        path = posixpath.join(parent_path, name)
        return f"{path} is not as planned and could not be moved aside: {exc.strerror}"


def _named(found: _Found) -> str:
    return found.path


def _move_aside(turn_id: str) -> Act:
    def move(found: _Found) -> str:
        aside = f"{found.name}{QUARANTINE_SUFFIX}{turn_id}"
        os.rename(found.name, aside, src_dir_fd=found.parent, dst_dir_fd=found.parent)
        what = "changed" if found.link is not None else "appeared"
        return (
            f"{found.path} {what} during the turn and runs outside any fence "
            f"(mode {found.mode:o}); moved it to {posixpath.join(found.parent_path, aside)}"
        )

    return move


def _same_link(parent: int, name: str, target: str) -> bool:
    try:
        return os.readlink(name, dir_fd=parent) == target
    except OSError:
        return False
