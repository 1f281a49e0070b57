"""Policy: from a request and the target's own config to a ``FencePlan``, or a refusal.

Planning decides everything and changes nothing: it only stats, lists and
reads links. Every path the request names goes through the walk before any
rule looks at it, and every mount source and destination meets the forbidden
list. The rules live in the modules this one calls, one concept each.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import pwd
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.wire import Executable, Limits, PlannedLimits, Tty, TurnRequest
from target_side.config import RoleConfig, RoleLimits, Settings
from target_side.errors import RefusedError
from target_side.policy import managed, refusals
from target_side.policy.environment import build_env
from target_side.policy.executables import resolve_executable
from target_side.policy.forbidden import WALKS, forbidden_for, home_place
from target_side.policy.mounts import Mount, MountPlanner, identity
from target_side.policy.paths import resolve
from target_side.policy.protect import (
    PROTECTED_NAMES,
    Protection,
    protected_member_holding,
    scan,
)
from target_side.policy.reach import Reach

SCRIPT_PATH = "/run/paddock/turn.sh"
"""Where a script turn's body appears inside the fence (a read-only copy made by bubblewrap)."""
TERMINAL_HELPER = "setsid"
"""util-linux ``setsid``: gives a terminal turn's command its pty as controlling terminal."""
DEFAULT_TERM = "xterm-256color"
"""TERM for a terminal turn that names none, on a target that has none of its own."""


@dataclass(frozen=True)
class FencePlan:
    """Everything a turn's fence will be, decided before anything is built."""

    turn_id: str
    role: str
    argv: tuple[str, ...]
    executable: Executable
    env: dict[str, str] = field(repr=False)
    cwd: str
    home: str
    mounts: tuple[Mount, ...]
    network: bool
    limits: PlannedLimits
    uid: int
    """The host uid the turn runs as (the same number inside the fence)."""
    gid: int
    stdin_open: bool
    audit: Mapping[str, str | None] = field(default_factory=dict)
    """Protected paths that cannot be mounted over: each must be as it was after the turn."""
    script: bytes | None = None
    script_path: str = SCRIPT_PATH
    """Where ``script`` appears inside the fence."""
    tty: Tty | None = None
    """The terminal the command runs on, if it asked for one."""
    terminal_helper: str | None = None
    """With ``tty``: the checked ``setsid`` that makes the pty the command's terminal."""


def plan_turn(
    request: TurnRequest,
    settings: Settings,
    turn_id: str,
    environ: Mapping[str, str] | None = None,
    etc_dir: str | None = None,
) -> FencePlan:
    """The fence ``request`` would get, or a ``RefusedError`` naming the first rule it breaks.

    ``etc_dir`` is the curated ``/etc`` to mount whole (``fence.etc``); without
    one, each curated entry of the host's ``/etc`` is bound by itself.
    """
    server_env = os.environ if environ is None else environ
    role = settings.roles[request.role]
    limits = effective_limits(request.limits, role.limits)
    network = _network(request, role)
    walk = WALKS.batch()  # for this plan only: each directory deciding a path looked at once
    home = home_place(settings, request.role, walk)
    workspaces = tuple(resolve("roles.workspaces", w, walk) for w in role.workspaces)
    uid, gid = host_ids(settings, request.role)
    forbidden = forbidden_for(settings, request.role, server_env, walk)
    planner = MountPlanner(forbidden, workspaces, turn_reach(settings, uid, gid), walk)
    planner.system(etc_dir)
    planner.path_dirs(settings.fence.path)
    planner.home(home)
    cwd = planner.workspace_dir(request.cwd or role.workspaces[0], "cwd")
    for i, path in enumerate(request.fs.write):
        planner.workspace_dir(path, f"fs.write[{i}]")
    for i, path in enumerate(request.fs.read):
        planner.existing("ro", path, f"fs.read[{i}]")
    for i, pair in enumerate(request.secrets):
        planner.secret(pair, f"secrets[{i}]")
    for entry in managed.entries(role.home, settings.fence):
        problem = managed.file_problem(entry)
        if problem is not None:
            raise RefusedError(refusals.bad_managed_entry(entry.subject, entry.source, problem))
        planner.existing("ro", entry.source, entry.subject, dest=posixpath.join(home, entry.place))
    audit = protect_writable(planner, settings)
    env = build_env(
        request.env,
        fence_path=settings.fence.path,
        home=home,
        user=_user_name(uid, request.role),
        turn_id=turn_id,
        server_env=server_env,
        lease=request.lease,
    )
    script = _script_body(request)
    program = "bash" if script is not None else (request.argv or [""])[0]
    exe_path, executable = resolve_executable(program, env["PATH"], cwd, planner.mounts, uid)
    args = [SCRIPT_PATH] if script is not None else list((request.argv or [])[1:])
    helper = None
    if request.tty is not None:
        helper = _terminal_helper(env["PATH"], cwd, planner.mounts, uid)
        if "TERM" not in request.env:
            env["TERM"] = request.tty.term or env.get("TERM") or DEFAULT_TERM
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
        audit=audit,
        script=script,
        tty=request.tty,
        terminal_helper=helper,
    )


