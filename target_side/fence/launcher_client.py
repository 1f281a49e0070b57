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
import contextlib
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from target_side.errors import LauncherError
from target_side.fence import pipes
from target_side.fence.gate import Gate
from target_side.fence.launcher import Channel, close_all
from target_side.fence.limits import TurnLimits

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
            channel = await self.connect()
            request = {"op": "launch", "role": role, "uid": ids[0], "gid": ids[1]}
            request |= {"argv": list(argv), "fds": [0, 1, 2, *pass_fds]}
            await channel.send(request, [*theirs, *pass_fds])
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

    async def hello(self) -> tuple[int, dict[str, Any]]:
        """The launcher's pid (from the kernel) and what it says of itself (or its refusal)."""
        return await self._ask({"op": "hello"})


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
        cgroups = [str(path) for path in limits.dirs] if limits is not None else []
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
