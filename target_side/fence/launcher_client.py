"""The server's side of the privileged launcher: each request, and the process it starts.

A turn is one connection, held until the launcher reports the exit status:
closing it early makes the launcher kill the turn, which is what a server
that dies must cause. The server makes the stdin, stdout and stderr pipes and
keeps their other ends, so output flows from the fence to the server directly;
only control (pid, signals, placement, the exit status) goes through the
launcher. The launcher must be root: the server checks ``SO_PEERCRED`` before
it sends anything, since what it sends (the turn's options and environment)
is for the launcher's eyes only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from target_side.errors import LauncherError
from target_side.fence import pipes
from target_side.fence.audit import Protected
from target_side.fence.cgroupfs import TURN_PREFIX
from target_side.fence.gate import Gate
from target_side.fence.launcher import Channel, close_all
from target_side.fence.limits import TurnLimits
from target_side.fence.nursery import remove_when_empty

log = logging.getLogger("paddock.target")

IDLE_LAUNCHES = 2
"""Launches kept prepared: turns starting closer together than a grace period share them."""
START_HINT = (
    "start it: systemctl start paddock-launcher (with systemd), "
    "or as root PREFIX/bin/paddock-supervise start"
)


class ViaLauncher:
    """``Identity`` through the launcher listening at ``socket_path``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def connect(self) -> Channel:
        """A connection to the launcher, refused unless root serves it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.socket_path)
        except OSError as exc:
            sock.close()
            raise LauncherError(
                f"the launcher at {self.socket_path} is not reachable ({exc.strerror}); "
                + START_HINT
            ) from exc
        channel = Channel(sock)
        _, uid, _ = channel.peer()
        if uid != 0:
            channel.close()
            raise LauncherError(
                f"{self.socket_path} is served by uid {uid}, not root: not the launcher"
            )
        return channel

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request on a connection of its own, and its answer."""
        _, reply = await self._ask(message)
        if "error" in reply:
            raise LauncherError(f"the launcher refused: {reply['error']}")
        return reply

    async def _ask(self, message: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        channel = await self.connect()
        pid, _, _ = channel.peer()
        try:
            await channel.send(message)
            reply, fds = await channel.recv()
            close_all(fds)
        except (EOFError, OSError) as exc:
            raise LauncherError(f"the launcher at {self.socket_path} hung up: {exc}") from exc
        finally:
            channel.close()
        return pid, reply

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
    ) -> LaunchedProcess:
        # ``limits``: placed by the launcher once the fence is up (``adopt``), never born inside.
        # ``gate``: left to the runner, on the event loop; this server holds no thread per turn.
        theirs: list[int] = []
        ours: list[int] = []
        channel: Channel | None = None
        try:
            if terminal is not None:
                # The pty's other side as stdin, stdout and stderr; its master stays here.
                theirs += [os.dup(terminal) for _ in range(3)]
            elif stdin_open:
                stdin_read, stdin_write = os.pipe()
                theirs.append(stdin_read)
                ours.append(stdin_write)
            else:
                theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            for _ in ("stdout", "stderr") if terminal is None else ():
                read, write = os.pipe()
                pipes.widen(read)
                theirs.append(write)
                ours.append(read)
            if {0, 1, 2} & set(pass_fds):
                raise LauncherError("the server's own stdio is closed: a descriptor took 0, 1 or 2")
            prepared = limits.slot if limits is not None else None
            if isinstance(prepared, PreparedLaunch):
                # Its first process waits in the turn's cgroups already, on this connection;
                # the fence has no gate, so it runs there or nowhere.
                if prepared.channel is None:
                    raise LauncherError("the turn's prepared launch was closed before its launch")
                channel, prepared.channel = prepared.channel, None
            else:
                channel = await self.connect()
            request = {"op": "launch", "role": role, "uid": ids[0], "gid": ids[1]}
            request |= {"argv": list(argv), "fds": [0, 1, 2, *pass_fds]}
            if protected is not None and protected[1]:
                # Looked at by the launcher as it reaps the turn: a clean end asks nothing more.
                request |= {"turn_id": protected[0], "expected": dict(protected[1])}
            await channel.send(request, [*theirs, *pass_fds])
            reply, fds = await channel.recv()
            close_all(fds)
            if "gone" in reply:
                # Its prepared child died after the turn took it (no longer watched): the
                # launcher said so before it read the launch, which it then refuses.
                reply, fds = await channel.recv()
                close_all(fds)
            if "error" in reply:
                raise LauncherError(f"the launcher refused: {reply['error']}")
            process = LaunchedProcess(channel, int(reply["pid"]))
            await process.connect_pipes(ours, stdin_open and terminal is None)
        except BaseException as exc:
            close_all(ours)
            if channel is not None:
                channel.close()  # the launcher kills whatever it started
            if isinstance(exc, EOFError | ConnectionError):
                raise LauncherError(f"the launcher at {self.socket_path} hung up") from exc
            raise
        finally:
            close_all(theirs)
        return process

    async def prepare_home(self, state_root: Path, role: str, ids: tuple[int, int]) -> str | None:
        reply = await self.ask({"op": "home", "role": role, "uid": ids[0], "gid": ids[1]})
        repaired = reply.get("repaired")
        return repaired if isinstance(repaired, str) else None

    def spawn_here(self, loop: asyncio.AbstractEventLoop) -> None:
        return None  # the launcher starts it, asked over its socket

    def home_here(
        self, state_root: Path, role: str, ids: tuple[int, int]
    ) -> Callable[[], str | None] | None:
        return None  # the launcher makes it, as root, asked over its socket

    async def audit(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> list[str]:
        if not expected:
            return []
        request = {"op": "audit", "role": role, "uid": ids[0], "gid": ids[1]}
        reply = await self.ask(request | {"turn_id": turn_id, "expected": dict(expected)})
        return [str(m) for m in reply.get("moved", [])]

    def audit_here(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> Callable[[], list[str]] | None:
        return None  # the launcher audits, as root, asked over its socket

    def prepared_launches(
        self, loop: asyncio.AbstractEventLoop, parents: Sequence[Path]
    ) -> PreparedLaunches:
        """Launches kept prepared, their first processes forked into slot cgroups below
        ``parents`` ahead of the turns that take them."""
        return PreparedLaunches(loop, self, parents)

    async def hello(self) -> tuple[int, dict[str, Any]]:
        """The launcher's pid (from the kernel) and what it says of itself (or its refusal)."""
        return await self._ask({"op": "hello"})


class PreparedLaunch:
    """A launch the launcher prepared ahead: its first process forked into this slot's
    cgroups (``dirs``, the server's), waiting on ``channel`` for the turn that takes it.

    Through the launcher, a fence placed after it started waited at its gate
    for a round trip to the launcher and for the move itself, which costs the
    kernel an RCU grace period after its cgroup locks were idle a while (13 ms
    here; turns 100 ms apart took 25.7-28.1 ms through the launcher before and
    15.4-15.7 ms after); a fence prepared this way is born inside its cgroups,
    and its launch needs no fork on the turn's way either.
    """

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.channel: Channel | None = None
        self.ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.watched = False
        """While it waits, its connection is watched: the launcher says nothing there unless
        its child died, and nothing at all if it hung up."""

    @property
    def seats(self) -> int:
        return 1 if self.dirs else 0  # bubblewrap's outer process, born inside with the rest

    @property
    def is_settled(self) -> bool:
        return self.ready.done() and self.ready.result()

    def discard(self) -> None:
        if self.channel is not None:
            self.channel.close()  # the launcher kills what it prepared
            self.channel = None

    def join(self, timeout: float | None = None) -> None:
        return  # nothing of the server's waits there: the launcher reaps what it forked


class PreparedLaunches:
    """A couple of prepared launches kept ready, each replaced once a turn took it.

    A launcher that cannot prepare one (an older one, or cgroups it refuses)
    stops the keeping: turns are then launched and placed as before.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        via: ViaLauncher,
        parents: Sequence[Path],
        idle: int = IDLE_LAUNCHES,
    ) -> None:
        self._loop = loop
        self._via = via
        self._parents = tuple(parents)
        self._idle: list[PreparedLaunch] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        for _ in range(idle):
            self._replace()

    def take(self) -> PreparedLaunch | None:
        for launch in self._idle:
            if launch.is_settled:
                self._idle.remove(launch)
                self._unwatch(launch)  # the connection is the turn's from here, at once
                self._replace()
                return launch
        return None

    def close(self) -> None:
        """End the prepared processes and remove their slots (blocking, briefly; from any
        thread: what touches the loop's connections runs on the loop)."""
        self._closed = True
        idle, self._idle = self._idle, []

        def stop() -> None:
            for task in self._tasks:
                task.cancel()
            for launch in idle:
                self._unwatch(launch)
                launch.discard()  # the launcher kills and reaps each

        _on_loop(self._loop, stop)
        for launch in idle:
            remove_when_empty(launch.dirs)

    def _replace(self) -> None:
        if self._closed:
            return
        launch = PreparedLaunch([])
        self._idle.append(launch)
        task = self._loop.create_task(self._prepare(launch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prepare(self, launch: PreparedLaunch) -> None:
        name = f"{TURN_PREFIX}{os.getpid()}-t-{secrets.token_hex(16)}"
        try:
            launch.dirs = await asyncio.to_thread(_make_slot, self._parents, name)
            channel = await self._via.connect()
            launch.channel = channel
            await channel.send({"op": "prepare", "cgroups": [str(d) for d in launch.dirs]})
            reply, fds = await channel.recv()
            close_all(fds)
            if "error" in reply:
                raise LauncherError(f"the launcher refused: {reply['error']}")
        except (OSError, EOFError, LauncherError) as exc:
            await self._give_up(launch, exc)
            return
        except asyncio.CancelledError:
            launch.discard()
            raise
        launch.ready.set_result(True)
        self._loop.add_reader(channel.sock.fileno(), self._lost, launch)
        launch.watched = True

    def _unwatch(self, launch: PreparedLaunch) -> None:
        if launch.watched and launch.channel is not None:
            self._loop.remove_reader(launch.channel.sock.fileno())
        launch.watched = False

    def _lost(self, launch: PreparedLaunch) -> None:
        """An idle launch's connection spoke (its child died) or closed (its launcher went
        away): it is dropped, and another prepared in its place."""
        self._unwatch(launch)
        if launch not in self._idle:
            return
        log.warning("a prepared launch was lost before a turn took it; preparing another")
        self._idle.remove(launch)
        launch.discard()
        dropping = self._loop.create_task(asyncio.to_thread(remove_when_empty, launch.dirs))
        self._tasks.add(dropping)
        dropping.add_done_callback(self._tasks.discard)
        self._replace()

    async def _give_up(self, launch: PreparedLaunch, exc: BaseException) -> None:
        if not self._closed:
            log.warning(
                "the launcher prepared no launch ahead (%s); turns are placed in their cgroups "
                "once started, as before",
                exc,
            )
        self._closed = True
        launch.discard()
        if launch in self._idle:
            self._idle.remove(launch)
        launch.ready.set_result(False)
        # Off the loop: a process the launcher is still killing keeps the slot busy a moment.
        await asyncio.to_thread(remove_when_empty, launch.dirs)


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[], None]) -> None:
    """``call()`` on ``loop``'s thread, waited for: at once if this is it."""
    with contextlib.suppress(RuntimeError):
        if asyncio.get_running_loop() is loop:
            call()
            return
    done = concurrent.futures.Future[None]()

    def run() -> None:
        try:
            call()
        finally:
            done.set_result(None)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:
        call()  # the loop has closed: nothing of it runs any more
        return
    with contextlib.suppress(concurrent.futures.TimeoutError):
        done.result(timeout=5)


def _make_slot(parents: Sequence[Path], name: str) -> list[Path]:
    made: list[Path] = []
    try:
        for parent in parents:
            (parent / name).mkdir(mode=0o755)
            made.append(parent / name)
    except OSError:
        remove_when_empty(made)
        raise
    return made


class LaunchedProcess:
    """bubblewrap started by the launcher: its pipes are the server's, its control a connection."""

    def __init__(self, channel: Channel, pid: int) -> None:
        self._channel = channel
        self.pid = pid
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.lost: str | None = None
        self.status: asyncio.StreamReader | None = None  # the runner reads the status pipe
        self.clean = False
        self.started_at = time.monotonic()  # started just now (the launcher's answer is here)
        self._returncode: int | None = None
        self._ended = asyncio.get_running_loop().create_future()
        self._replies: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._pipes: list[asyncio.BaseTransport] = []
        """Its output's read ends: closed by their ends of file, or by ``release``."""
        self._reader = asyncio.create_task(self._read())

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def connect_pipes(self, ours: list[int], stdin_open: bool) -> None:
        loop = asyncio.get_running_loop()
        if stdin_open:
            transport, protocol = await loop.connect_write_pipe(
                WriteProtocol, os.fdopen(ours.pop(0), "wb", 0)
            )
            self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        readers = []
        for fd in ours:
            reader, read_end = await pipes.read_end(os.fdopen(fd, "rb", 0))
            self._pipes.append(read_end)
            readers.append(reader)
        if readers:  # none for a terminal turn: its output is the pty's
            self.stdout, self.stderr = readers

    async def _read(self) -> None:
        try:
            while True:
                message, fds = await self._channel.recv()
                close_all(fds)
                if "exit" in message:
                    self._returncode = int(message["exit"])
                    self.clean = message.get("clean") is True
                    break
                if self._replies:
                    self._replies.popleft().set_result(message)
        except (EOFError, OSError, LauncherError) as exc:
            self.lost = f"the launcher went away while the turn ran ({exc})"
            self._returncode = -9
        finally:
            self._channel.close()
            for waiting in self._replies:
                if not waiting.done():
                    waiting.set_exception(LauncherError(self.lost or "the turn has ended"))
            if not self._ended.done():
                self._ended.set_result(self._returncode)

    async def wait(self) -> int:
        return int(await asyncio.shield(self._ended))

    async def communicate(self) -> tuple[bytes, bytes]:
        async def drain(stream: asyncio.StreamReader | None) -> bytes:
            return b"" if stream is None else await stream.read()

        out, err = await asyncio.gather(drain(self.stdout), drain(self.stderr))
        await self.wait()
        return out, err

    async def adopt(self, pid: int, pid_ns: int | None, limits: TurnLimits | None) -> None:
        # Born inside its cgroups (a prepared launch): held, and nothing moved (a move costs
        # the kernel a grace period, even into the cgroups a process is in already).
        placed = limits is None or limits.born_inside
        cgroups = [str(path) for path in limits.dirs] if limits is not None and not placed else []
        reply = await self._request({"op": "fence", "pid": pid, "cgroups": cgroups})
        if reply.get("gone"):
            raise ProcessLookupError(reply.get("error"))
        if "error" in reply:
            raise LauncherError(f"the launcher could not place the fence: {reply['error']}")

    async def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._ended.done():
            raise ProcessLookupError("the turn has ended")
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies.append(answer)
        await self._channel.send(message)
        return await answer

    def signal_fence(self, signum: int) -> int:
        # The launcher walks the fence as the role; how many it reached stays in its log.
        self._send({"op": "signal", "signal": int(signum)})
        return 0

    def kill_fence(self) -> None:
        self._send({"op": "kill"})

    def kill(self) -> None:
        self._send({"op": "kill", "bwrap": True})

    def _send(self, message: dict[str, Any]) -> None:
        if not self._ended.done() and self._channel.sock.fileno() >= 0:
            self._channel.send_soon(message)

    def release(self) -> None:
        if self.stdin is not None:
            self.stdin.close()
        for pipe in self._pipes:
            pipe.close()  # where a holder outside the turn kept it from its end of file
        if not self._reader.done():
            self._reader.cancel()
        with contextlib.suppress(OSError):
            self._channel.close()


class WriteProtocol(asyncio.streams.FlowControlMixin):
    """The turn's stdin pipe: ``StreamWriter.drain`` waits on its flow control."""
