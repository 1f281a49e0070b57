"""Planning a file operation: the same rules as a turn's mounts, from the same planner.

A file operation (``/v1/files``, ``/v1/archive``) is carried out by a short
fence of its own that runs one fixed helper program (``fence/file_helper.py``)
as the role's uid, so the kernel checks every read and write as the role. This
module decides that fence and changes nothing; what may be named:

- read (a file's bytes, a listing, a directory as an archive): what a turn's
  ``fs.read`` may name. Any existing path the forbidden list allows and the
  role's uid can reach, mounted read-only and alone.
- write (a file, an archive's members): inside one of the role's workspaces.
  The directory written in is mounted writable, as a turn's ``fs.write``
  would be: checked against the forbidden list, reachable by the role, with
  the protected names in it mounted read-only.
- never written, at any depth, existing or not: a protected name
  (``protect.PROTECTED_NAMES``, ``[fence] protect``), or anything inside a git
  directory. A turn finds those read-only, or has what it made there moved
  aside when it ends; a file operation is refused (``protected-path``) before
  anything is written.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.walk import is_within
from shared.wire import Limits
from target_side.config import Settings
from target_side.errors import MissingPath, RefusedError
from target_side.policy import refusals
from target_side.policy.environment import build_env
from target_side.policy.executables import resolve_executable
from target_side.policy.forbidden import forbidden_for
from target_side.policy.mounts import MountPlanner
from target_side.policy.paths import resolve
from target_side.policy.plan import (
    SCRIPT_PATH,
    FencePlan,
    effective_limits,
    host_ids,
    protect_found,
    protect_writable,
    protected_names,
    turn_reach,
)
from target_side.policy.protect import git_dir_above, scan_entries

Operation = Literal["read", "list", "write", "archive-read", "archive-write"]
READS: frozenset[str] = frozenset({"read", "list", "archive-read"})
HELPER_PROGRAM = "python3"
HELPER_FLAGS = ("-I", "-S", "-B")
"""Isolated (no PYTHON* variables, no user site, no script directory on sys.path), no site
module, no bytecode written: the helper reads nothing but its own body and the standard
library."""
GIT_DIR_NAME = ".git"


@dataclass(frozen=True)
class FilePlan:
    """A file operation's fence, and what its helper is asked to do."""

    fence: FencePlan
    op: Operation
    path: str
    """The path as given."""
    resolved: str
    """The path as the walk resolved it: what the helper acts on."""
    limit_bytes: int
    """The role's ``file_mb``, in bytes."""
    request: dict[str, Any] = field(default_factory=dict)
    """What the helper is told (the service adds the data descriptor's number)."""


