"""Launching a planned fence: bubblewrap's command line, its descriptors, and its identity.

The only module that knows bwrap's flags and words. Every host path reaches
bubblewrap as a descriptor held since it was checked (``held``), the
system-call filter as an in-memory file, and the fence waits at ``--block-fd``
until the runner has put it into the turn's limits.

bubblewrap never runs as root or as the server: it is started as the role's
own uid and gid, with no supplementary groups (by the server itself when it is
root, else by the privileged launcher: ``fence.identity``), so everything it
and the turn do on the host (files created, sockets connected, processes
signalled) meets the kernel's permission checks as that uid. It runs under a fixed minimal
environment; the turn's variables, and every option, reach it through a
descriptor (``--args``): not through its environment, where a declared
``LD_PRELOAD`` would load into bubblewrap itself, and not on its command line,
where any user of the host could read them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from shared.wire import Refusal
from target_side.errors import (
    BackendError,
    LauncherError,
    LimitError,
    RefusedError,
    ThreadIdsError,
)
from target_side.fence import signals, syscall_filter
from target_side.fence.gate import Gate
from target_side.fence.held import FailureHook, HeldFence, hold_fence, no_failure
from target_side.fence.identity import (
    BWRAP_ENV,
    FenceProcess,
    Identity,
    InProcess,
    SpawnHere,
    Spawning,
)
from target_side.fence.limits import Limiter, TurnLimits
from target_side.fence.runner import Emit, RunningTurn, set_terminal_size
from target_side.policy import refusals
from target_side.policy.mounts import Mount
from target_side.policy.plan import FencePlan

T = TypeVar("T")

TRUSTED_BIN_PATH = BWRAP_ENV["PATH"]
"""Where bwrap is looked for: never the server's own $PATH, which the environment could bend."""


@dataclass(frozen=True)
class LaunchFds:
    """Descriptors bubblewrap inherits: options, status, the gate, script, filter, held paths."""

    status: int
    block: int
    """The read end bwrap waits on (``--block-fd``); -1: no gate, the fence is born inside
    its cgroups."""
    gate: int
    """The write end, also inherited: while the fence's first process holds it, it can never
    read end-of-file, so a server that dies before releasing it cannot set it running unlimited."""
    held: HeldFence
    script: int | None = None
    seccomp: int | None = None
    args: int | None = None
    """bubblewrap's ``--args`` file, made last: it names all the others."""
    extra: tuple[int, ...] = ()
    """The caller's own, passed through to the command at the same numbers (a file
    operation's data pipe); the caller keeps and closes them."""

    def passed(self) -> tuple[int, ...]:
        own = (self.args, self.status, self.block, self.gate, self.script, self.seccomp)
        return (*(fd for fd in own if fd is not None and fd >= 0), *self.held.fds(), *self.extra)


def find_bwrap() -> str:
    """The bwrap executable on the trusted system path."""
    found = shutil.which("bwrap", path=TRUSTED_BIN_PATH)
    if found is None:
        raise BackendError(
            "bubblewrap (bwrap) is not installed; install it (apt-get install bubblewrap)"
        )
    return found


def signal_reset_prefix() -> tuple[str, ...]:
    """A prefix starting bwrap with every signal at its default action, when one is ignored
    here now (``fence.signals``). Looked at on every launch, since the server's dispositions
    can change; when nothing is ignored, as at the server's start, no extra program runs."""
    if not signals.any_ignored():
        return ()
    return env_default_signal()


@functools.cache
def env_default_signal() -> tuple[str, ...]:
    """``env --default-signal --`` where this system's ``env`` has it (coreutils 8.31+).

    Probed once with a child process; the server does so when it starts, off the event loop.
    """
    env = shutil.which("env", path=TRUSTED_BIN_PATH)
    if env is None:
        return ()
    probe = subprocess.run(
        [env, "--default-signal", "true"], capture_output=True, env=BWRAP_ENV, check=False
    )
    return (env, "--default-signal", "--") if probe.returncode == 0 else ()


def bwrap_options(plan: FencePlan, fds: LaunchFds) -> list[str]:
    """Every option, in an order where later mounts win; handed over by ``--args``."""
    return [
        *_namespaces(plan),
        "--json-status-fd",
        str(fds.status),
        *(["--block-fd", str(fds.block)] if fds.block >= 0 else []),
        *(["--seccomp", str(fds.seccomp)] if fds.seccomp is not None else []),
        *_environment(plan),
        *_base_mounts(plan),
        *_planned_mounts(plan, fds.held),
        # Last, so nothing mounted later can cover it: the inode executed is the one checked.
        "--ro-bind-fd",
        str(fds.held.exe),
        plan.executable.path,
        *_script_mount(plan, fds),
        "--chdir",
        plan.cwd,
    ]