def _terminal_helper(search_path: str, cwd: str, mounts: list[Mount], uid: int) -> str:
    """``setsid`` as the fence finds it, under the rules a turn's own program meets."""
    try:
        found, _ = resolve_executable(TERMINAL_HELPER, search_path, cwd, mounts, uid)
    except RefusedError as exc:
        raise RefusedError(refusals.no_terminal(TERMINAL_HELPER, exc.refusal.detail)) from exc
    return found


def effective_limits(asked: Limits, maxima: RoleLimits) -> PlannedLimits:
    """The request's limits where given, else the role's; above the role's maximum is refused."""
    values = {}
    for name in PlannedLimits.model_fields:
        want, most = getattr(asked, name), getattr(maxima, name)
        if want is not None and want > most:
            raise RefusedError(refusals.limit_exceeds_role(name, want, most))
        values[name] = most if want is None else want
    return PlannedLimits.model_validate(values)


def host_ids(settings: Settings, role: str) -> tuple[int, int]:
    """The uid and gid the role's turns act as on the host, or a refusal if none is possible.

    Never root, never the server's own uid, unless the operator chose exactly
    that for a private target (``[fence] identity = "server"``).
    """
    if settings.fence.identity == "server":
        if os.getuid() == 0:
            raise RefusedError(
                refusals.identity_unavailable(
                    role,
                    'identity = "server" would run it as root; a server running as root gives '
                    "every role its own uid: remove the key",
                )
            )
        return os.getuid(), os.getgid()
    uid, gid = settings.role_ids(role)
    if uid == os.getuid():
        raise RefusedError(
            refusals.identity_unavailable(
                role, f"its uid {uid} is the server's own; give the role a uid of its own"
            )
        )
    if os.getuid() != 0 and settings.fence.launcher is None:
        raise RefusedError(
            refusals.identity_unavailable(
                role,
                f"its turns run as uid {uid}, which a server running as uid {os.getuid()} can "
                "only do through the privileged launcher: set [fence] launcher (deploy sets it "
                'up), or, for a private single-user target, [fence] identity = "server"',
            )
        )
    return uid, gid


def turn_reach(settings: Settings, uid: int, gid: int) -> Reach:
    """What a turn acting as ``uid:gid`` can enter: one run as the server itself keeps the
    server's groups; a role's own uid runs with none but its gid."""
    if settings.fence.identity == "server":
        return Reach.of_server()
    return Reach(uid, gid)


def _network(request: TurnRequest, role: RoleConfig) -> bool:
    if request.network == "host" and not role.allow_network:
        raise RefusedError(refusals.network_not_allowed(request.role))
    return request.network == "host"


def protected_names(settings: Settings) -> tuple[str, ...]:
    """The built-in protected names, then the operator's ``[fence] protect``."""
    return tuple(dict.fromkeys((*PROTECTED_NAMES, *settings.fence.protect)))


def protect_writable(planner: MountPlanner, settings: Settings) -> dict[str, str | None]:
    """Keep what runs later outside a fence read-only in every writable mount (``protect``)."""
    writable = [(m.subject, m.source) for m in planner.mounts if m.kind == "rw"]
    for subject, root in writable:
        member = protected_member_holding(root)
        if member is not None and subject != "roles.home":
            raise RefusedError(refusals.protected_mount(subject, root, root, member))
    names = protected_names(settings)
    # The role's home is only ever used inside fences: its rc files are its own business.
    found = scan(
        [(s, root) for s, root in writable if s != "roles.home"],
        names,
        settings.fence.scan_limit,
        planner.reach,
    )
    return protect_found(planner, found)


def protect_found(planner: MountPlanner, found: Protection) -> dict[str, str | None]:
    """Mount what a scan found protected over itself; returns the paths to audit afterwards."""
    for git_dir in found.git_dirs:
        # Onto itself: a mount point cannot be renamed away or replaced.
        planner.mounts.append(Mount("rw", git_dir, git_dir, "fence.git", *identity(git_dir)))
    for path in found.read_only:
        planner.mounts.append(Mount("ro", path, path, "fence.protect", *identity(path)))
    return found.audit


def _user_name(uid: int, role: str) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return role


def _script_body(request: TurnRequest) -> bytes | None:
    if request.script is None:
        return None
    body = request.script.encode()
    actual = hashlib.sha256(body).hexdigest()
    if actual != request.script_sha256:
        raise RefusedError(refusals.digest_mismatch(str(request.script_sha256), actual))
    return body
