"""What each role's host uid needs from the machine, and what the fence's PATH needs.

Turns run as their role's own uid, so the kernel decides what they may touch:
a workspace the role cannot search or write is a workspace its turns cannot
use, and a uid that already belongs to an account (or to a range handed out
for containers) would make the role act as someone else. ``config check``, the
running server's ``config`` health cause and ``doctor`` all report these, each
with the command that fixes it.
"""

from __future__ import annotations

import os
import posixpath
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from target_side import trust
from target_side.config import Settings

SUBORDINATE_FILES = ("/etc/subuid",)


def identity_problems(settings: Settings) -> list[str]:
    """Every problem with the roles' uids and what they must reach, and with the fence PATH."""
    if settings.fence.identity == "server":
        return []
    problems: list[str] = []
    listed: dict[str, int] = {}
    for config in settings.roles.values():
        for workspace in config.workspaces:
            listed[workspace] = listed.get(workspace, 0) + 1
    for role, config in settings.roles.items():
        uid, gid = settings.role_ids(role)
        problems += _uid_problems(role, uid, explicit=config.uid is not None)
        for workspace in config.workspaces:
            # A shared workspace can belong to only one of its roles; the others read it.
            need = stat.S_IWUSR | stat.S_IXUSR if listed[workspace] == 1 else stat.S_IXUSR
            problems += _workspace_problems(role, workspace, uid, gid, need)
    return problems + path_problems(settings.fence.path)


def _uid_problems(role: str, uid: int, *, explicit: bool) -> list[str]:
    where = f"roles.{role}"
    if uid == os.getuid():
        return [f"{where}: uid {uid} is the server's own; give the role a uid of its own"]
    if explicit:
        return []  # the operator chose it, an account made for the role most likely
    try:
        account = pwd.getpwuid(uid).pw_name
    except KeyError:
        account = None
    if account is not None:
        return [
            f"{where}: its uid {uid} (a slot of [server] id_pool) belongs to account "
            f"{account!r}; set [roles.{role}] uid to a uid of the role's own"
        ]
    for owner, first, count in subordinate_ranges():
        if first <= uid < first + count:
            return [
                f"{where}: its uid {uid} (a slot of [server] id_pool) lies in {owner}'s "
                f"subordinate range {first}:{count}; move [server] id_pool, or set "
                f"[roles.{role}] uid"
            ]
    return []


def _workspace_problems(role: str, workspace: str, uid: int, gid: int, need: int) -> list[str]:
    try:
        st = os.stat(workspace)
    except OSError:
        return []  # a missing workspace is reported on its own
    where = f"roles.{role}.workspaces"
    blocked = next(_unsearchable(posixpath.dirname(workspace), uid, gid), None)
    if blocked is not None:
        return [
            f"{where}: {workspace} is out of reach of the role's uid {uid}: it cannot "
            f"search {blocked} (run: chmod o+x {blocked})"
        ]
    if not _may(st, uid, gid, need):
        return [
            f"{where}: {workspace} is not writable by the role's uid {uid} "
            f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run: chown {uid}:{gid} {workspace}"
        ]
    if st.st_mode & stat.S_IWOTH:
        return [
            f"{where}: {workspace} is writable by everyone (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); run: chmod o-w {workspace}"
        ]
    return []


def _unsearchable(directory: str, uid: int, gid: int) -> Iterator[str]:
    while True:
        try:
            st = os.stat(directory)
        except OSError:
            return
        if not _may(st, uid, gid, stat.S_IXUSR):
            yield directory
        if directory == "/":
            return
        directory = posixpath.dirname(directory)


def _may(st: os.stat_result, uid: int, gid: int, user_bits: int) -> bool:
    """Whether ``uid``/``gid`` has every one of ``user_bits`` (given as owner bits) on ``st``."""
    if st.st_uid == uid:
        shift = 0
    elif st.st_gid == gid:
        shift = 3
    else:
        shift = 6
    return st.st_mode & (user_bits >> shift) == user_bits >> shift


def path_problems(search_path: str) -> list[str]:
    """Fence PATH directories that are missing or that someone else could change."""
    problems = []
    for directory in dict.fromkeys(search_path.split(":")):
        if not os.path.isdir(directory):
            problems.append(
                f"fence.path: {directory} does not exist; turns will not find programs there "
                "(create it, or take it off the PATH)"
            )
            continue
        found = trust.untrusted_ancestor(os.path.realpath(directory))
        if found is not None:
            problems.append(
                f"fence.path: {found[0]} {found[1]}; every turn is refused until it is fixed "
                f"(run: chmod go-w {found[0]}, or take {directory} off the PATH)"
            )
    return problems


def subordinate_ranges() -> list[tuple[str, int, int]]:
    """The ``(owner, first, count)`` ranges of /etc/subuid: ids handed out for containers."""
    found = []
    for path in SUBORDINATE_FILES:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                found.append((parts[0], int(parts[1]), int(parts[2])))
    return found