def bwrap_argv(
    bwrap: str, plan: FencePlan, fds: LaunchFds, prefix: Sequence[str] = ()
) -> list[str]:
    """What the host's process table shows: bwrap, its options' descriptor, the command."""
    return [
        *signal_reset_prefix(),
        *prefix,
        bwrap,
        "--args",
        str(fds.args),
        "--",
        *_terminal_prefix(plan),
        *plan.argv,
    ]


def _terminal_prefix(plan: FencePlan) -> list[str]:
    # setsid in the fence: a new session whose controlling terminal is the turn's pty
    # (stdin), so the line discipline signals the foreground job and job control works.
    if plan.tty is None or plan.terminal_helper is None:
        return []
    return [plan.terminal_helper, "--ctty", "--"]


def _namespaces(plan: FencePlan) -> list[str]:
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
        *_session_flags(plan),
        "--hostname",
        "paddock",
    ]


def _session_flags(plan: FencePlan) -> list[str]:
    """A new session for the command: no way to push keystrokes into a terminal outside.

    A terminal turn's helper makes the new session itself, and must not be its
    leader already (setsid would fork, and the fence would end with its parent):
    the only terminal it can then reach is the turn's own pty, and the filter
    still refuses TIOCSTI and TIOCLINUX on it.
    """
    if plan.tty is not None and plan.terminal_helper is not None:
        return []
    return ["--new-session"]


def _environment(plan: FencePlan) -> list[str]:
    pairs: list[str] = ["--clearenv"]
    for name, value in plan.env.items():
        pairs += ["--setenv", name, value]
    return pairs


def _base_mounts(plan: FencePlan) -> list[str]:
    # /tmp first: planned mounts under /tmp (a workspace there) must land on top of it.
    return [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(plan.limits.scratch_mb << 20),
        "--tmpfs",
        "/tmp",  # noqa: S108 - inside the fence: the turn's own memory-backed scratch
    ]


def mount_order(mounts: Sequence[Mount]) -> list[int]:
    """Indexes of ``mounts`` with every mount after those whose destination contains it.

    bubblewrap mounts in order; a read-only ``fs.read`` of a parent listed after
    the writable cwd would otherwise cover it. Stable, so equal depths keep the
    plan's order (protections over the mount they protect).
    """
    return sorted(range(len(mounts)), key=lambda i: mounts[i].dest.rstrip("/").count("/"))


def _planned_mounts(plan: FencePlan, held: HeldFence) -> list[str]:
    flags = {"ro": "--ro-bind-fd", "rw": "--bind-fd"}
    argv: list[str] = []
    for i in mount_order(plan.mounts):
        mount, fd = plan.mounts[i], held.mounts[i]
        if mount.kind == "symlink" or fd is None:
            argv += ["--symlink", mount.source, mount.dest]
        else:
            argv += [flags[mount.kind], str(fd), mount.dest]
    return argv


def _script_mount(plan: FencePlan, fds: LaunchFds) -> list[str]:
    if fds.script is None:
        return []
    return ["--ro-bind-data", str(fds.script), plan.script_path]


def memory_file(name: str, data: bytes) -> int:
    """An in-memory file holding ``data``, read from its start by whoever inherits it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def args_fd(options: Sequence[str]) -> int:
    """bubblewrap's ``--args`` file: every option, NUL-terminated."""
    return memory_file("paddock-args", b"".join(o.encode() + b"\0" for o in options))


_DENIED_SOURCE = re.compile(
    r"Can't find source path (?P<path>.+?)(?: \(/proc/self/fd/\d+\))?: Permission denied$"
)
"""bubblewrap's words for a mount source its uid may not reach, once said by path."""


def explain_setup_failure(stderr_tail: bytes, sources: Mapping[int, str] | None = None) -> Refusal:
    """The refusal for a bubblewrap that failed before the command ran, from its own words.

    ``sources`` names what each held descriptor is, so that bubblewrap's
    ``/proc/self/fd/N`` is said as the path a person knows.
    """
    tail = stderr_tail.decode(errors="replace").strip().splitlines()
    last = tail[-1] if tail else "no message"
    # Matched as bubblewrap said it; said with the paths a person knows.
    said = last
    for fd, path in (sources or {}).items():
        said = re.sub(rf"/proc/self/fd/{fd}\b", f"{path} (/proc/self/fd/{fd})", said)
    if "execvp" in last:
        why = f"could not be executed in the fence ({said})"
        return refusals.not_executable("argv[0]", "", why)
    denied = _DENIED_SOURCE.search(said)
    if denied is not None:
        # Not a change: bubblewrap, as the turn's uid, may not search a directory above it
        # (planning refuses the cases it can see; an ACL may deny what mode bits grant).
        path = denied["path"]
        why = (
            "is out of the turn's reach: a directory above it is closed to its uid "
            f"(bubblewrap: {said}); let the role search there, or move it elsewhere"
        )
        return refusals.bad_mount("fence", path, path, why)
    if "Race condition binding dirfd" in last or "Can't find source path /proc/self/fd/" in last:
        # A held source was replaced or unlinked (a package upgrade, useradd rewriting
        # /etc/passwd) between bwrap resolving its descriptor and mounting it.
        return refusals.path_changed("fence", None, None, f"bubblewrap: {said}")
    why = f"bubblewrap could not set up the fence: {said}"
    return refusals.backend_unavailable(why)


