"""The privileged launcher: the one root process that lets an unprivileged server run turns
as each role's own uid.

``paddock-target launcher --config FILE`` runs as root (its own systemd unit,
or beside the supervised server) and listens on the unix socket ``[fence]
launcher`` names: the socket file is root's, mode 0660, group the server's, and
a connection is served only if ``SO_PEERCRED`` says its peer runs as the
server's uid (the owner of the configured state root). What it grants is
exactly "run this as role R's uid", and nothing it does takes a uid, a path of
its choosing or an environment from the request:

- ``launch``: the role's uid and gid come from the root-owned config (never 0,
  never the server's uid or group); the request must name the same ones, so a
  server and a launcher reading different configs refuse rather than guess.
  The launcher forks; the child starts a new session, drops every
  supplementary group, sets gid and uid, umask 022, puts the passed
  descriptors (``SCM_RIGHTS``: stdin, stdout and stderr pipes the server made,
  and every descriptor bubblewrap's options name) at the numbers the request
  gives, closes all others, and executes ``argv`` under ``PATH`` alone;
  ``argv[0]`` must be a root-owned file in root-owned directories. One
  connection per turn, held for the process's life: the launcher answers with
  the pid, later with the exit status (it reaps the child), and SIGKILLs the
  turn if the connection closes first (the server died). A launch may name
  the turn's protected paths (``turn_id``, ``expected``, checked as
  ``audit``'s are): the exit status then says whether they were as planned
  when the launcher reaped the turn (``clean``), looked at as ``audit``
  first looks, so the server of a clean turn asks no ``audit``.
- ``prepare`` (instead, first, on a turn's connection): the launcher forks the
  child ahead of the launch, into the turn cgroups the request names (each
  checked as ``fence`` checks them); the child moves itself there, keeps
  nothing of the launcher's but its job socket and two report pipes, and
  waits as root, running nothing. The ``launch`` that follows on the same
  connection, checked as any launch is, hands it the job (program, argv, the
  descriptors, the role's ids); it then does what a launched child does, born
  inside the turn's cgroups. The connection closing first kills it; if it
  dies first, it is reaped and the connection told (``gone``), and that
  connection launches nothing: its turn's fence has no gate.
- On that connection: ``fence`` names the fence's first process (checked to be
  the launched process's child) and the turn's cgroup directories, which the
  launcher writes the blocked pid into after checking each is a turn cgroup
  the server's uid owns in a mounted hierarchy (cgroup v2 lets only a writer
  of the common ancestor move a process between subtrees, so the server
  cannot move a process of another uid into its own). ``signal`` reaches every
  process in the fence's pid namespace, walked as the role (reading another
  uid's ``/proc/PID/ns`` takes ptrace access, which the role has over its own
  fence and the launcher does not keep); ``kill`` SIGKILLs the fence's reaper,
  and with ``bwrap`` bubblewrap too.
- ``home``: ``fence.home.prepare_home`` as root, only under the configured
  state root. ``audit``: only for paths inside the role's workspaces, looked
  at first by the launcher itself (``fence.audit.deviations``: ``lstat`` and
  ``readlink``, nothing opened, followed or changed); only if one is not as
  planned does ``fence.audit.enforce`` run, in a child running as the role:
  renaming what the role created needs nothing more than being the role.
  Root sees at least what the role would, so looking first never hides a
  path the role's child would have moved; it spares the usual turn a fork of
  the launcher (a turn of ``true`` through it 1.71x and 1.73x the same turn
  in process, 1.38x and 1.36x looked at first: ``bench/launcher_latency.py``).

Why a root helper, and not subordinate ids with ``newuidmap`` and bubblewrap's
``--userns``: a fence made that way keeps the server's supplementary groups
(unmapped, yet honoured by the kernel's permission checks on the host), and
files the server prepares for a role (its home) cannot be given to the role's
uid without ``chown``, which only root may do. Why not ``sudo``: it would run
a command line as a user, where this must hand over descriptors, report a
pid and an exit status, and kill the turn when its server goes away; and a
sudoers rule broad enough for bubblewrap's argv lets the server run anything
as any listed user anyway. What the grant still allows a compromised server:
to run any root-owned program as any role's uid, unfenced. That is the
power over role uids it had through their tokens, less the fence; never root,
never a uid outside the config, never its own uid, never extra groups.

Standard library and the configuration loader only: this is the only code
that runs with privilege, and it imports nothing that is not needed for it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import fcntl
import functools
import gc
import json
import logging
import os
import posixpath
import pwd
import re
import select
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from shared import __version__
from shared.walk import canonical_path, is_within
from target_side import trust
from target_side.config import Settings, load_settings
from target_side.errors import HomeError, LauncherError, TargetError
from target_side.fence import audit, home, landlock, orphans, signals
from target_side.fence.cgroupfs import TURN_CGROUP, cgroup_mounts
from target_side.fence.nofollow import open_no_follow
from target_side.fence.pidns import parent_of, pid_namespace, signal_namespace

log = logging.getLogger("paddock.launcher")

MAX_FRAME = 1 << 20
MAX_FDS = 250
"""Descriptors per message: the kernel takes at most 253 in one ``SCM_RIGHTS``."""
MAX_PREPARED = 8
"""Processes waiting prepared at once, over every connection (a server keeps two)."""
SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""Why an accept can fail for a while, and work again later."""
ACCEPT_RETRY_S = 0.1
"""How long the listener waits before it tries to accept again after such a failure."""
MAX_TARGET_FD = 1 << 16
EXEC_ENV = {"PATH": trust.PROGRAM_PATH}
"""All the environment a launched program gets; the turn's own goes through bubblewrap."""
TURN_UMASK = 0o022
HELPER_TIMEOUT_S = 30.0
"""How long a helper running as a role (audit, signal walk, home mode) may take."""
SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
"""What ``signal`` sends; SIGKILL is ``kill``, which needs no walk."""
_TURN_ID = re.compile(r"[ts]-[0-9a-f]{1,64}")
"""A turn's id, or a session's (a session's fence is audited when it ends)."""


