"""How the server acts on the host as a role's uid: by itself, or through the launcher.

Everything a turn does on the host happens as its role's uid, and three things
the server does for a turn need that uid or root: starting bubblewrap (and
signalling, killing and placing what it starts), making the role's home, and
the audit after the turn. ``Identity`` is those three; ``for_settings`` picks
the way this server can do them:

- ``InProcess``: the server is root (tests, ``--local`` as root), or every
  turn runs as the server's own uid (``[fence] identity = "server"``). It
  starts bubblewrap as its own child, switching uid and gid itself.
- ``launcher_client.ViaLauncher``: the server is not root and ``[fence]
  launcher`` names the privileged launcher's socket; each of the three is a
  request to it (``fence/launcher.py`` says what it grants).

Either way ``spawn`` returns a ``FenceProcess``, so ``RunningTurn`` never
knows which one ran the fence. ``InProcess`` also starts it from a thread of
the caller's (``spawn_here``: the planning thread, which need not wait for
the event loop), the loop following it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from target_side.config import Settings
from target_side.fence import audit, home, pipes, thread_ids
from target_side.fence.audit import Protected
from target_side.fence.gate import Gate, StartWatch
from target_side.fence.launcher_client import ViaLauncher, WriteProtocol
from target_side.fence.limits import TurnLimits
from target_side.fence.nursery import Worker
from target_side.fence.pidns import signal_namespace
from target_side.trust import PROGRAM_PATH

BWRAP_ENV = {"PATH": PROGRAM_PATH}
"""All the environment bubblewrap itself gets (never the server's, never the turn's)."""
TURN_UMASK = 0o022
"""One umask for every turn, whatever the server was started with."""


class FenceProcess(Protocol):
    """bubblewrap started for a turn: its pipes, its end, and what may be done to its fence."""

    pid: int
    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None
    lost: str | None
    """Why the process can no longer be followed (its launcher went away), or None."""
    started_at: float
    """When bubblewrap was started (``time.monotonic``): nothing of the turn ran before."""
    status: asyncio.StreamReader | None
    """bubblewrap's status lines, where whoever started it reads its status pipe (and opens
    its gate); None: the runner reads the pipe itself."""
    clean: bool
    """Once it ended: whoever reaped it found the turn's protected paths as planned (the
    launcher looks as it reaps), so no audit is left to ask for; False: not looked at."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    async def communicate(self) -> tuple[bytes, bytes]: ...

    async def adopt(self, pid: int, pid_ns: int | None, limits: TurnLimits | None) -> None:
        """The fence's first process is up and blocked: hold it, and put it into ``limits``
        (or, where its gate was opened already, take what was held).

        Raises ``ProcessLookupError`` if the fence died meanwhile, another error if
        the limits could not be applied.
        """

    def signal_fence(self, signum: int) -> int:
        """Send ``signum`` to every process of the fence but its reaper; how many, if known."""

    def kill_fence(self) -> None:
        """SIGKILL the fence's reaper (so its whole pid namespace), or bubblewrap before it."""

    def kill(self) -> None:
        """SIGKILL bubblewrap itself."""

    def release(self) -> None:
        """Let go of what was held for the process once it has ended."""


class SpawnHere(Protocol):
    """``Identity.spawn``'s first half, on any thread: bubblewrap started, its pipes not yet
    the loop's."""

    def __call__(
        self,
        ids: tuple[int, int],
        argv: Sequence[str],
        pass_fds: Sequence[int],
        stdin_open: bool,
        limits: TurnLimits | None = None,
        *,
        terminal: int | None = None,
        gate: Gate | None = None,
    ) -> Spawning: ...


