"""Policy: from a request and the target's own config to a ``FencePlan``, or a refusal.

Planning decides everything and changes nothing: it only stats and reads
links. Every path the request names goes through the walk before any rule
looks at it, and every mount source and destination meets the forbidden list.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import pwd
import re
import stat
from dataclasses import dataclass
from typing import Literal

from shared.walk import WalkError, canonical_path, is_within
from shared.wire import Executable, Limits, TurnRequest
from target_side.config import RoleConfig, RoleLimits, Settings
from target_side.errors import RefusedError
from target_side.policy import refusals
from target_side.policy.forbidden import ForbiddenList, forbidden_for, role_state_dir

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

SYSTEM_SUBJECTS = frozenset({"fence.system", "fence.etc"})

SCRIPT_PATH = "/run/paddock/turn.sh"
"""Where a script turn's body appears inside the fence (a read-only copy made by bubblewrap)."""

FENCE_LOCALE = "C.UTF-8"
INHERITED_ENV = ("TERM", "COLORTERM")
"""The only names a turn inherits from the server's own environment."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NOBODY = 65534


@dataclass(frozen=True)
class Mount:
    """One entry of the mount plan: a host path bound at ``dest``, or a symlink."""

    kind: Literal["ro", "rw", "symlink"]
    source: str
    dest: str
    subject: str
    dev: int | None = None
    ino: int | None = None
    """The source's identity when planned (None if it was missing): the launch binds only that."""


@dataclass(frozen=True)
class EffectiveLimits:
    """The limits a turn runs under: the request's, or the role's maxima where it asked none."""

    wall_s: float
    memory_mb: int
    pids: int
    cpu: float
    output_mb: int


@dataclass(frozen=True)
class FencePlan:
    """Everything a turn's fence will be, decided before anything is built."""

    turn_id: str
    role: str
    argv: tuple[str, ...]
    executable: Executable
    env: dict[str, str]
    cwd: str
    home: str
    mounts: tuple[Mount, ...]
    network: bool
    limits: EffectiveLimits
    uid: int
    gid: int
    stdin_open: bool
    keep_scratch: bool
    script: bytes | None = None


def plan_turn(
    request: TurnRequest, settings: Settings, turn_id: str, environ: dict[str, str] | None = None
) -> FencePlan:
    """The fence ``request`` would get, or a ``RefusedError`` naming the first rule it breaks."""
    env_in = dict(os.environ if environ is None else environ)
    role = settings.roles[request.role]
    limits = effective_limits(request.limits, role.limits)
    network = _network(request, role)
    forbidden = forbidden_for(settings, request.role, turn_id, env_in)
    home = str(role_state_dir(settings, request.role) / "home")
    workspaces = tuple(resolve("roles.workspaces", w) for w in role.workspaces)
    planner = _MountPlanner(forbidden, workspaces)
    planner.system()
    planner.add("rw", str(role_state_dir(settings, request.role)), "roles.state_dir")
    cwd = planner.workspace_dir(request.cwd or role.workspaces[0], "cwd")
    for i, path in enumerate(request.fs.write):
        planner.workspace_dir(path, f"fs.write[{i}]")
    for i, path in enumerate(request.fs.read):
        planner.existing("ro", path, f"fs.read[{i}]")
    for i, pair in enumerate(request.secrets):
        planner.secret(pair, f"secrets[{i}]")
    for i, path in enumerate(role.shared_ro):
        planner.existing(
            "ro", path, f"roles.shared_ro[{i}]", dest=posixpath.join(home, posixpath.basename(path))
        )
    planner.protect_git()
    env = build_env(request.env, settings.fence.path, home, turn_id, env_in)
    script = _script_body(request)
    program = "bash" if script is not None else (request.argv or [""])[0]
    exe_path, executable = resolve_executable(program, env["PATH"], cwd, planner.mounts)
    args = [SCRIPT_PATH] if script is not None else list((request.argv or [])[1:])
    uid, gid = fence_ids()
    return FencePlan(
        turn_id=turn_id,
        role=request.role,
        argv=(exe_path, *args),
        executable=executable,
        env=env,
        cwd=cwd,
        home=home,
        mounts=tuple(planner.mounts),
        network=network,
        limits=limits,
        uid=uid,
        gid=gid,
        stdin_open=request.stdin == "open",
        keep_scratch=request.keep_scratch,
        script=script,
    )


def resolve(subject: str, path: str) -> str:
    """``canonical_path``, with a path the walk cannot finish refused against ``subject``."""
    try:
        return canonical_path(path)
    except WalkError as exc:
        raise refusals.bad_mount(subject, path, path, f"cannot be resolved: {exc}") from exc