# --- the wire: length-prefixed JSON frames, descriptors riding on them --------------------


class Channel:
    """One unix stream connection carrying JSON frames, with descriptors where sent.

    A frame is a 4-byte big-endian length and a JSON object. Descriptors travel
    as ``SCM_RIGHTS`` on a frame's first bytes; a message with more than
    ``MAX_FDS`` says how many (``nfds``) and the rest follow on frames of their own.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._sending = asyncio.Lock()

    def close(self) -> None:
        self.sock.close()

    def peer(self) -> tuple[int, int, int]:
        """The peer's pid, uid and gid when it connected, as the kernel recorded them."""
        raw = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return pid, uid, gid

    async def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if fds:
            message = {**message, "nfds": len(fds)}
        chunks = [fds[i : i + MAX_FDS] for i in range(0, len(fds), MAX_FDS)] or [()]
        async with self._sending:
            for i, chunk in enumerate(chunks):
                body = json.dumps(message if i == 0 else {"op": "fds"}).encode()
                await self._send_frame(len(body).to_bytes(4, "big") + body, chunk)

    def send_soon(self, message: dict[str, Any]) -> None:
        """Queue ``message`` from synchronous code; frames still go out in order."""
        task = asyncio.get_running_loop().create_task(self.send(message))
        task.add_done_callback(_ignore_result)

    async def _send_frame(self, data: bytes, fds: Sequence[int]) -> None:
        view = memoryview(data)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while view:
            try:
                sent = self.sock.sendmsg([view], ancillary)
            except BlockingIOError:
                await self._ready(writable=True)
                continue
            ancillary = []
            view = view[sent:]

    async def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next message and the descriptors that came with it (the caller closes them)."""
        fds: list[int] = []
        try:
            message = await self._frame(fds)
            wanted = message.get("nfds", 0)
            while isinstance(wanted, int) and len(fds) < wanted:
                await self._frame(fds)
            if len(fds) != wanted:
                raise LauncherError(f"{len(fds)} descriptors arrived where {wanted} were said")
        except BaseException:
            close_all(fds)
            raise
        return message, fds

    async def _frame(self, fds: list[int]) -> dict[str, Any]:
        size = int.from_bytes(await self._read(4, fds), "big")
        if size > MAX_FRAME:
            raise LauncherError(f"a message of {size} bytes is over the {MAX_FRAME} allowed")
        try:
            message = json.loads(await self._read(size, fds))
        except ValueError as exc:
            raise LauncherError(f"a message is not JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise LauncherError("a message is not a JSON object")
        return message

    async def _read(self, size: int, fds: list[int]) -> bytes:
        data = bytearray()
        while len(data) < size:
            try:
                chunk, ancillary, flags, _ = self.sock.recvmsg(
                    size - len(data), socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                await self._ready(writable=False)
                continue
            for level, kind, payload in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    fds.extend(received)
            if flags & socket.MSG_CTRUNC:
                raise LauncherError("descriptors were cut off in transit")
            if not chunk:
                raise EOFError("the connection closed")
            data += chunk
        return bytes(data)

    async def _ready(self, *, writable: bool) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.sock.fileno()
        add, remove = (
            (loop.add_writer, loop.remove_writer)
            if writable
            else (loop.add_reader, loop.remove_reader)
        )

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        add(fd, wake)
        try:
            await ready
        finally:
            remove(fd)


def _ignore_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("a queued message was not sent: %s", task.exception())


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# --- who may be whom ----------------------------------------------------------------------


@dataclass(frozen=True)
class Grants:
    """What this launcher may do, from the root-owned config and the state root's owner."""

    settings: Settings
    server: tuple[int, int]
    """The uid and gid the server runs as: the owner of the state root, and its group."""

    @classmethod
    def load(cls, settings: Settings) -> Grants:
        try:
            st = os.stat(settings.state_root)
        except OSError as exc:
            raise LauncherError(
                f"cannot find the server's uid: {settings.state_root} ({exc.strerror}); "
                "make the state root, owned by the user the server runs as"
            ) from exc
        if st.st_uid == 0:
            raise LauncherError(
                f"{settings.state_root} belongs to root: the launcher serves a server that is "
                "not root (a root server switches uids itself); chown the state root to the "
                "server's user"
            )
        try:
            gid = pwd.getpwuid(st.st_uid).pw_gid
        except KeyError:
            gid = st.st_gid
        return cls(settings, (st.st_uid, gid))

    def role_ids(self, role: object) -> tuple[int, int]:
        """The uid and gid ``role``'s turns run as; refused if the config has no such role."""
        if not isinstance(role, str) or role not in self.settings.roles:
            raise LauncherError(f"role {role!r} is not in {self.settings.config_path}")
        uid, gid = self.settings.role_ids(role)
        if uid == 0 or gid == 0:
            raise LauncherError(f"role {role!r} would run as root; no turn ever does")
        if uid == self.server[0]:
            raise LauncherError(f"role {role!r} has the server's own uid {uid}; give it its own")
        if gid == self.server[1]:
            raise LauncherError(
                f"role {role!r} has the server's group {gid}, which reads the config and every "
                f"workspace; give it a gid of its own ([roles.{role}] gid = ...)"
            )
        return uid, gid

    def checked_ids(self, message: dict[str, Any]) -> tuple[str, int, int]:
        """The role a request names, with the ids the config gives it: they must be the same."""
        role = message.get("role")
        uid, gid = self.role_ids(role)
        if (message.get("uid"), message.get("gid")) != (uid, gid):
            raise LauncherError(
                f"the server planned role {role!r} as uid {message.get('uid')} gid "
                f"{message.get('gid')}, this launcher's config says {uid}:{gid}; restart the "
                "launcher and the server after changing the config"
            )
        return str(role), uid, gid

    def workspaces(self, role: str) -> tuple[str, ...]:
        return tuple(canonical_path(w) for w in self.settings.roles[role].workspaces)