def plan_file(
    op: Operation,
    role: str,
    path: str,
    settings: Settings,
    op_id: str,
    helper: bytes,
    *,
    mode: str | None = None,
    limit_entries: int = 0,
    etc_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> FilePlan:
    """The fence for one file operation, or a ``RefusedError`` naming the rule it breaks.

    A path that does not exist (or, for a write, whose directory does not) is
    refused with ``MissingPath``.
    """
    server_env = os.environ if environ is None else environ
    config = settings.roles[role]
    uid, gid = host_ids(settings, role)
    workspaces = tuple(resolve("roles.workspaces", w) for w in config.workspaces)
    forbidden = forbidden_for(settings, role, server_env)
    planner = MountPlanner(forbidden, workspaces, turn_reach(settings, uid, gid))
    planner.system(etc_dir)
    planner.path_dirs(settings.fence.path)
    names = protected_names(settings)
    limit = config.limits.file_mb << 20
    request: dict[str, Any] = {"op": op, "limit": limit}
    audit: dict[str, str | None] = {}
    if op in READS:
        resolved = _readable(planner, path)
        request["entries"] = limit_entries
    elif op == "write":
        resolved, audit = _writable_file(planner, path, workspaces, names)
        request["mode"] = mode
    else:
        resolved, audit, extra = _writable_dir(planner, path, workspaces, names, settings, op_id)
        request |= extra
    request["path"] = resolved
    env = build_env(
        {}, fence_path=settings.fence.path, home="/", user=role, turn_id=op_id, server_env={}
    )
    program, executable = resolve_executable(HELPER_PROGRAM, env["PATH"], "/", planner.mounts, uid)
    fence = FencePlan(
        turn_id=op_id,
        role=role,
        argv=(program, *HELPER_FLAGS, SCRIPT_PATH),
        executable=executable,
        env=env,
        cwd="/",
        home="/",
        mounts=tuple(planner.mounts),
        network=False,
        limits=effective_limits(Limits(), config.limits),
        uid=uid,
        gid=gid,
        stdin_open=True,
        audit=audit,
        script=helper,
    )
    return FilePlan(fence, op, path, resolved, limit, request)


def _readable(planner: MountPlanner, path: str) -> str:
    """A path a turn could read: mounted read-only, by itself."""
    resolved = resolve("path", path)
    if not os.path.lexists(resolved):
        raise MissingPath(refusals.missing_path("path", path, resolved))
    planner.existing("ro", path, "path")
    return resolved


def _writable_file(
    planner: MountPlanner, path: str, workspaces: tuple[str, ...], names: tuple[str, ...]
) -> tuple[str, dict[str, str | None]]:
    """A file inside a workspace: its directory mounted writable, protected entries read-only."""
    resolved = resolve("path", path)
    workspace = _workspace_of(resolved, workspaces)
    if workspace is None:
        raise RefusedError(refusals.outside_workspace("path", path, resolved, workspaces))
    if resolved == workspace:
        raise RefusedError(
            refusals.bad_mount(
                "path", path, resolved, "is a workspace, a directory; name a file inside it"
            )
        )
    refuse_protected("path", path, resolved, workspace, names)
    directory = posixpath.dirname(resolved)
    if not os.path.isdir(directory):
        raise MissingPath(
            refusals.missing_path("path", path, directory, " (make the directory first)")
        )
    planner.workspace_dir(directory, "path")
    found = scan_entries(directory, names)
    return resolved, protect_found(planner, found)


def _writable_dir(
    planner: MountPlanner,
    path: str,
    workspaces: tuple[str, ...],
    names: tuple[str, ...],
    settings: Settings,
    op_id: str,
) -> tuple[str, dict[str, str | None], dict[str, Any]]:
    """A directory to extract into, inside a workspace.

    If it exists it is mounted writable and searched at any depth, as a turn's
    working directory is; the archive is staged inside it. If not, its parent
    is mounted writable (only the new name is written there) and the staged
    directory is renamed into place.
    """
    resolved = resolve("path", path)
    workspace = _workspace_of(resolved, workspaces)
    if workspace is None:
        raise RefusedError(refusals.outside_workspace("path", path, resolved, workspaces))
    refuse_protected("path", path, resolved, workspace, names)
    exists = os.path.lexists(resolved)
    if exists:
        planner.workspace_dir(resolved, "path")
        audit = protect_writable(planner, settings)
        keep = [m.source for m in planner.mounts if m.subject in ("fence.git", "fence.protect")]
    else:
        parent = posixpath.dirname(resolved)
        if not os.path.isdir(parent):
            raise MissingPath(
                refusals.missing_path("path", path, parent, " (make its parent directory first)")
            )
        planner.workspace_dir(parent, "path")
        audit = protect_found(planner, scan_entries(parent, names))
        keep = []
    extra = {
        "exists": exists,
        "staging": f".paddock-staging-{op_id}",
        "protected": [name.split("/") for name in (GIT_DIR_NAME, *names)],
        "prefix": _below(resolved, workspace),
        "keep": sorted(keep),
    }
    return resolved, audit, extra


def refuse_protected(
    subject: str, given: str, resolved: str, workspace: str, names: tuple[str, ...]
) -> None:
    """Refuse a write at ``resolved`` that would name, or lie inside, something protected."""
    below = _below(resolved, workspace)
    for name in (GIT_DIR_NAME, *names):
        if _holds_sequence(below, name.split("/")):
            raise RefusedError(
                refusals.protected_path(subject, given, resolved, f"is or lies inside {name!r}")
            )
    git_dir = git_dir_above(resolved)
    if git_dir is not None:
        raise RefusedError(
            refusals.protected_path(
                subject, given, resolved, f"lies inside the git directory {git_dir}"
            )
        )


def _holds_sequence(parts: list[str], wanted: list[str]) -> bool:
    width = len(wanted)
    return any(parts[i : i + width] == wanted for i in range(len(parts) - width + 1))


def _below(resolved: str, workspace: str) -> list[str]:
    rest = resolved[len(workspace) :].strip("/")
    return rest.split("/") if rest else []


def _workspace_of(resolved: str, workspaces: tuple[str, ...]) -> str | None:
    inside = [w for w in workspaces if is_within(resolved, w)]
    # The deepest one: a workspace may lie inside another role's (never this one's own).
    return max(inside, key=len) if inside else None