async def launch_turn(
    bwrap: str,
    plan: FencePlan,
    emit: Emit,
    limiter: Limiter,
    inject: FailureHook = no_failure,
    identity: Identity | None = None,
    extra_fds: tuple[int, ...] = (),
    kind: type[RunningTurn] = RunningTurn,
    limits: TurnLimits | None = None,
) -> RunningTurn:
    """Hold every checked path, set up limits and filter, and start bubblewrap as the role.

    ``inject`` is called with ``check-to-open`` (before the paths are opened)
    and ``open-to-launch`` (after, just before bubblewrap starts): the seams
    tests use to swap a path. ``identity`` starts it (default: this process,
    which must be root or the role's uid). Every descriptor opened here is
    closed once bubblewrap has its own copies; on any failure nothing is left
    behind. ``extra_fds`` reach the command at their own numbers, and stay the
    caller's. ``kind`` is what follows the process (a session's fence speaks
    frames).
    ``limits``: the turn's cgroups, made already (off the event loop, while it
    was planned); the launch owns them from here, and drops them if it fails.

    A terminal turn's stdin, stdout and stderr are one pty: the server keeps
    its master, the fence gets the other side, which ``setsid --ctty`` makes
    the command's controlling terminal.
    """
    starter = identity if identity is not None else InProcess()
    if limits is None:
        with _undone_on_failure([], lambda: None, None):
            limits = limiter.for_turn(plan.turn_id, plan.limits)
    fence = _Fence.prepare(bwrap, plan, limits, inject, extra_fds)
    with fence.undone_on_failure():
        protected = (plan.turn_id, plan.audit)
        ids = (plan.uid, plan.gid)
        process = await fence.start_with(starter.spawn, plan.role, ids, protected=protected)
    return fence.running(process, emit, kind)


def start_turn(
    bwrap: str,
    plan: FencePlan,
    emit: Emit,
    limits: TurnLimits,
    spawn_here: SpawnHere,
    inject: FailureHook = no_failure,
) -> StartingTurn:
    """``launch_turn``'s first half, on a thread of the caller's (blocking): bubblewrap is
    started at once, by the thread that waits for it, however busy the event loop is; the
    returned ``StartingTurn`` is then awaited on the loop. Same seams, same cleanup."""
    fence = _Fence.prepare(bwrap, plan, limits, inject)
    with fence.undone_on_failure():
        spawning = fence.start_with(spawn_here, (plan.uid, plan.gid))
    return StartingTurn(fence, spawning, emit)


class StartingTurn:
    """A turn whose bubblewrap ``start_turn`` handed over: ``running`` follows it."""

    def __init__(self, fence: _Fence, spawning: Spawning, emit: Emit) -> None:
        self._fence = fence
        self._spawning = spawning
        self._emit = emit

    async def running(self) -> RunningTurn:
        """The turn, followed from the running loop (or why bubblewrap could not start)."""
        with self._fence.undone_on_failure():
            process = await self._spawning.process()
        return self._fence.running(process, self._emit, RunningTurn)