def effective_limits(asked: Limits, maxima: RoleLimits) -> EffectiveLimits:
    """The request's limits where given, else the role's; above the role's maximum is refused."""
    values = {}
    for name in ("wall_s", "memory_mb", "pids", "cpu", "output_mb"):
        want, most = getattr(asked, name), getattr(maxima, name)
        if want is not None and want > most:
            raise refusals.limit_exceeds_role(name, want, most)
        values[name] = most if want is None else want
    return EffectiveLimits(**values)


def _network(request: TurnRequest, role: RoleConfig) -> bool:
    if request.network == "host" and not role.allow_network:
        raise refusals.network_not_allowed(request.role)
    return request.network == "host"


def fence_ids() -> tuple[int, int]:
    """The uid and gid inside the fence: the service user's own, or nobody when it is root."""
    uid, gid = os.getuid(), os.getgid()
    return (NOBODY, NOBODY) if uid == 0 else (uid, gid)


def build_env(
    declared: dict[str, str], fence_path: str, home: str, turn_id: str, server_env: dict[str, str]
) -> dict[str, str]:
    """The turn's environment, from empty: fixed names, then declared ones, then the turn id."""
    user = _fence_user()
    env = {
        "PATH": fence_path,
        "HOME": home,
        "USER": user,
        "LOGNAME": user,
        "SHELL": "/bin/sh",
        "TMPDIR": "/tmp",  # noqa: S108 - the fence's own /tmp, the turn's private scratch
        "LANG": FENCE_LOCALE,
        "LC_ALL": FENCE_LOCALE,
    }
    env |= {name: server_env[name] for name in INHERITED_ENV if name in server_env}
    for name, value in declared.items():
        if name.startswith("PADDOCK_"):
            raise refusals.reserved_env(name)
        if not _ENV_NAME.fullmatch(name):
            raise refusals.invalid_env(
                name, "is not a valid name (letters, digits, '_'; not starting with a digit)"
            )
        if "\0" in value:
            raise refusals.invalid_env(
                name, "has a NUL byte in its value, which no process can receive"
            )
    env |= declared
    env["PADDOCK_TURN_ID"] = turn_id
    return env


def _fence_user() -> str:
    uid = fence_ids()[0]
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "paddock"


def _script_body(request: TurnRequest) -> bytes | None:
    if request.script is None:
        return None
    body = request.script.encode()
    actual = hashlib.sha256(body).hexdigest()
    if actual != request.script_sha256:
        raise refusals.digest_mismatch(str(request.script_sha256), actual)
    return body


class _MountPlanner:
    """Collects mounts in order, sending every path through the walk and the forbidden list."""

    def __init__(self, forbidden: ForbiddenList, workspaces: tuple[str, ...]) -> None:
        self.forbidden = forbidden
        self.workspaces = workspaces
        self.mounts: list[Mount] = []

    def system(self) -> None:
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                self.mounts.append(Mount("symlink", os.readlink(path), path, "fence.system"))
            elif os.path.isdir(path):
                self.add("ro", path, "fence.system")
        for name in ETC_ENTRIES:
            path = f"/etc/{name}"
            if os.path.lexists(path):
                self.existing("ro", path, "fence.etc", dest=path)

    def add(
        self, kind: Literal["ro", "rw"], path: str, subject: str, dest: str | None = None
    ) -> str:
        resolved = resolve(subject, path)
        self._check_forbidden(subject, path, resolved)
        target = dest or resolved
        self._check_forbidden(subject, target, posixpath.normpath(target))
        # System entries are not pinned to the inode the plan saw: package managers and
        # useradd replace them by rename, and only root can, so a pin would refuse turns
        # during routine maintenance and stop no one. They are still bound by descriptor.
        pinned = _identity(resolved) if subject not in SYSTEM_SUBJECTS else (None, None)
        self.mounts.append(Mount(kind, resolved, target, subject, *pinned))
        return resolved

    def existing(
        self, kind: Literal["ro", "rw"], path: str, subject: str, dest: str | None = None
    ) -> str:
        resolved = resolve(subject, path)
        try:
            st = os.stat(resolved)
        except OSError:
            raise refusals.bad_mount(
                subject, path, resolved, "does not exist on the target"
            ) from None
        if stat.S_ISSOCK(st.st_mode):
            raise refusals.socket_path(subject, path, resolved)
        return self.add(kind, path, subject, dest)

    def workspace_dir(self, path: str, subject: str) -> str:
        resolved = resolve(subject, path)
        if not any(is_within(resolved, w) for w in self.workspaces):
            raise refusals.outside_workspace(subject, path, resolved, self.workspaces)
        if not os.path.isdir(resolved):
            raise refusals.bad_mount(subject, path, resolved, "is not an existing directory")
        return self.existing("rw", path, subject)

    def secret(self, pair: str, subject: str) -> None:
        host, _, inside = pair.partition(":")
        self.existing("ro", host, subject, dest=inside or resolve(subject, host))

    def protect_git(self) -> None:
        """Keep hooks and git config read-only in writable mounts: a planted hook runs unfenced."""
        for mount in [m for m in self.mounts if m.kind == "rw"]:
            for name in (".git/hooks", ".git/config"):
                inner = posixpath.join(mount.source, name)
                if os.path.lexists(inner) and resolve("fence.git", inner) == inner:
                    self.mounts.append(
                        Mount(
                            "ro",
                            inner,
                            posixpath.join(mount.dest, name),
                            "fence.git",
                            *_identity(inner),
                        )
                    )

    def _check_forbidden(self, subject: str, given: str, resolved: str) -> None:
        hit = self.forbidden.collision(resolved)
        if hit is not None:
            raise refusals.forbidden_path(subject, given, resolved, hit)