def become(uid: int, gid: int) -> None:
    """Turn this (forked) process into ``uid:gid`` with no supplementary group, for good."""
    if uid == 0 or gid == 0:
        raise LauncherError("refusing to run anything as root")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise LauncherError(f"could not become uid {uid} gid {gid} with no other group")


def as_role(uid: int, gid: int, work: Callable[[], Any], keep: Sequence[int] = ()) -> Any:
    """``work()`` in a forked child running as ``uid:gid``; its JSON-able result.

    The child keeps only stdio and ``keep``: nothing the launcher holds for
    other turns reaches a process of a role.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: it reports through the pipe, never returns
        status = 1
        try:
            _keep_only({0, 1, 2, write, *keep})
            become(uid, gid)
            data = json.dumps({"result": work()}).encode()
            status = 0
        except BaseException as exc:
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        with contextlib.suppress(BaseException):
            _write_all(write, data)
        os._exit(status)
    os.close(write)
    try:
        raw = _read_until_eof(read, HELPER_TIMEOUT_S)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        raise LauncherError(
            f"a helper running as uid {uid} took over {HELPER_TIMEOUT_S:g}s"
        ) from None
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = {}
    if "result" not in reply:
        raise LauncherError(reply.get("error", f"a helper running as uid {uid} died"))
    return reply["result"]


def _keep_only(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        if low < fd:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 2**31 - 1)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def _read_to_end(fd: int, timeout: float) -> bytes:
    """``_read_until_eof`` on the event loop: other connections are served while it waits."""
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    async with asyncio.timeout(timeout):
        while True:
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _settle, readable)
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _read_until_eof(fd: int, timeout: float) -> bytes:
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def check_program(path: object) -> str:
    """The real path of ``path`` if it is a root-owned file in root-owned directories."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise LauncherError(f"argv[0] {path!r} is not an absolute path")
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise LauncherError(f"{path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise LauncherError(f"{path} is not a root-owned file that only root can change")
    directory = posixpath.dirname(real)
    while True:
        st = os.stat(directory)
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise LauncherError(f"{directory} (above {path}) is not root's alone")
        if directory == "/":
            return real
        directory = posixpath.dirname(directory)


# --- one connection -------------------------------------------------------------------------


@dataclass
class Child:
    """The process a connection launched, and the fence's first process once it is named."""

    pid: int
    pidfd: int
    uid: int
    gid: int
    reaper: int | None = None
    reaper_pid: int | None = None
    done: bool = False
    expected: dict[str, str | None] | None = None
    """The turn's protected paths: looked at (as root, changing nothing) once it is reaped."""


class Session:
    """One connection from the server: a turn's process, or one ``home``/``audit``/``hello``."""

    def __init__(self, channel: Channel, grants: Grants, others: Collection[Session]) -> None:
        self.channel = channel
        self.grants = grants
        self.others = others
        """Every connection of the launcher's (this one included): prepared processes are
        counted across them."""
        self.child: Child | None = None
        self.prepared: Prepared | None = None
        self.was_prepared = False
        """A connection that prepared a child launches only through it: its turn's fence
        has no gate, so it is born inside its cgroups or not at all."""

    async def run(self) -> None:
        try:
            while True:
                message, fds = await self.channel.recv()
                try:
                    reply = await self.handle(message, fds)
                except (TargetError, OSError, ValueError, TypeError, KeyError) as exc:
                    reply = {"error": _said(exc), "gone": isinstance(exc, ProcessLookupError)}
                finally:
                    close_all(fds)
                if reply is not None:
                    await self.channel.send(reply)
        except (EOFError, OSError, LauncherError):
            pass  # the server hung up, or spoke garbage: either way the turn goes
        finally:
            self.abandon()

    def abandon(self) -> None:
        """The server is gone, or the launcher stops: its turn must not outlive it."""
        if self.child is not None and not self.child.done:
            self.kill(bwrap=True)
        self._drop_prepared()
        self.channel.close()

    async def handle(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        op = message.get("op")
        if op == "prepare":
            return self.prepare(message)
        if op == "launch":
            return await self.launch(message, fds)
        if op == "fence":
            return self.fence(message)
        if op in ("signal", "kill"):
            # Nobody waits for an answer to these: a problem is the log's.
            try:
                if op == "signal":
                    self.signal(message)
                else:
                    self.kill(bwrap=bool(message.get("bwrap")))
            except (TargetError, OSError) as exc:
                log.warning("%s: %s", op, _said(exc))
            return None
        if op == "home":
            return self.home(message)
        if op == "audit":
            return self.audit(message)
        if op == "hello":
            return {"pid": os.getpid(), "uid": os.getuid(), "version": __version__}
        raise LauncherError(f"unknown request {op!r}")

    # -- a turn's process

    def prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        """Fork the turn's first process ahead of its launch, into the turn's cgroups (named
        by the server, checked as ``fence`` checks them): it is born inside them, and moving
        it there (a grace period of the kernel's) happens before the turn is asked for."""
        if self.child is not None or self.was_prepared:
            raise LauncherError("one launch per connection")
        waiting = sum(1 for other in self.others if other.prepared is not None)
        if waiting >= MAX_PREPARED:
            raise LauncherError(
                f"{waiting} processes wait prepared already, the most a launcher keeps"
            )
        checked = self._turn_cgroups(message.get("cgroups"))
        if not checked:
            raise LauncherError("a prepared process needs the cgroups it is to be born in")
        try:
            self.prepared = Prepared.fork(checked)
        finally:
            close_all(checked)
        self.was_prepared = True
        asyncio.get_running_loop().add_reader(self.prepared.pidfd, self._prepared_ended)
        return {"prepared": self.prepared.pid}

    def _prepared_ended(self) -> None:
        """The prepared child died before its launch (killed, or out of memory in its slot):
        reaped, and the server told, so that it prepares another rather than take this one."""
        if self.prepared is None:
            return
        self._drop_prepared()
        if self.channel.sock.fileno() >= 0:
            self.channel.send_soon({"gone": "the prepared process ended before its launch"})

    def _drop_prepared(self) -> None:
        if self.prepared is not None:
            asyncio.get_running_loop().remove_reader(self.prepared.pidfd)
            self.prepared.discard()
            self.prepared = None

    async def launch(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.child is not None:
            raise LauncherError("one launch per connection")
        role, uid, gid = self.grants.checked_ids(message)
        argv, targets = message.get("argv"), message.get("fds")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise LauncherError("argv must be a list of strings")
        program = check_program(argv[0])
        places = _check_targets(targets, len(fds))
        # The turn's protected paths, looked at when it is reaped (its exit says how they were).
        expected = self._protected(role, message)[1] if "expected" in message else None
        if self.prepared is not None:
            prepared, self.prepared = self.prepared, None
            asyncio.get_running_loop().remove_reader(prepared.pidfd)
            # Awaited: the child runs in cgroups the server owns, which may slow it down (its
            # cpu limit) or stop it; the launcher serves every other connection meanwhile.
            pid = await prepared.start(program, argv, places, fds, uid, gid)
            pidfd = prepared.pidfd
        elif self.was_prepared:
            raise LauncherError("the prepared process ended before its launch")
        else:
            pid = _start(program, argv, places, fds, uid, gid)
            pidfd = os.pidfd_open(pid)
        self.child = Child(pid, pidfd, uid, gid, expected=expected)
        asyncio.get_running_loop().add_reader(self.child.pidfd, self._reap)
        log.info("role %s: started pid %d as uid %d gid %d", role, pid, uid, gid)
        return {"pid": pid, "uid": uid, "gid": gid}

    def _reap(self) -> None:
        child = self.child
        if child is None or child.done:
            return
        asyncio.get_running_loop().remove_reader(child.pidfd)
        _, status = os.waitpid(child.pid, 0)
        child.done = True
        if child.reaper is None:
            # Its sandbox was never named: if bubblewrap's child outlived it, it is this
            # launcher's child now, and dies before the server, told of the end, shuts its gate.
            orphans.end_orphaned_sandboxes()
        else:
            orphans.reap_orphaned_sandboxes()  # the sandbox's first process, handed to us
        close_all([child.pidfd, *([child.reaper] if child.reaper is not None else [])])
        code = os.waitstatus_to_exitcode(status)
        log.info("pid %d (uid %d) ended: %d", child.pid, child.uid, code)
        ended: dict[str, Any] = {"exit": code}
        if child.expected is not None:
            # Nothing of the turn is left (its pid namespace died with bubblewrap's child): as
            # the audit's first look would find them, said now; the server asks only if not.
            ended["clean"] = not audit.deviations(child.expected)
        if self.channel.sock.fileno() >= 0:
            self.channel.send_soon(ended)

    def fence(self, message: dict[str, Any]) -> dict[str, Any]:
        """The fence's first process is up, blocked: hold it, and put it into its cgroups."""
        child = self._running()
        if child.reaper is not None:
            raise LauncherError("the fence was named already")
        pid = message.get("pid")
        if not isinstance(pid, int):
            raise LauncherError("pid must be a number")
        pidfd = os.pidfd_open(pid)
        parent = parent_of(pidfd, pid)
        if parent != child.pid:
            os.close(pidfd)
            if parent is None:
                raise ProcessLookupError(f"pid {pid} is gone")
            raise LauncherError(f"pid {pid} is not a child of this connection's pid {child.pid}")
        child.reaper, child.reaper_pid = pidfd, pid
        self.place(pid, message.get("cgroups", []))
        return {"ok": True}

    def place(self, pid: int, cgroups: object) -> None:
        checked = self._turn_cgroups(cgroups)
        try:
            for fd in checked:
                procs = os.open(
                    "cgroup.procs", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
                try:
                    os.write(procs, f"{pid}\n".encode())
                finally:
                    os.close(procs)
        finally:
            close_all(checked)

    def _turn_cgroups(self, cgroups: object) -> list[int]:
        """``O_PATH`` descriptors of ``cgroups``, each a turn cgroup the server made."""
        if not isinstance(cgroups, list) or not all(isinstance(c, str) for c in cgroups):
            raise LauncherError("cgroups must be a list of paths")
        checked: list[int] = []
        try:
            for path in cgroups:
                checked.append(self._turn_cgroup(path))
        except BaseException:
            close_all(checked)
            raise
        return checked

    def _turn_cgroup(self, path: str) -> int:
        """An ``O_PATH`` descriptor for ``path`` if it is a turn cgroup the server made."""
        mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        inside = any(is_within(path, m.point) and path != m.point for m in mounts)
        if posixpath.normpath(path) != path or not inside:
            raise LauncherError(f"{path} is not a cgroup below a mounted hierarchy")
        if not TURN_CGROUP.fullmatch(posixpath.basename(path)):
            raise LauncherError(f"{path} is not a turn's cgroup")
        fd = open_no_follow(path)
        try:
            parent = os.stat(posixpath.dirname(path), follow_symlinks=False)
            server = self.grants.server[0]
            if os.fstat(fd).st_uid != server or parent.st_uid != server:
                raise LauncherError(f"{path} is not in the server's delegated cgroup")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def signal(self, message: dict[str, Any]) -> None:
        child = self._running()
        signum = message.get("signal")
        if signum not in SIGNALS:
            raise LauncherError(f"signal {signum!r} is not one a turn is sent")
        reaper = child.reaper_pid
        if reaper is None:
            return
        count = as_role(
            child.uid,
            child.gid,
            lambda: signal_namespace(pid_namespace(reaper), reaper, int(signum)),
        )
        log.info("signal %s to %s process(es) of pid %d's fence", signum, count, child.pid)

    def kill(self, *, bwrap: bool) -> None:
        """SIGKILL the fence's reaper (the kernel then kills its whole pid namespace)."""
        child = self.child
        if child is None or child.done:
            return
        with contextlib.suppress(OSError):
            if child.reaper is not None:
                signal.pidfd_send_signal(child.reaper, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if bwrap or child.reaper is None:
                signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)

    def _running(self) -> Child:
        if self.child is None:
            raise LauncherError("nothing was launched on this connection")
        return self.child

    # -- one-shot requests

    def home(self, message: dict[str, Any]) -> dict[str, Any]:
        role, uid, gid = self.grants.checked_ids(message)

        def fix_mode(fd: int, mode: int) -> None:
            # The role's own directory: the role may set its mode, root would need CAP_FOWNER.
            as_role(uid, gid, lambda: os.fchmod(fd, mode), keep=(fd,))

        try:
            repaired = home.prepare_home(
                self.grants.settings.state_root,
                role,
                uid,
                gid,
                server=self.grants.server,
                fix_mode=fix_mode,
            )
        except HomeError as exc:
            return {"error": str(exc)}
        return {"repaired": repaired}

    def audit(self, message: dict[str, Any]) -> dict[str, Any]:
        role, uid, gid = self.grants.checked_ids(message)
        turn_id, expected = self._protected(role, message)
        if not audit.deviations(expected):
            # Looked at as root, changing nothing: the usual end of a turn costs no fork.
            return {"moved": []}
        moved = as_role(uid, gid, lambda: audit.enforce(expected, turn_id))
        return {"moved": moved}

    def _protected(self, role: str, message: dict[str, Any]) -> tuple[str, dict[str, str | None]]:
        """The turn id and the protected paths ``message`` names, each inside the role's
        workspaces (the only paths the audit ever looks at or moves)."""
        turn_id, expected = message.get("turn_id"), message.get("expected")
        if not isinstance(turn_id, str) or not _TURN_ID.fullmatch(turn_id):
            raise LauncherError(f"turn or session id {turn_id!r} is not one paddock makes")
        if not isinstance(expected, dict):
            raise LauncherError("expected must map paths to link targets or null")
        workspaces = self.grants.workspaces(role)
        for path, link in expected.items():
            if not (link is None or isinstance(link, str)):
                raise LauncherError(f"{path}: a link target must be text or null")
            normal = isinstance(path, str) and posixpath.normpath(path) == path
            if not normal or not any(is_within(path, w) and path != w for w in workspaces):
                raise LauncherError(f"{path!r} does not lie inside role {role!r}'s workspaces")
        return turn_id, expected


def _check_targets(targets: object, count: int) -> list[int]:
    """The numbers the sent descriptors must have in the child, once checked."""
    if (
        not isinstance(targets, list)
        or len(targets) != count
        or not all(isinstance(t, int) and 0 <= t < MAX_TARGET_FD for t in targets)
        or len(set(targets)) != len(targets)
        or not {0, 1, 2} <= set(targets)
    ):
        raise LauncherError(
            "fds must give a distinct number below 65536 for each descriptor sent, 0, 1 and 2 "
            "among them"
        )
    return list(targets)


def _said(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    return str(exc)


# --- starting a process as a role -------------------------------------------------------------


def _start(
    program: str, argv: list[str], targets: list[int], fds: list[int], uid: int, gid: int
) -> int:
    """Fork and exec ``argv`` as ``uid:gid``; its pid once the exec has happened."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: it execs, or reports through the pipe
        gc.disable()  # as in a prepared child: no finalizer closes a descriptor of the job's
        _exec_child(program, argv, targets, fds, uid, gid, write)
    os.close(write)
    try:
        failure = _read_until_eof(read, HELPER_TIMEOUT_S)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        failure = b"did not exec in time"
    finally:
        os.close(read)
    if failure:
        os.waitpid(pid, 0)
        raise LauncherError(f"could not start {argv[0]} as uid {uid}: {failure.decode()}")
    return pid


@dataclass
class Prepared:
    """A child forked ahead of its launch: in the turn's cgroups, waiting for its job as root.

    It keeps nothing of the launcher's but its job socket, its two report pipes
    and (until it moved itself) the cgroup directories; it runs nothing until a
    ``launch`` on its connection, checked as any launch is, hands it what to
    execute. Its connection closing kills it, as it kills a launched turn.
    """

    pid: int
    pidfd: int
    jobs: socket.socket
    ready: int
    """Read end: a newline once it is in its cgroups, else why it is not (nothing: it died)."""
    errors: int
    """Read end: nothing once it executed its program (close-on-exec), else why not."""

    @classmethod
    def fork(cls, cgroups: Sequence[int]) -> Prepared:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pipes: list[int] = []
        try:
            pipes += os.pipe()
            pipes += os.pipe()
            ready_read, ready_write, errors_read, errors_write = pipes
            pid = os.fork()
        except BaseException:
            ours.close()
            theirs.close()
            close_all(pipes)
            raise
        if pid == 0:  # the child: waits in its cgroups, then execs or reports; never returns
            _prepared_child(theirs.fileno(), ready_write, errors_write, cgroups)
        theirs.close()
        close_all([ready_write, errors_write])
        try:
            pidfd = os.pidfd_open(pid)
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            ours.close()
            close_all([ready_read, errors_read])
            raise
        return cls(pid, pidfd, ours, ready_read, errors_read)

    async def start(
        self, program: str, argv: list[str], targets: list[int], fds: list[int], uid: int, gid: int
    ) -> int:
        """Hand the (checked) job over; its pid once it executed ``program`` as ``uid:gid``."""
        try:
            placed = await _read_to_end(self.ready, HELPER_TIMEOUT_S)
            if placed != b"\n":
                why = placed.decode(errors="replace").strip() or "it died"
                raise LauncherError(f"the prepared process is not in the turn's cgroups: {why}")
            job = {"program": program, "argv": argv, "targets": targets, "uid": uid, "gid": gid}
            _send_job(self.jobs, job, fds)
            failure = await _read_to_end(self.errors, HELPER_TIMEOUT_S)
            if failure:
                raise LauncherError(f"could not start {argv[0]} as uid {uid}: {failure.decode()}")
        except TimeoutError:
            self.discard()
            raise LauncherError(f"the prepared process did not start {argv[0]} in time") from None
        except BaseException:
            self.discard()
            raise
        close_all([self.ready, self.errors])
        self.jobs.close()
        return self.pid

    def discard(self) -> None:
        """Kill it (it never ran anything of a turn), reap it, and let go of its descriptors."""
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.jobs.close()
        close_all([self.ready, self.errors, self.pidfd])


def _prepared_child(jobs: int, ready: int, errors: int, cgroups: Sequence[int]) -> NoReturn:
    # No collection in the child: finalizing an object of the launcher's it inherited could
    # close a descriptor whose number a job's descriptor has taken since.
    gc.disable()
    try:
        try:
            _keep_only({jobs, ready, errors, *cgroups})
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)  # the launcher's, not a turn's
            me = f"{os.getpid()}\n".encode()
            for directory in cgroups:
                procs = os.open("cgroup.procs", os.O_WRONLY | os.O_NOFOLLOW, dir_fd=directory)
                try:
                    os.write(procs, me)
                finally:
                    os.close(procs)
            close_all(cgroups)
        except BaseException as exc:
            _write_all(ready, f"{type(exc).__name__}: {exc}".encode()[:2000])
            os._exit(127)
        _write_all(ready, b"\n")
        os.close(ready)
        job, fds = _recv_job(socket.socket(fileno=jobs))
        if job is None:
            os._exit(0)  # its connection closed before a launch
        program, argv, targets = job["program"], job["argv"], job["targets"]
        uid, gid = int(job["uid"]), int(job["gid"])
    except BaseException as exc:
        # Said on the pipe the launch reads: its end of file alone would mean "executed".
        with contextlib.suppress(BaseException):
            _write_all(errors, f"{type(exc).__name__}: {exc}".encode()[:2000])
        os._exit(127)
    _exec_child(program, argv, targets, fds, uid, gid, errors)


JOB_HEAD = 64
"""The most a job's message holds: how many descriptors follow. The job itself (argv up to
a frame's size) travels in a memory file, the first descriptor: a datagram that large
would not fit the socket's buffer (EMSGSIZE), and a send that fills it would block."""


def _send_job(sock: socket.socket, job: dict[str, Any], fds: Sequence[int]) -> None:
    written = _memory_file(json.dumps(job).encode())
    try:
        sent = [written, *fds]
        chunks = [sent[i : i + MAX_FDS] for i in range(0, len(sent), MAX_FDS)]
        head = json.dumps({"nfds": len(sent)}).encode()
        for i, chunk in enumerate(chunks):
            socket.send_fds(sock, [head if i == 0 else b"."], list(chunk))
    finally:
        os.close(written)


def _recv_job(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    data, fds, flags, _ = socket.recv_fds(sock, JOB_HEAD, MAX_FDS)
    if not data:
        return None, []
    count = int(json.loads(data)["nfds"])
    while len(fds) < count and not flags & socket.MSG_CTRUNC:
        more, got, flags, _ = socket.recv_fds(sock, 16, MAX_FDS)
        if not more:
            raise EOFError("the job's descriptors did not all arrive")
        fds += got
    if flags & socket.MSG_CTRUNC or len(fds) != count or not fds:
        raise LauncherError("the job's descriptors were cut off")
    written, *given = fds
    with os.fdopen(written, "rb") as job:
        return json.loads(job.read(MAX_FRAME + 1)), given


def _memory_file(data: bytes) -> int:
    fd = os.memfd_create("paddock-job", os.MFD_CLOEXEC)
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _exec_child(
    program: str,
    argv: list[str],
    targets: list[int],
    fds: list[int],
    uid: int,
    gid: int,
    errors: int,
) -> NoReturn:
    try:
        os.setsid()  # a Ctrl-C at the launcher's terminal is not the turn's
        become(uid, gid)
        os.umask(TURN_UMASK)
        errors = _descriptors_in_place(fds, targets, errors)
        for signum in signals.RESTORED_BY_SPAWN:  # ignored by Python; would survive exec
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        with contextlib.suppress(OSError):  # as where a worker thread fails to (``nursery``)
            landlock.confine_thread(program)  # the host's abstract sockets out of reach
        os.chdir("/")
        os.execve(program, argv, EXEC_ENV)  # noqa: S606 - checked root-owned program, no shell
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            os.write(errors, f"{type(exc).__name__}: {exc}".encode()[:2000])
    os._exit(127)


def _descriptors_in_place(fds: list[int], targets: list[int], errors: int) -> int:
    """Each received descriptor at its target number, every other one closed."""
    floor = max([*targets, *fds, errors]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    errors = fcntl.fcntl(errors, fcntl.F_DUPFD_CLOEXEC, floor + len(moved))
    for source, target in zip(moved, targets, strict=True):
        os.dup2(source, target)  # inheritable: it is the child's
    _keep_only({*targets, errors})
    return errors


# --- serving ----------------------------------------------------------------------------------


def listen(path: str, group: int) -> socket.socket:
    """The listening socket at ``path``: root's, mode 0660, group ``group``."""
    directory = posixpath.dirname(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o755)
    untrusted = trust.untrusted_ancestor(directory)
    own = os.stat(directory)
    if untrusted is None and (own.st_uid != 0 or own.st_mode & 0o022):
        untrusted = (directory, "is not root's alone")  # sticky is not enough: names can be taken
    if untrusted is not None:
        where, why = untrusted
        raise LauncherError(f"{where} (above {path}) {why}: someone else could swap the socket")
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    mask = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(mask)
    os.chown(path, 0, group)
    os.chmod(path, 0o660)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _clear_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise LauncherError(f"{path} exists and is not a socket; move it away")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left by a launcher that is gone
            return
    raise LauncherError(f"another launcher already listens on {path}")


async def serve(grants: Grants, path: str) -> None:
    """Accept the server's connections until SIGTERM or SIGINT; then kill every turn."""
    listener = listen(path, grants.server[1])
    bound = os.stat(path)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sessions: set[Session] = set()
    accepting = asyncio.create_task(_accept(listener, grants, sessions))
    log.info("listening on %s for uid %d (pid %d)", path, grants.server[0], os.getpid())
    _notify_ready()
    try:
        await stop.wait()
    finally:
        accepting.cancel()
        for session in list(sessions):
            session.abandon()
        listener.close()
        with contextlib.suppress(OSError):
            if (os.stat(path).st_dev, os.stat(path).st_ino) == (bound.st_dev, bound.st_ino):
                os.unlink(path)
    log.info("stopped")


def _notify_ready() -> None:
    """Say ``READY=1`` where systemd (or paddock-supervise) listens for it, if anywhere."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where.startswith(("/", "@")):
        return
    address = "\0" + where[1:] if where.startswith("@") else where
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
        try:
            notify.sendto(b"READY=1", address)
        except OSError as exc:
            log.warning("could not say READY=1 to %s: %s", where, exc)


async def _accept(listener: socket.socket, grants: Grants, sessions: set[Session]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError as exc:
            if exc.errno not in SHORT_OF:
                raise
            # Out of descriptors or memory for now: connections wait in the backlog, and
            # are taken once turns ending give some back. Never a listener that stopped.
            log.warning("could not accept a connection (%s); trying again", _said(exc))
            await asyncio.sleep(ACCEPT_RETRY_S)
            continue
        channel = Channel(conn)
        pid, uid, _ = channel.peer()
        if uid != grants.server[0]:
            log.warning("refused a connection from pid %d, uid %d", pid, uid)
            refusing = loop.create_task(_refuse(channel, uid, grants.server[0]))
            refusing.add_done_callback(_ignore_result)
            continue
        session = Session(channel, grants, sessions)
        sessions.add(session)
        task = loop.create_task(session.run())
        task.add_done_callback(functools.partial(_forget, sessions, session))


async def _refuse(channel: Channel, uid: int, server: int) -> None:
    with contextlib.suppress(OSError):
        await asyncio.wait_for(
            channel.send({"error": f"uid {uid} is not the server's uid {server}: refused"}), 5
        )
    channel.close()


def main(config: Path) -> int:
    """``paddock-target launcher --config FILE``: serve until stopped; the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.geteuid() != 0:
        print("paddock-target launcher: it must run as root", file=sys.stderr)
        return 2
    try:
        settings = load_settings(config)
        if settings.fence.launcher is None:
            raise LauncherError(f"{config} sets no [fence] launcher socket")
        if settings.fence.identity == "server":
            raise LauncherError(
                f'{config} runs every turn as the server ([fence] identity = "server")'
            )
        grants = Grants.load(settings)
        signals.stop_passing_on_inherited()  # the turns it starts inherit none of them
        orphans.become_subreaper()
        asyncio.run(serve(grants, settings.fence.launcher))
    except (TargetError, OSError) as exc:
        print(f"paddock-target launcher: {exc}", file=sys.stderr)
        return 2
    return 0


def _forget(sessions: set[Session], session: Session, _task: object) -> None:
    sessions.discard(session)
