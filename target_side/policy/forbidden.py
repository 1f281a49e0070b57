"""The forbidden list: host paths no fence may expose, whatever a role or request says.

Every entry is kept canonical, so a symlinked alias of a forbidden path meets
the same entry. The entries are the same on every turn: their canonical forms
are remembered, each believed only while the directories that decided it are
unchanged (``walk_cache``). Two places in the state root are exempt, recognised by
canonical identity: the role's own home, and the curated copy of ``/etc``
every fence mounts. Each exempts what lies inside it, never its parent or a
sibling.
"""

from __future__ import annotations

import functools
import os
import pwd
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.walk import Conflict, canonical_path, is_within, mount_conflict
from target_side.config import Settings
from target_side.policy.walk_cache import WalkCache

CREDENTIAL_DIRS = (
    ".ssh",
    ".aws",
    ".gnupg",
    ".config/gcloud",
    ".kube",
    ".docker",
    ".netrc",
    ".git-credentials",
    ".config/gh",
    ".npmrc",
    ".pypirc",
)
"""Relative to the service user's home: where credentials for other systems live."""

SYSTEM_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/ssh")
"""Password hashes and the SSH host keys (the whole of /etc/ssh: it holds nothing a turn needs)."""

NEVER_MOUNTED = ("/proc", "/sys", "/dev")
"""The fence has its own /proc and a minimal /dev, and never /sys: none is a source or a place."""

RUNTIME_SOCKETS = (
    "/var/run/docker.sock",
    "/run/docker.sock",
    "/run/containerd",
    "/run/user",
    "/run/dbus",
    "/run/systemd/private",
)
"""Control sockets: a read-only bind does not stop a socket, so they are never bound at all."""


WALKS = WalkCache()
"""The forbidden entries' canonical forms, shared by every turn of this process."""


@dataclass(frozen=True)
class ForbiddenEntry:
    """One forbidden path, canonical, with the reason a person would recognise."""

    path: str
    why: str


@dataclass(frozen=True)
class Collision:
    """A mount path that meets a forbidden entry, and how."""

    entry: ForbiddenEntry
    conflict: Conflict


class ForbiddenList:
    """The forbidden entries for one role, and that role's own exempt home."""

    def __init__(self, entries: list[ForbiddenEntry], own: tuple[str, ...]) -> None:
        self.entries = tuple(entries)
        self.own = own
        self._paths, self._above = _paths_and_above(tuple(e.path for e in self.entries))

    def collision(self, canonical: str) -> Collision | None:
        """The first forbidden entry that canonical path ``canonical`` would expose, if any."""
        if any(is_within(canonical, mine) for mine in self.own):
            return None
        if not self._meets_any(canonical):
            return None  # the usual answer, found without trying each entry
        for entry in self.entries:
            conflict = mount_conflict(canonical, entry.path)
            if conflict is not None:
                return Collision(entry, conflict)
        return None

    def _meets_any(self, canonical: str) -> bool:
        """Whether ``canonical`` is an entry, lies below one, or holds one below it: the
        question ``mount_conflict`` asks of each entry, asked of them all at once."""
        if not canonical.startswith("/") or canonical in self._paths or canonical in self._above:
            return True  # (a path that is not absolute is left to the entries one by one)
        return any(above in self._paths for above in _ancestors(canonical))


@functools.lru_cache(maxsize=64)
def _paths_and_above(paths: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """The entries' paths, and every directory above one (the same every turn of a role)."""
    return frozenset(paths), frozenset(a for path in paths for a in _ancestors(path))


def _ancestors(path: str) -> list[str]:
    """Every directory above canonical ``path``, up to ``/`` (none above ``/`` itself)."""
    found = []
    while path.startswith("/") and path != "/":
        path = path.rsplit("/", 1)[0] or "/"
        found.append(path)
    return found


def role_state_dir(settings: Settings, role: str) -> Path:
    """Where role ``role``'s state lives: the server's, never mounted into a fence."""
    return settings.state_root / "roles" / role


def role_home(settings: Settings, role: str) -> Path:
    """Role ``role``'s home: its own uid's, the only part of the state root a fence sees."""
    return role_state_dir(settings, role) / "home"


def curated_etc_root(settings: Settings) -> Path:
    """Where the fence's curated ``/etc`` is kept: a copy of what everyone may read."""
    return settings.state_root / "etc"


def home_place(settings: Settings, role: str, walk: Callable[[str], str] = canonical_path) -> str:
    """Where the role's home belongs, canonical up to it and never through what stands there.

    Whatever a turn left in its place (a symlink, say) is moved aside at launch.
    """
    return f"{walk(str(role_state_dir(settings, role)))}/home"


def forbidden_for(
    settings: Settings,
    role: str,
    environ: Mapping[str, str] | None = None,
    walk: Callable[[str], str] | None = None,
) -> ForbiddenList:
    """The complete forbidden list for turns of ``role`` (``walk``: a ``WALKS`` batch open)."""
    walk = WALKS.batch() if walk is None else walk
    env = os.environ if environ is None else environ
    entries = [
        ForbiddenEntry(str(settings.state_root), "the target's state (keys, ledger, other roles)"),
        *_config_entries(settings),
        *_home_entries(env),
        *(ForbiddenEntry(p, "a system secret") for p in SYSTEM_SECRETS),
        *(ForbiddenEntry(p, "a runtime control socket") for p in RUNTIME_SOCKETS),
        *(ForbiddenEntry(p, "never mounted: the fence has its own") for p in NEVER_MOUNTED),
        *_other_workspaces(settings, role),
        *(ForbiddenEntry(p, "the operator's forbidden list") for p in settings.fence.forbidden),
    ]
    agent_socket = env.get("SSH_AUTH_SOCK")
    if agent_socket and agent_socket.startswith("/"):
        entries.append(ForbiddenEntry(agent_socket, "the server's SSH agent socket"))
    canonical = [ForbiddenEntry(walk(e.path), e.why) for e in entries]
    own = (home_place(settings, role, walk), walk(str(curated_etc_root(settings))))
    return ForbiddenList(canonical, own)


def _other_workspaces(settings: Settings, role: str) -> list[ForbiddenEntry]:
    """Other roles' workspaces, unless this role lists the very same directory (shared)."""
    own = set(settings.roles[role].workspaces)
    return [
        ForbiddenEntry(workspace, f"a workspace of role {other!r}")
        for other, config in settings.roles.items()
        if other != role
        for workspace in config.workspaces
        if workspace not in own
    ]


def _config_entries(settings: Settings) -> list[ForbiddenEntry]:
    found = []
    if settings.config_path:
        found.append(ForbiddenEntry(settings.config_path, "the target's configuration"))
    if settings.server.tls_key:
        found.append(ForbiddenEntry(settings.server.tls_key, "the target's TLS key"))
    return found


def _home_entries(env: Mapping[str, str]) -> list[ForbiddenEntry]:
    """Credential dirs under both the server's $HOME and its passwd home (they may differ)."""
    homes = {pwd.getpwuid(os.getuid()).pw_dir}
    if env.get("HOME", "").startswith("/"):
        homes.add(env["HOME"])
    return [
        ForbiddenEntry(f"{home.rstrip('/')}/{name}", "a credential store of the service user")
        for home in sorted(homes)
        for name in CREDENTIAL_DIRS
    ]
