"""Launching a planned fence: bubblewrap's command line and the descriptors it inherits.

The only module that knows bwrap's flags. Every host path reaches bubblewrap
as a descriptor held since it was checked (``held``), the system-call filter
as an in-memory file, and the fence waits at ``--block-fd`` until the runner
has put it into the turn's limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import posixpath
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from target_side.errors import BackendError, LimitError
from target_side.fence import syscall_filter
from target_side.fence.held import HeldFence, hold_fence
from target_side.fence.limits import Limiter, TurnLimits
from target_side.fence.runner import Emit, Gate, RunningTurn
from target_side.fence.scratch import FailureHook, Scratch, no_failure
from target_side.policy import refusals
from target_side.policy.plan import SCRIPT_PATH, FencePlan

TRUSTED_BIN_PATH = "/usr/bin:/bin:/usr/local/bin"
"""Where bwrap is looked for: never the server's own $PATH, which the environment could bend."""

BWRAP_ENV = {"PATH": TRUSTED_BIN_PATH}


@dataclass(frozen=True)
class LaunchFds:
    """Descriptors bubblewrap inherits: status, the gate, the script, the filter, held paths."""

    status: int
    block: int
    """The read end bwrap waits on (``--block-fd``)."""
    gate: int
    """The write end, also inherited: while the fence's first process holds it, it can never
    read end-of-file, so a server that dies before releasing it cannot set it running unlimited."""
    held: HeldFence
    script: int | None = None
    seccomp: int | None = None

    def passed(self) -> tuple[int, ...]:
        own = (self.status, self.block, self.gate, self.script, self.seccomp)
        return (*(fd for fd in own if fd is not None), *self.held.fds())


def find_bwrap() -> str:
    """The bwrap executable on the trusted system path."""
    found = shutil.which("bwrap", path=TRUSTED_BIN_PATH)
    if found is None:
        raise BackendError(
            "bubblewrap (bwrap) is not installed; install it (apt-get install bubblewrap) "
            'or set [fence] backend = "none" to run turns without isolation'
        )
    return found


@functools.cache
def signal_reset_prefix() -> tuple[str, ...]:
    """A prefix that starts bwrap with every signal at its default action, where ``env`` can.

    Ignored signals survive exec: a server started with SIGINT ignored (a
    background job, some supervisors) would hand that to every turn, and a
    forwarded Ctrl-C would reach processes deaf to it.
    """
    env = shutil.which("env", path=TRUSTED_BIN_PATH)
    if env is None:
        return ()
    probe = subprocess.run(
        [env, "--default-signal", "true"], capture_output=True, env=BWRAP_ENV, check=False
    )
    return (env, "--default-signal", "--") if probe.returncode == 0 else ()


def bwrap_argv(bwrap: str, plan: FencePlan, fds: LaunchFds) -> list[str]:
    """The full argv: namespaces and identity, then mounts in an order where later ones win."""
    return [
        *signal_reset_prefix(),
        bwrap,
        *_namespaces(plan),
        "--json-status-fd",
        str(fds.status),
        "--block-fd",
        str(fds.block),
        *(["--seccomp", str(fds.seccomp)] if fds.seccomp is not None else []),
        *_base_mounts(fds.held),
        *_planned_mounts(plan, fds.held),
        "--bind-fd",
        str(fds.held.cache),
        posixpath.join(plan.home, ".cache"),
        # Last, so nothing mounted later can cover it: the inode executed is the one checked.
        "--ro-bind-fd",
        str(fds.held.exe),
        plan.executable.path,
        *_script_mount(fds),
        "--chdir",
        plan.cwd,
        "--",
        *plan.argv,
    ]


def _namespaces(plan: FencePlan) -> list[str]:
    # As root, bwrap would otherwise hand the child full capabilities in its namespace,
    # enough to remount a read-only bind writable: drop them all and run as non-root.
    flags = ["--unshare-all", "--unshare-user", "--disable-userns"]
    if plan.network:
        flags.append("--share-net")
    return [
        *flags,
        "--uid",
        str(plan.uid),
        "--gid",
        str(plan.gid),
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",  # TIOCSTI: no way to push keystrokes into a terminal outside
        "--hostname",
        "paddock",
    ]


