"""Bind what was checked: every path the plan approved, opened without following a symlink.

The plan decides on paths; a path can be swapped between that decision and the
mount. So each mount source (and the executable) is opened here component by
component from ``/`` with ``O_PATH|O_NOFOLLOW`` and its device and inode
compared with what the plan saw. bubblewrap then receives the descriptor, not
the path: a component swapped before the open is refused as ``path-changed``;
one swapped after it is not what gets mounted, because the descriptor pins the
inode (bubblewrap re-checks the mounted inode against the descriptor itself).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from target_side import trust
from target_side.errors import PathChanged, RefusedError
from target_side.fence.nofollow import open_no_follow
from target_side.policy import refusals
from target_side.policy.mounts import Mount
from target_side.policy.plan import FencePlan

FailureHook = Callable[[str], None]
"""Called with each seam's name before it is crossed; tests raise from it or swap paths."""


def no_failure(step: str) -> None:
    return None


def hold(path: str, identity: tuple[int, int] | None) -> int:
    """``open_no_follow(path)``, checked to be the inode the plan saw (when it saw one)."""
    fd = open_no_follow(path)
    st = os.fstat(fd)
    if identity is not None and (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        raise PathChanged(f"{path} is a different file than the one checked")
    return fd


@dataclass
class HeldFence:
    """Descriptors for everything a fence mounts from the host, in the plan's order."""

    mounts: list[int | None] = field(default_factory=list)
    exe: int = -1

    def fds(self) -> tuple[int, ...]:
        found = [*self.mounts, self.exe]
        return tuple(fd for fd in found if fd is not None and fd >= 0)

    def close(self) -> None:
        """Close every descriptor (bubblewrap has its own copies once it is spawned)."""
        for fd in self.fds():
            _close(fd)
        self.mounts, self.exe = [], -1


def hold_fence(plan: FencePlan, inject: FailureHook = no_failure) -> HeldFence:
    """Open every mount source and the executable; on a change, refuse with ``path-changed``.

    ``inject`` is called with ``check-to-open`` first: the seam between the plan's
    check and these opens, where tests swap a path.
    """
    inject("check-to-open")
    held = HeldFence()
    try:
        for mount in plan.mounts:
            held.mounts.append(_hold_mount(mount, plan))
        held.exe = hold_executable(plan)
    except BaseException:
        held.close()
        raise
    return held


def _hold_mount(mount: Mount, plan: FencePlan) -> int | None:
    if mount.kind == "symlink":
        return None
    identity = None if mount.dev is None or mount.ino is None else (mount.dev, mount.ino)
    fd = _hold_or_refuse(mount.source, identity, mount.subject)
    if mount.subject == "roles.home":
        _check_home(fd, mount, plan)
    return fd


def _check_home(fd: int, mount: Mount, plan: FencePlan) -> None:
    """The home bound writable must be the role's own directory, whatever made it so."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or (st.st_uid, st.st_gid) != (plan.uid, plan.gid):
        _close(fd)
        raise RefusedError(
            refusals.path_changed(
                mount.subject,
                mount.source,
                mount.source,
                f"it is not a directory of uid {plan.uid} and gid {plan.gid}",
            )
        )


def _hold_or_refuse(path: str, identity: tuple[int, int] | None, subject: str) -> int:
    try:
        return hold(path, identity)
    except PathChanged as exc:
        raise RefusedError(refusals.path_changed(subject, path, path, str(exc))) from exc


def hold_executable(plan: FencePlan) -> int:
    """The executable the plan validated, held open and re-checked through the descriptor.

    Mode and owner are checked again on the held inode: the descriptor pins
    the inode, not its permissions.
    """
    exe = plan.executable
    try:
        fd = hold(exe.path, (exe.dev, exe.ino))
    except PathChanged as exc:
        raise RefusedError(
            refusals.path_changed("argv[0]", plan.argv[0], exe.path, str(exc))
        ) from exc
    st = os.fstat(fd)
    problem = _unrunnable(st, plan.uid)
    if problem is not None:
        os.close(fd)
        raise RefusedError(
            refusals.path_changed("argv[0]", plan.argv[0], exe.path)
        ) from PathChanged(problem)
    return fd


def _unrunnable(st: os.stat_result, uid: int) -> str | None:
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        return "is no longer an executable regular file"
    if trust.file_problem(st, uid) is not None:
        return "has become writable by others or changed owner"
    return None


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