def _identity(resolved: str) -> tuple[int | None, int | None]:
    try:
        st = os.lstat(resolved)
    except OSError:
        return None, None
    return st.st_dev, st.st_ino


def resolve_executable(
    program: str, search_path: str, cwd: str, mounts: list[Mount]
) -> tuple[str, Executable]:
    """Find ``program`` as the fence will, check it may run, and pin it by device and inode.

    Returns the path to execute inside the fence (as found on PATH, so argv[0]
    keeps its name) and the canonical file it names.
    """
    if "/" in program:
        candidate = program if program.startswith("/") else posixpath.join(cwd, program)
        return candidate, _checked_executable(program, candidate, mounts)
    refused_as_unrunnable = None
    for directory in search_path.split(":"):
        candidate = posixpath.join(directory, program)
        if not _visible(resolve("argv[0]", candidate), mounts) or not os.path.exists(candidate):
            continue
        try:
            return candidate, _checked_executable(program, candidate, mounts)
        except RefusedError as exc:
            # Like execvp: a non-executable hit does not stop the search, but is reported
            # if nothing later on PATH runs.
            if exc.refusal.rule != "not-executable":
                raise
            refused_as_unrunnable = refused_as_unrunnable or exc
    if refused_as_unrunnable is not None:
        raise refused_as_unrunnable
    raise refusals.not_found(program, f"on the fence's PATH ({search_path})")


def _visible(resolved: str, mounts: list[Mount]) -> bool:
    return any(m.kind != "symlink" and is_within(resolved, m.source) for m in mounts)


def _checked_executable(given: str, candidate: str, mounts: list[Mount]) -> Executable:
    resolved = resolve("argv[0]", candidate)
    if not _visible(resolved, mounts):
        raise refusals.not_found(given, f"inside the fence ({resolved} is not mounted there)")
    try:
        st = os.stat(resolved)
    except OSError:
        raise refusals.not_found(given, f"inside the fence ({resolved} does not exist)") from None
    if not stat.S_ISREG(st.st_mode):
        raise refusals.not_executable(given, resolved, "is not a regular file")
    if not st.st_mode & 0o111:
        raise refusals.not_executable(given, resolved, "has no execute permission (chmod +x it)")
    _check_trusted(given, resolved, st)
    # The directory the name was found in counts too: a symlink there could be repointed.
    _check_directories(given, resolved, resolve("argv[0]", posixpath.dirname(candidate)))
    return Executable(path=resolved, dev=st.st_dev, ino=st.st_ino)


def _check_trusted(given: str, resolved: str, st: os.stat_result) -> None:
    """Seed 003, D3: only a file nobody else could have replaced may run."""
    trusted_owners = {0, os.getuid()}
    if st.st_uid not in trusted_owners:
        raise refusals.untrusted_executable(
            given, resolved, f"{resolved} is owned by uid {st.st_uid}"
        )
    if st.st_mode & 0o022:
        raise refusals.untrusted_executable(
            given, resolved, f"{resolved} is writable by group or others"
        )
    _check_directories(given, resolved, posixpath.dirname(resolved))


def _check_directories(given: str, resolved: str, directory: str) -> None:
    """No directory from ``directory`` up to ``/`` may be replaceable by someone else."""
    trusted_owners = {0, os.getuid()}
    while True:
        dst = os.stat(directory)
        if dst.st_uid not in trusted_owners:
            raise refusals.untrusted_executable(
                given, resolved, f"{directory} is owned by uid {dst.st_uid}"
            )
        if dst.st_mode & 0o022 and not dst.st_mode & stat.S_ISVTX:
            raise refusals.untrusted_executable(
                given,
                resolved,
                f"{directory} is writable by group or others without the sticky bit",
            )
        if directory == "/":
            return
        directory = posixpath.dirname(directory)
