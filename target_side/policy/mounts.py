"""The mount plan: an allowlist of host paths, each walked and checked before it is listed.

Every source goes through the walk, and every source and destination meets
the forbidden list. Destinations must already be normal paths. What is
listed later is mounted later, on top of what came before.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from shared.walk import canonical_path, is_within
from target_side import trust
from target_side.errors import RefusedError
from target_side.policy import refusals
from target_side.policy.forbidden import ForbiddenList
from target_side.policy.paths import is_normal, resolve
from target_side.policy.reach import Door, Reach

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ENTRIES = (
    "passwd",
    "group",
    "hosts",
    "host.conf",
    "resolv.conf",
    "nsswitch.conf",
    "gai.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "localtime",
    "timezone",
    "os-release",
    "debian_version",
    "bash.bashrc",
    "profile",
    "profile.d",
    "inputrc",
    "mime.types",
    "protocols",
    "services",
    "login.defs",
    "environment",
    "gitconfig",
    "manpath.config",
    "magic",
    "mailcap",
)
"""The curated /etc: what programs need to run, never /etc as a whole (it holds /etc/shadow)."""

UNPINNED_SUBJECTS = frozenset({"fence.system", "fence.etc", "fence.path", "roles.home"})
"""Mounts not pinned to the inode the plan saw. System entries are replaced by rename during
routine maintenance, and only root can; the role's home is made or repaired at launch. All of
them are still bound by a descriptor opened without following links."""

MountKind = Literal["ro", "rw", "symlink"]


@dataclass(frozen=True)
class Mount:
    """One entry of the mount plan: a host path bound at ``dest``, or a symlink."""

    kind: MountKind
    source: str
    dest: str
    subject: str
    dev: int | None = None
    ino: int | None = None
    """The source's identity when planned (None if not pinned): the launch binds only that."""


class MountPlanner:
    """Collects mounts in order, sending every path through the walk and the forbidden list."""

    def __init__(
        self,
        forbidden: ForbiddenList,
        workspaces: tuple[str, ...],
        reach: Reach,
        walk: Callable[[str], str] = canonical_path,
    ) -> None:
        self.forbidden = forbidden
        self.workspaces = workspaces
        self.reach = reach
        """Who the turn acts as: what it can enter, and what bubblewrap (as it) can bind."""
        self.walk = walk
        self.mounts: list[Mount] = []
        self._searchable: set[str] = set()

    def system(self, etc_dir: str | None) -> None:
        """System directories, and ``/etc``: the curated copy if there is one (``fence.etc``),
        else each curated entry of the host's."""
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                self.mounts.append(Mount("symlink", os.readlink(path), path, "fence.system"))
            elif os.path.isdir(path):
                self.add("ro", path, "fence.system")
        if etc_dir is not None:
            self.add("ro", etc_dir, "fence.etc", dest="/etc")
            return
        for name in ETC_ENTRIES:
            path = f"/etc/{name}"
            if os.path.lexists(path):
                self.existing("ro", path, "fence.etc", dest=path)

    def path_dirs(self, search_path: str) -> None:
        """Bind the fence's PATH directories that no system mount already shows, once trusted."""
        for directory in dict.fromkeys(search_path.split(":")):
            resolved = resolve("fence.path", directory, self.walk)
            if not os.path.isdir(resolved) or self.visible(resolved):
                continue  # a missing entry is the operator's to fix: config check says so
            found = trust.untrusted_ancestor(resolved)
            if found is not None:
                raise RefusedError(refusals.untrusted_path_dir(found[0], found[1]))
            self.add("ro", directory, "fence.path")

    def visible(self, resolved: str) -> bool:
        """Whether canonical ``resolved`` lies inside something already mounted."""
        return any(m.kind != "symlink" and is_within(resolved, m.source) for m in self.mounts)

    def home(self, place: str) -> str:
        """The role's home at its place (``forbidden.home_place``): opened without following
        links at launch, after whatever stood there was moved aside."""
        return self.add("rw", place, "roles.home")

    def add(self, kind: MountKind, path: str, subject: str, dest: str | None = None) -> str:
        resolved = path if subject == "roles.home" else resolve(subject, path, self.walk)
        self.check_forbidden(subject, path, resolved)
        target = dest or resolved
        if not is_normal(target):
            raise RefusedError(refusals.abnormal_destination(subject, target))
        if subject != "fence.etc":
            # (The curated /etc is the target's own copy, made without /etc's secrets.)
            self.check_forbidden(subject, target, target)
        self.check_reachable(subject, path, resolved)
        pinned = (None, None) if subject in UNPINNED_SUBJECTS else identity(resolved)
        self.mounts.append(Mount(kind, resolved, target, subject, *pinned))
        return resolved

    def existing(self, kind: MountKind, path: str, subject: str, dest: str | None = None) -> str:
        resolved = resolve(subject, path, self.walk)
        try:
            st = os.stat(resolved)
        except OSError:
            raise RefusedError(
                refusals.bad_mount(subject, path, resolved, "does not exist on the target")
            ) from None
        if stat.S_ISSOCK(st.st_mode):
            raise RefusedError(refusals.socket_path(subject, path, resolved))
        return self.add(kind, path, subject, dest)

    def workspace_dir(self, path: str, subject: str) -> str:
        resolved = resolve(subject, path, self.walk)
        if not any(is_within(resolved, w) for w in self.workspaces):
            raise RefusedError(refusals.outside_workspace(subject, path, resolved, self.workspaces))
        if not os.path.isdir(resolved):
            raise RefusedError(
                refusals.bad_mount(
                    subject,
                    path,
                    resolved,
                    "is not an existing directory; create it on the target first, "
                    "or ask for one that exists",
                )
            )
        return self.existing("rw", path, subject)

    def secret(self, pair: str, subject: str) -> None:
        host, _, inside = pair.partition(":")
        self.existing("ro", host, subject, dest=inside or resolve(subject, host, self.walk))

    def check_reachable(self, subject: str, given: str, resolved: str) -> None:
        """Every directory above ``resolved`` must let the role's uid search it.

        bubblewrap runs as that uid and binds each source by its path (after
        checking it is the held inode), so the kernel checks this at mount time;
        planning says it first, in words.
        """
        if self.reach.uid == 0:
            return
        directory = posixpath.dirname(resolved)
        while directory not in self._searchable:
            try:
                st = os.stat(directory)
            except FileNotFoundError:
                pass  # made at launch (the role's home and what leads to it)
            else:
                if self.reach.door(directory, st) is not Door.OPEN:
                    raise RefusedError(
                        refusals.unreachable_for_role(
                            subject,
                            given,
                            resolved,
                            directory,
                            self.reach.uid,
                            stat.S_IMODE(st.st_mode),
                        )
                    )
            self._searchable.add(directory)
            if directory == "/":
                return
            directory = posixpath.dirname(directory)

    def check_forbidden(self, subject: str, given: str, resolved: str) -> None:
        hit = self.forbidden.collision(resolved)
        if hit is not None:
            raise RefusedError(refusals.forbidden_path(subject, given, resolved, hit))


def identity(resolved: str) -> tuple[int | None, int | None]:
    """Device and inode of ``resolved`` itself (a symlink is not followed), or None if gone."""
    try:
        st = os.lstat(resolved)
    except OSError:
        return None, None
    return st.st_dev, st.st_ino