class Identity(Protocol):
    """Starting, housing and auditing a role's turns as the role's uid."""

    async def spawn(
        self,
        role: str,
        ids: tuple[int, int],
        argv: Sequence[str],
        pass_fds: Sequence[int],
        stdin_open: bool,
        limits: TurnLimits | None = None,
        *,
        terminal: int | None = None,
        gate: Gate | None = None,
        protected: Protected | None = None,
    ) -> FenceProcess:
        """Start ``argv`` as ``ids``; ``limits`` may let it be born inside its cgroups; with
        ``terminal`` (a pty's other side) as its stdin, stdout and stderr. ``gate``: the
        fence's, which this may take over (``fence.gate``). ``protected``: the turn's id and
        the paths its audit checks, for whoever reaps it to look at first (``clean``)."""

    def spawn_here(self, loop: asyncio.AbstractEventLoop) -> SpawnHere | None:
        """``spawn`` in two halves, for a caller on a thread of its own: the first starts
        bubblewrap at once, without the event loop (``loop``, busy or not); the returned
        ``Spawning`` is then awaited on the loop. None where it can only be awaited."""

    async def prepare_home(self, state_root: Path, role: str, ids: tuple[int, int]) -> str | None:
        """Make or repair the role's home (``fence.home``); a sentence if it was repaired."""

    def home_here(
        self, state_root: Path, role: str, ids: tuple[int, int]
    ) -> Callable[[], str | None] | None:
        """``prepare_home`` as a blocking call, for a caller already on a thread of its own
        (one hop to a thread fewer); None where it can only be awaited."""

    async def audit(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> list[str]:
        """Move aside protected names the turn made (``fence.audit``); one sentence per move."""

    def audit_here(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> Callable[[], list[str]] | None:
        """``audit`` as a blocking call, for a caller already on a thread of its own; None
        where it can only be awaited."""


def for_settings(settings: Settings) -> Identity:
    """The launcher where the server is not root and one is configured; else the server itself."""
    launcher = settings.fence.launcher
    if launcher is not None and settings.fence.identity == "per-role" and os.getuid() != 0:
        return ViaLauncher(launcher)
    return InProcess()


class InProcess:
    """The server itself: root, or a server whose turns all run as its own uid."""

    async def spawn(
        self,
        role: str,
        ids: tuple[int, int],
        argv: Sequence[str],
        pass_fds: Sequence[int],
        stdin_open: bool,
        limits: TurnLimits | None = None,
        *,
        terminal: int | None = None,
        gate: Gate | None = None,
        protected: Protected | None = None,
    ) -> FenceProcess:
        # ``protected``: audited on the end's own thread here, which costs no request.
        loop = asyncio.get_running_loop()
        spawning = self.start(
            loop, ids, argv, pass_fds, stdin_open, limits, terminal=terminal, gate=gate
        )
        return await spawning.process()

    def spawn_here(self, loop: asyncio.AbstractEventLoop) -> SpawnHere | None:
        return functools.partial(self.start, loop)

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        ids: tuple[int, int],
        argv: Sequence[str],
        pass_fds: Sequence[int],
        stdin_open: bool,
        limits: TurnLimits | None = None,
        *,
        terminal: int | None = None,
        gate: Gate | None = None,
    ) -> Spawning:
        """Hand bubblewrap to the thread that starts it, which does so at once (any thread)."""
        uid, gid = ids
        prefix: tuple[str, ...] = ()
        switch = thread_acts = False
        if (uid, gid) != (os.getuid(), os.getgid()):
            thread_acts = thread_ids.usable_for(uid)
            prefix = () if thread_acts else as_ids_prefix(uid, gid)
            # Neither: the child switches (and Python forks the server whole).
            switch = not thread_acts and not prefix
        stdin: int = subprocess.PIPE if stdin_open else subprocess.DEVNULL
        stdout: int = subprocess.PIPE
        stderr: int = subprocess.PIPE
        if terminal is not None:
            stdin = stdout = stderr = terminal
        worker = limits.slot if limits is not None else None
        spawning = Spawning(worker if isinstance(worker, Worker) else Worker(loop))

        def start() -> subprocess.Popen[bytes]:
            with thread_ids.acting_as(uid, gid) if thread_acts else contextlib.nullcontext():
                return _popen()

        def _popen() -> subprocess.Popen[bytes]:
            spawning.began = time.monotonic()
            process = subprocess.Popen(
                [*prefix, *argv],
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env=BWRAP_ENV,
                pass_fds=tuple(pass_fds),
                start_new_session=True,  # a Ctrl-C at the server's terminal is not the turn's
                close_fds=True,
                umask=TURN_UMASK,
                user=uid if switch else None,
                group=gid if switch else None,
                extra_groups=[] if switch else None,
            )
            # Before the worker can reap it: a kill through this never hits a recycled pid.
            with contextlib.suppress(OSError):
                spawning.pidfd = os.pidfd_open(process.pid)
            return process

        # The thread that starts bubblewrap opens its gate: it is there at once, the loop is not.
        spawning.watch = StartWatch(loop, gate) if gate is not None else None
        spawning.worker.start(start, spawning.watch)
        return spawning

    async def prepare_home(self, state_root: Path, role: str, ids: tuple[int, int]) -> str | None:
        return await asyncio.to_thread(home.prepare_home, state_root, role, *ids)

    def home_here(
        self, state_root: Path, role: str, ids: tuple[int, int]
    ) -> Callable[[], str | None] | None:
        return functools.partial(home.prepare_home, state_root, role, *ids)

    async def audit(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> list[str]:
        return await asyncio.to_thread(audit.enforce, expected, turn_id)

    def audit_here(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> Callable[[], list[str]] | None:
        return functools.partial(audit.enforce, expected, turn_id)


class Spawning:
    """bubblewrap handed to its worker thread: started there, followed from the event loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.watch: StartWatch | None = None
        self.began = 0.0
        self.pidfd: int | None = None

    async def process(self) -> LocalProcess:
        """The started process, its pipes connected to the running loop (or the error
        starting it raised). Cancelled, nobody follows it: it is killed once it is there."""
        try:
            process = await asyncio.shield(self.worker.spawned)
        except asyncio.CancelledError:
            self.worker.spawned.add_done_callback(self._unfollowed)
            raise
        try:
            return await LocalProcess.started(
                process, self.worker, self.began, self.pidfd, self.watch
            )
        except BaseException:
            self._end(process)
            raise

    def _unfollowed(self, spawned: asyncio.Future[subprocess.Popen[bytes]]) -> None:
        if not spawned.cancelled() and spawned.exception() is None:
            self._end(spawned.result())

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        """``process`` killed, and what this side held of it closed: nothing would ever
        read its pipes, or wait for it. A sandbox still to be held at its gate is killed
        there (bubblewrap's death alone may not take it along); one born inside its
        cgroups goes with them (``fence.launch``)."""
        if self.watch is not None:
            self.watch.kill_when_held()
        pidfd, self.pidfd = self.pidfd, None
        if pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def as_ids_prefix(uid: int, gid: int) -> tuple[str, ...]:
    """``setpriv`` switching to ``uid:gid`` with no groups and no capabilities; () without one.

    Switching ids in the child itself makes Python fork the whole server (its
    page tables: several milliseconds, growing with its memory), where a child
    that keeps the server's ids is started with ``vfork``. Its real, effective
    and saved ids all become the role's once bubblewrap is executed, and no
    capability survives: the same as Python's own switch.
    """
    setpriv = _setpriv()
    if setpriv is None:
        return ()
    return (
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--",
    )


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` on the trusted path, if it takes the options used (2.31+)."""
    found = shutil.which("setpriv", path=BWRAP_ENV["PATH"])
    if found is None:
        return None
    own = f"--reuid={os.getuid()}", f"--regid={os.getgid()}", "--keep-groups"
    probe = [found, *own, "--inh-caps=-all", "--ambient-caps=-all", "--", "true"]
    done = subprocess.run(probe, capture_output=True, env=BWRAP_ENV, check=False)
    return found if done.returncode == 0 else None


def warm() -> None:
    """Find the helpers spawning uses, once, before a turn needs them (blocking)."""
    _setpriv()


class LocalProcess:
    """bubblewrap as the server's own child: signalled and placed by the server itself.

    Started and waited for by a ``Worker`` thread; its pipes are the event loop's streams.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        worker: Worker,
        started_at: float,
        pidfd: int | None,
        watch: StartWatch | None = None,
    ) -> None:
        self._process = process
        self._worker = worker
        self._pidfd = pidfd
        self._watch = watch
        self.status = watch.lines if watch is not None else None
        self.clean = False  # audited after it, on the end's thread
        self.started_at = started_at
        self.pid = process.pid
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.lost: str | None = None
        self._reaper: int | None = None
        self._reaper_pid: int | None = None
        self._pid_ns: int | None = None
        self._pipes: list[asyncio.BaseTransport] = []
        """Its output's read ends: closed by their ends of file, or by ``release``."""

    @classmethod
    async def started(
        cls,
        process: subprocess.Popen[bytes],
        worker: Worker,
        started_at: float,
        pidfd: int | None,
        watch: StartWatch | None = None,
    ) -> LocalProcess:
        """``process``, its pipes connected to the running loop (on failure, none is)."""
        this = cls(process, worker, started_at, pidfd, watch)
        try:
            await this._connect(process)
        except BaseException:
            # Off the loop before the caller closes the pipes: a closed descriptor's number,
            # reused, would otherwise be watched for a transport that is gone.
            for transport in (*this._pipes, *([this.stdin.transport] if this.stdin else [])):
                transport.close()
            raise
        return this

    async def _connect(self, process: subprocess.Popen[bytes]) -> None:
        loop = asyncio.get_running_loop()
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipes.widen(pipe.fileno())
        if process.stdin is not None:
            transport, protocol = await loop.connect_write_pipe(WriteProtocol, process.stdin)
            self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        readers: list[asyncio.StreamReader | None] = []
        for pipe in (process.stdout, process.stderr):
            if pipe is None:  # a terminal turn: its output is the pty's
                readers.append(None)
                continue
            reader, read_end = await pipes.read_end(pipe)
            self._pipes.append(read_end)
            readers.append(reader)
        self.stdout, self.stderr = readers

    @property
    def returncode(self) -> int | None:
        ended = self._worker.ended
        return ended.result() if ended.done() and not ended.exception() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._worker.ended)

    async def communicate(self) -> tuple[bytes, bytes]:
        async def drain(stream: asyncio.StreamReader | None) -> bytes:
            return b"" if stream is None else await stream.read()

        out, err = await asyncio.gather(drain(self.stdout), drain(self.stderr))
        await self.wait()
        return out, err

    async def adopt(self, pid: int, pid_ns: int | None, limits: TurnLimits | None) -> None:
        # The thread that started it held it and moved it into ``limits`` (``fence.gate``).
        if self._watch is None:
            raise RuntimeError("bubblewrap was started without its gate: nothing held it")
        self._reaper_pid, self._pid_ns = pid, pid_ns
        held = await asyncio.shield(self._watch.held)
        self._watch = None  # what it held is this process's now
        self._reaper = held.reaper
        if held.error is not None:
            raise held.error

    def signal_fence(self, signum: int) -> int:
        return signal_namespace(self._pid_ns, self._reaper_pid, signum)

    def kill_fence(self) -> None:
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._reaper, signal.SIGKILL)
        elif self._watch is None or not self._watch.kill_when_held():
            self.kill()

    def kill(self) -> None:
        if self._worker.ended.done():
            return
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def release(self) -> None:
        if self._watch is not None and self._watch.held.done():
            # Held by the thread and never taken (the fence ended before its line was read).
            self._reaper = self._watch.held.result().reaper
            self._watch = None
        for fd in (self._reaper, self._pidfd):
            if fd is not None:
                os.close(fd)
        self._reaper = self._pidfd = None
        for pipe in self._pipes:
            pipe.close()  # where a holder outside the turn kept it from its end of file
