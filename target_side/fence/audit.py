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
    moved = []
    for path, link in expected.items():
        said = _check(path, link, turn_id)
        if said is not None:
            log.warning("turn %s: %s", turn_id, said)
            moved.append(said)
    return moved


def _check(path: str, link: str | None, turn_id: str) -> str | None:
    parent_path, name = posixpath.split(path)
    try:
        parent = open_no_follow(parent_path)
    except (PathChanged, OSError):
        return None  # its directory is gone or was replaced: nothing there can be read
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
    finally:
        with contextlib.suppress(OSError):
            os.close(parent)


def _same_link(parent: int, name: str, target: str) -> bool:
    try:
        return os.readlink(name, dir_fd=parent) == target
    except OSError:
        return False