@dataclass
class _Fence:
    """One fence's descriptors, from the paths held to bubblewrap holding its own copies."""

    plan: FencePlan
    argv: list[str]
    fds: LaunchFds
    gate: Gate
    limits: TurnLimits
    opened: list[int]
    kept: tuple[int, int]
    """The gate's two ends (the status pipe's read end, the block pipe's write end), which
    outlive the launch: the runner's, or the starting thread's once given away."""
    master: int | None = None
    terminal: int | None = None

    @classmethod
    def prepare(
        cls,
        bwrap: str,
        plan: FencePlan,
        limits: TurnLimits,
        inject: FailureHook,
        extra_fds: tuple[int, ...] = (),
    ) -> _Fence:
        """Paths held, pipes, filter and options made (blocking); nothing left on failure."""
        opened: list[int] = []
        gate: Gate | None = None
        with _undone_on_failure(opened, lambda: gate, limits):
            held = hold_fence(plan, inject)
            opened += held.fds()
            status_read, status_write = _pipe(opened)
            # Born inside its cgroups, the fence waits for nothing: no gate (``fence.gate``).
            block_read, block_write = (-1, -1) if limits.born_inside else _pipe(opened)
            gate = Gate(status_read, block_write, limits)
            script = memory_file("paddock-script", plan.script) if plan.script is not None else None
            seccomp = syscall_filter.filter_fd(network=plan.network)
            fds = LaunchFds(
                status=status_write,
                block=block_read,
                gate=block_write,
                held=held,
                script=_opened(opened, script),
                seccomp=_opened(opened, seccomp),
                extra=extra_fds,
            )
            fds = replace(fds, args=_opened(opened, args_fd(bwrap_options(plan, fds))))
            inject("open-to-launch")
            argv = bwrap_argv(bwrap, plan, fds, limits.rlimit_prefix(plan.uid))
            fence = cls(plan, argv, fds, gate, limits, opened, (status_read, block_write))
            if plan.tty is not None:
                fence.master, fence.terminal = terminal_pair(plan.tty.rows, plan.tty.cols)
                opened += (fence.master, fence.terminal)
        return fence

    def start_with(self, start: Callable[..., T], *first: object, **more: object) -> T:
        """``start`` (a spawn, or its first half) called with ``first``, this fence, and
        ``more`` of what it takes by name."""
        return start(
            *first,
            self.argv,
            self.fds.passed(),
            self.plan.stdin_open,
            self.limits,
            terminal=self.terminal,
            gate=self.gate,
            **more,
        )

    def undone_on_failure(self) -> contextlib.AbstractContextManager[None]:
        return _undone_on_failure(self.opened, lambda: self.gate, self.limits)

    def running(self, process: FenceProcess, emit: Emit, kind: type[RunningTurn]) -> RunningTurn:
        """Follow ``process``, which has its own copies now: ours are closed (but the gate's
        two ends and the pty's master, the runner's or the starting thread's)."""
        plan, held = self.plan, self.fds.held
        kept = (*self.kept, self.master)
        _close_all(fd for fd in self.opened if fd not in kept)
        sources = {fd: m.source for m, fd in zip(plan.mounts, held.mounts, strict=True) if fd}
        sources[held.exe] = plan.executable.path
        return kind(
            process,
            self.gate,
            emit,
            plan.limits.wall_s,
            plan.limits.output_mb << 20,
            lambda tail: explain_setup_failure(tail, sources),
            terminal=self.master,
        )


@contextlib.contextmanager
def _undone_on_failure(
    opened: list[int], gate: Callable[[], Gate | None], limits: TurnLimits | None
) -> Iterator[None]:
    """On any failure: what was opened closed (but what the gate gave away), the limits
    dropped; the failures of the machinery said as the refusal they are."""
    try:
        yield
    except (LimitError, LauncherError, ThreadIdsError) as exc:
        _undo(opened, gate(), limits)
        raise RefusedError(refusals.backend_unavailable(str(exc))) from exc
    except OSError as exc:
        _undo(opened, gate(), limits)
        raise RefusedError(
            refusals.backend_unavailable(f"could not start bubblewrap: {exc}")
        ) from exc
    except BaseException:
        _undo(opened, gate(), limits)
        raise


def _undo(opened: list[int], gate: Gate | None, limits: TurnLimits | None) -> None:
    """A launch that failed: close what it opened but what the gate gave away; drop its limits."""
    given = gate.given if gate is not None else ()
    _close_all(fd for fd in opened if fd not in given)
    if limits is not None:
        limits.kill()  # a sandbox born inside, whose bubblewrap died without taking it along
        limits.remove_now()


def terminal_pair(rows: int, cols: int) -> tuple[int, int]:
    """A new pty (master, other side) of ``rows`` x ``cols``; never this process's terminal."""
    master, other = os.openpty()
    try:
        set_terminal_size(master, rows, cols)
        os.set_inheritable(master, False)
        os.set_inheritable(other, False)
    except OSError:
        _close_all((master, other))
        raise
    return master, other


def _pipe(opened: list[int]) -> tuple[int, int]:
    read, write = os.pipe()
    opened += (read, write)
    return read, write


def _opened(opened: list[int], fd: int | None) -> int | None:
    if fd is not None:
        opened.append(fd)
    return fd


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


async def probe(
    bwrap: str, role: str, ids: tuple[int, int], identity: Identity | None = None
) -> str | None:
    """Run ``true`` in a minimal fence as ``role``'s ids, under the filter; None if it worked."""
    uid, gid = ids
    seccomp = syscall_filter.filter_fd(network=False)
    filter_args = ["--seccomp", str(seccomp)] if seccomp is not None else []
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(uid),
        "--gid",
        str(gid),
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
    starter = identity if identity is not None else InProcess()
    try:
        proc = await starter.spawn(role, ids, argv, () if seccomp is None else (seccomp,), False)
    except LauncherError as exc:
        return str(exc)
    finally:
        if seccomp is not None:
            os.close(seccomp)
    _, err = await proc.communicate()
    proc.release()
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