def _base_mounts(held: HeldFence) -> list[str]:
    # /tmp first: planned mounts under /tmp (a workspace there) must land on top of it.
    return ["--proc", "/proc", "--dev", "/dev", "--bind-fd", str(held.tmp), "/tmp"]  # noqa: S108 - inside the fence, backed by scratch


def _planned_mounts(plan: FencePlan, held: HeldFence) -> list[str]:
    flags = {"ro": "--ro-bind-fd", "rw": "--bind-fd"}
    argv: list[str] = []
    for mount, fd in zip(plan.mounts, held.mounts, strict=True):
        if mount.kind == "symlink" or fd is None:
            argv += ["--symlink", mount.source, mount.dest]
        else:
            argv += [flags[mount.kind], str(fd), mount.dest]
    return argv


def _script_mount(fds: LaunchFds) -> list[str]:
    if fds.script is None:
        return []
    return ["--ro-bind-data", str(fds.script), SCRIPT_PATH]


def script_fd(body: bytes) -> int:
    """A sealed in-memory file holding ``body``, for bwrap to copy into the fence."""
    fd = os.memfd_create("paddock-script", os.MFD_CLOEXEC)
    os.write(fd, body)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def launch_turn(
    bwrap: str,
    plan: FencePlan,
    scratch: Scratch,
    emit: Emit,
    limiter: Limiter,
    inject: FailureHook = no_failure,
) -> RunningTurn:
    """Hold every checked path, set up limits and filter, and start bubblewrap.

    ``inject`` is called with ``check-to-open`` (before the paths are opened)
    and ``open-to-launch`` (after, just before bubblewrap starts): the seams
    tests use to swap a path. Every descriptor is closed here once bubblewrap
    has its own copies; on any failure nothing is left behind.
    """
    opened: list[int] = []
    limits: TurnLimits | None = None
    try:
        held = hold_fence(plan, scratch, inject)
        opened += held.fds()
        limits = limiter.for_turn(plan.turn_id, plan.limits)
        status_read, status_write = os.pipe()
        opened += (status_read, status_write)
        block_read, block_write = os.pipe()
        opened += (block_read, block_write)
        fds = LaunchFds(
            status=status_write,
            block=block_read,
            gate=block_write,
            held=held,
            script=_opened(opened, script_fd(plan.script) if plan.script is not None else None),
            seccomp=_opened(opened, syscall_filter.filter_fd()),
        )
        inject("open-to-launch")
        running = await RunningTurn.start(
            bwrap_argv(bwrap, plan, fds),
            plan.env,
            fds.passed(),
            status_read,
            plan.stdin_open,
            emit,
            plan.limits.wall_s,
            plan.limits.output_mb << 20,
            Gate(block_write, limits),
        )
    except LimitError as exc:
        _close_all(opened)
        raise refusals.backend_unavailable(str(exc)) from exc
    except OSError as exc:
        _close_all(opened)
        if limits is not None:
            limits.remove_now()
        raise refusals.backend_unavailable(f"could not start bubblewrap: {exc}") from exc
    except BaseException:
        _close_all(opened)
        if limits is not None:
            limits.remove_now()
        raise
    # The runner keeps the status pipe's read end and the gate's write end; bwrap has the rest.
    _close_all(fd for fd in opened if fd not in (status_read, block_write))
    return running


def _opened(opened: list[int], fd: int | None) -> int | None:
    if fd is not None:
        opened.append(fd)
    return fd


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


async def probe(bwrap: str) -> str | None:
    """Run ``true`` in a minimal fence, under the filter where there is one; None if it worked."""
    seccomp = syscall_filter.filter_fd()
    filter_args = ["--seccomp", str(seccomp)] if seccomp is not None else []
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        *filter_args,
        "--ro-bind",
        "/usr",
        "/usr",
        *_usr_merge_links(),
        "--",
        "/usr/bin/true",
    ]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=BWRAP_ENV,
            pass_fds=() if seccomp is None else (seccomp,),
        )
    finally:
        if seccomp is not None:
            os.close(seccomp)
    _, err = await proc.communicate()
    if proc.returncode == 0:
        return None
    return err.decode(errors="replace").strip() or f"bwrap exited {proc.returncode}"


def _usr_merge_links() -> list[str]:
    links = []
    for name in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(name):
            links += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            links += ["--ro-bind", name, name]
    return links
