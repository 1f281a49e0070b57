"""Which host directories a turn can enter, judged by the uid, gid and groups it runs as.

The fence holds no capability, so the kernel's own permission check is the
whole answer: a directory's search bit for the class the turn falls in
(owner, group, other), or its ACL. Its owner can always make it searchable
(``chmod``), so to its owner no directory is closed for good.
"""

from __future__ import annotations

import enum
import errno
import os
import stat
from dataclasses import dataclass

ACL_ATTRIBUTE = "system.posix_acl_access"


class Door(enum.Enum):
    """A directory, as the turn finds it."""

    OPEN = "open"
    """It may search it (or an ACL may let it: the kernel decides)."""
    SHUT = "shut"
    """It may not, but owns it: the turn could open it (``chmod``)."""
    CLOSED = "closed"
    """It may not, and cannot make it so: nothing below can be read, written or replaced
    by the turn, however long it runs."""


@dataclass(frozen=True)
class Reach:
    """The host ids a turn acts as: its uid and gid, and the groups it keeps."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @classmethod
    def of_server(cls) -> Reach:
        """A turn that runs as the server itself (``identity = "server"``) keeps its groups."""
        return cls(os.getuid(), os.getgid(), frozenset(os.getgroups()))

    def may_search(self, st: os.stat_result) -> bool:
        """Whether the mode bits alone let the turn search a directory of this ``stat``."""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & stat.S_IXUSR)
        if st.st_gid == self.gid or st.st_gid in self.groups:
            return bool(st.st_mode & stat.S_IXGRP)
        return bool(st.st_mode & stat.S_IXOTH)

    def door(self, path: str, st: os.stat_result) -> Door:
        """How the turn finds the directory ``path``, whose ``stat`` is ``st``."""
        if self.may_search(st) or _has_acl(path):
            return Door.OPEN
        return Door.SHUT if st.st_uid == self.uid else Door.CLOSED


def _has_acl(path: str) -> bool:
    try:
        os.getxattr(path, ACL_ATTRIBUTE, follow_symlinks=False)
    except OSError as exc:
        # Any other error leaves it unknown: assume there is one.
        return exc.errno not in (errno.ENODATA, errno.ENOTSUP)
    return True
