"""``paddock run``'s side of the multiplexer: find (or start) the daemon, then relay one turn.

The command line is read here exactly as without the multiplexer (the same
``request_options`` and ``resolve_connection``), so a mistake in it is the
same error before anything is contacted. The daemon then opens the target,
submits, follows and resumes; this process only copies what it is sent to
its stdout and stderr, counts Ctrl-C and TERM as ``paddock run`` always has
(INT, then KILL, then stop waiting; TERM sends KILL, a second stops waiting),
forwards stdin, and exits with the status it is sent.

Standard library only, besides paddock's own light modules: no httpx, no
pydantic, no paramiko, no asyncio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

from agent_side import errors
from agent_side.connection import resolve_connection
from agent_side.errors import AgentError
from agent_side.mux.frames import PROTOCOL, Channel, Message
from agent_side.mux.paths import (
    MuxDir,
    MuxUnavailable,
    check_peer,
    check_socket_file,
    default_dir,
)
from agent_side.mux.settings import NO_MUX_VARIABLE, persist_seconds
from agent_side.request_options import request_options
from agent_side.route import Route, route_of
from agent_side.stdio import (
    BROKEN_PIPE,
    Interrupts,
    StopWaiting,
    silence_stdout,
    stdin_fd,
    stdin_is_terminal,
    write,
)
from agent_side.views import say

FAILED_MARK = b"paddock mux: failed"
"""What a daemon that could not start leaves in its log."""
STDIN_CHUNK = 64 * 1024
STDIN_WINDOW = 4
"""Stdin chunks in flight before the daemon acknowledges one: bounds what it buffers."""
SIGNAL_GRACE_S = 5.0


def wanted(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """Whether this ``paddock run`` goes through the multiplexer."""
    if args.no_mux or args.local or not sys.platform.startswith("linux"):
        return False
    if getattr(args, "tty", False):
        return False  # a terminal turn is driven from this process (agent_side.terminal)
    return environ.get(NO_MUX_VARIABLE, "") in ("", "0")


def run(args: argparse.Namespace, environ: Mapping[str, str], in_process: Callable[[], int]) -> int:
    """Run the turn through the multiplexer, or with ``in_process`` when none serves it yet.

    When none serves this target yet, the turn runs in-process at once
    (rather than wait for a daemon to load, as the first ``ssh`` with
    ControlMaster=auto does its own work), and a daemon is started after it,
    for the runs to come, so that it does not compete with this one. When
    none can be used at all, the turn runs in-process with a note saying why.
    A socket or directory that could be someone else's raises ``MuxUnsafe``:
    that is refused, not worked around.
    """
    options = request_options(args, environ, None)
    connection = resolve_connection(args, environ)
    route = route_of(args, connection).absolute()
    identity = mux_identity(route, environ)
    forward = not args.no_stdin
    stdin_open = forward and stdin_fd() is not None
    request: Message = {
        "op": "run",
        "protocol": PROTOCOL,
        "route": identity,
        "token": connection.token,
        "role": connection.role,
        "passphrase": environ.get("PADDOCK_SSH_PASSPHRASE"),
        "can_prompt": _can_prompt(),
        "persist": persist_seconds(args, environ),
        "options": {
            "argv": list(options.argv),
            "cwd": options.cwd,
            "env": dict(options.env),
            "read": list(options.read),
            "write": list(options.write),
            "network": options.network,
            "wall_s": options.wall_s,
            "lease": options.lease,
            "session": options.session,
        },
        "stdin": "open" if stdin_open else "closed",
        "stdin_note": forward and not stdin_open and stdin_is_terminal(),
        "json": bool(args.json),
        # Where this user's cursors live (the daemon keeps the one for this turn).
        "cursor": {
            "name": getattr(args, "target_name", None),
            "ssh": getattr(args, "ssh", None),
            "environ": {k: environ.get(k) for k in ("XDG_STATE_HOME", "HOME")},
        },
    }
    try:
        mux_dir = MuxDir.open(default_dir(environ))
    except MuxUnavailable as exc:
        return _without(exc, in_process)
    with mux_dir:
        name = daemon_name(identity)
        channel = _accepted(mux_dir, name, request)
        if channel is None:
            status = in_process()
            # Only after a run that reached the target: a daemon would not serve a failing one.
            try:
                _start_for_next_time(mux_dir, name, request["persist"], environ)
            except MuxUnavailable as exc:
                say(f"note: {exc}")
            return status
    return Session(channel, stdin_open=stdin_open).relay()


def _without(exc: MuxUnavailable, in_process: Callable[[], int]) -> int:
    say(f"note: {exc}; running without the multiplexer (--no-mux skips this)")
    return in_process()


def mux_identity(route: Route, environ: Mapping[str, str]) -> dict[str, object]:
    """The route's identity, and which paddock serves it.

    A paddock installed anew (its package directory rewritten) gets daemons
    of its own: one still running the old code is left to leave when idle.
    """
    package = os.path.dirname(os.path.abspath(errors.__file__))
    code = f"{sys.executable}:{package}:{os.stat(package).st_mtime_ns}"
    return {**route.identity(environ), "paddock": code, "protocol": PROTOCOL}


def daemon_name(identity: Mapping[str, object]) -> str:
    """The socket's NAME: a hash of the route's identity (which holds no secret)."""
    import json

    from agent_side.sha256 import sha256_hex

    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return sha256_hex(text.encode())[:32]


def _accepted(mux_dir: MuxDir, name: str, request: Message) -> Channel | None:
    """A connection to the daemon for ``name`` that has accepted ``request``; None if none.

    A daemon that closes the connection before accepting (it was leaving,
    idle) has done nothing with it: that counts as none.
    """
    for _attempt in range(2):
        sock = connect(mux_dir, name)
        if sock is None:
            return None
        channel = Channel(sock)
        try:
            channel.send(request)
            reply = channel.receive()
        except OSError:
            reply = None
        if reply is not None:
            message, _ = reply
            if message.get("t") == "accepted":
                return channel
            channel.close()
            raise _error_of(message)
        channel.close()
    return None


def connect(mux_dir: MuxDir, name: str) -> socket.socket | None:
    """A connection to the daemon serving ``name``; None if there is none (or only a stale socket).

    ``MuxUnsafe`` when the socket or the process behind it is not ours.
    """
    info = mux_dir.lstat(name)
    if info is None:
        return None
    shown = mux_dir.shown(name)
    check_socket_file(shown, info)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(mux_dir.address(name))
        check_peer(shown, sock)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None  # the daemon died: its replacement removes the socket and binds anew
    except BaseException:
        sock.close()
        raise
    return sock


def start_daemon(mux_dir: MuxDir, name: str, persist: float, environ: Mapping[str, str]) -> int:
    """Start ``paddock mux serve NAME`` in a session of its own; returns the pid to reap.

    That process forks at once and leaves (``--detach``), so the daemon is
    adopted by init, not left a child of a process that may live on. Its
    environment is ours without any ``PADDOCK_*`` variable: the token and a
    passphrase reach it over the socket, per request, and nowhere else.
    """
    argv = [sys.executable, "-m", "agent_side.cli", "mux", "serve", "--detach"]
    argv += ["--persist", f"{persist:g}", "--dir", mux_dir.path, name]
    env = {k: v for k, v in environ.items() if not k.startswith("PADDOCK_")}
    log = mux_dir.open_file(name, ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        return os.posix_spawn(
            sys.executable,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_DUP2, log, 2),
            ],
            setsid=True,
        )
    except OSError as exc:
        raise MuxUnavailable(f"cannot start the multiplexer: {exc}") from exc
    finally:
        os.close(log)


def _start_for_next_time(
    mux_dir: MuxDir, name: str, persist: float, environ: Mapping[str, str]
) -> None:
    """Start the daemon and leave it to load; say so if the last one could not start."""
    info = mux_dir.lstat(name, ".log")
    if info is not None and 0 < info.st_size <= 1 << 20:
        log = mux_dir.open_file(name, ".log", os.O_RDONLY)
        with os.fdopen(log, "rb") as text:
            if FAILED_MARK in text.read():
                say(
                    f"note: the multiplexer for this target failed last time (its log: "
                    f"{mux_dir.shown(name, '.log')}); starting it again"
                )
    starter = start_daemon(mux_dir, name, persist, environ)
    # Reaped at once: the process forks the daemon off and leaves.
    threading.Thread(target=os.waitpid, args=(starter, 0), daemon=True).start()


def _can_prompt() -> bool:
    """Whether a passphrase could be asked for here (as ``ssh.interactive_passphrase`` would)."""
    if sys.stdin is None or not stdin_is_terminal():
        return False
    try:
        with open("/dev/tty", "rb"):
            return True
    except OSError:
        return False


def _error_of(message: Message) -> AgentError:
    """The ``AgentError`` the daemon reported, as its own class when this side knows it."""
    kind = _error_classes().get(str(message.get("type")), AgentError)
    return kind(str(message.get("message", "the multiplexer failed without saying why")))


def _error_classes() -> dict[str, type[AgentError]]:
    found: dict[str, type[AgentError]] = {}
    pending: list[type[AgentError]] = [errors.AgentError]
    while pending:
        kind = pending.pop()
        found[kind.__name__] = kind
        pending.extend(kind.__subclasses__())
    return found


class Session:
    """One accepted turn: copy what the daemon sends, and send it our signals and stdin."""

    def __init__(self, channel: Channel, *, stdin_open: bool) -> None:
        self._channel = channel
        self._stdin_open = stdin_open
        self._credits = threading.Semaphore(STDIN_WINDOW)
        self._interrupts = Interrupts(self._send_signal)
        self._sending: list[threading.Thread] = []
        self._signals_sent = 0
        self._signals_done = 0
        self._counting = threading.Lock()
        self.pipe_broken = False

    def relay(self) -> int:
        """Copy the turn's output until its status arrives; returns the status to exit with."""
        try:
            with self._interrupts.installed():
                if self._stdin_open:
                    feed = threading.Thread(
                        target=self._feed_stdin, daemon=True, name="paddock-stdin"
                    )
                    feed.start()
                try:
                    return self._copy()
                except StopWaiting:
                    self._settle_signals()
                    raise
        finally:
            for thread in self._sending:
                thread.join(SIGNAL_GRACE_S)
            self._channel.close()

    def _copy(self) -> int:
        while True:
            received = self._channel.receive()
            if received is None:
                raise errors.ConnectionDropped(
                    "the multiplexer went away mid-turn (stopped or killed); the turn may "
                    "still be running on the target ('paddock turns' lists it)"
                )
            message, data = received
            kind = message.get("t")
            if kind == "stdout":
                self._stdout(data)
            elif kind == "stderr":
                write(sys.stderr, data)
            elif kind == "say":
                say(str(message.get("text", "")))
            elif kind == "seq":
                self._delivered(int(message.get("seq", 0)))
            elif kind == "ack":
                self._credits.release()
            elif kind == "signal-done":
                self._signals_done += 1
            elif kind == "passphrase":
                self._answer_passphrase(str(message.get("path", "")))
            elif kind == "exit":
                status = int(message.get("status", 125))
                return BROKEN_PIPE if self.pipe_broken else status
            elif kind == "error":
                raise _error_of(message)

    def _settle_signals(self) -> None:
        """Giving up: first let the signals already sent reach the turn, and say so.

        The multiplexer reports each one when it has been posted; output that
        comes meanwhile is no longer shown, as without the multiplexer.
        """
        for thread in self._sending:
            thread.join(SIGNAL_GRACE_S)
        deadline = time.monotonic() + SIGNAL_GRACE_S
        with contextlib.suppress(OSError, AgentError):
            while self._signals_done < self._signals_sent:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._channel.sock.settimeout(left)
                received = self._channel.receive()
                if received is None:
                    return
                message, _ = received
                kind = message.get("t")
                if kind == "say":
                    say(str(message.get("text", "")))
                elif kind == "signal-done":
                    self._signals_done += 1
                elif kind in ("exit", "error"):
                    return

    def _delivered(self, seq: int) -> None:
        """What came before this frame is on our stdout and stderr: say so to the daemon."""
        if self.pipe_broken:
            return  # nobody read it: it was not delivered
        with contextlib.suppress(OSError):
            self._channel.send({"t": "delivered", "seq": seq})

    def _stdout(self, data: bytes) -> None:
        if self.pipe_broken:
            return
        try:
            write(sys.stdout, data)
        except BrokenPipeError:
            # Like SIGPIPE for a local pipeline: nobody reads on, so stop the producer.
            self.pipe_broken = True
            silence_stdout()
            self._send_signal("TERM", quiet=True)

    def _answer_passphrase(self, path: str) -> None:
        import getpass

        try:
            secret: str | None = getpass.getpass(f"Passphrase for key {path}: ")
        except (OSError, EOFError):
            secret = None
        self._channel.send({"t": "passphrase", "value": secret})

    def _feed_stdin(self) -> None:
        # Read errors end the copy without closing the turn's stdin, as without the multiplexer.
        try:
            while True:
                self._credits.acquire()
                chunk = os.read(0, STDIN_CHUNK)
                if not chunk:
                    break
                self._channel.send({"t": "stdin"}, chunk)
            self._channel.send({"t": "stdin-eof"})
        except (OSError, ValueError):
            return

    # -- signals: the handlers only count and decide; a thread does the sending -----------

    def _send_signal(self, name: str, *, quiet: bool = False) -> None:
        thread = threading.Thread(
            target=self._post_signal, args=(name, quiet), daemon=True, name="paddock-signal"
        )
        self._sending.append(thread)
        thread.start()

    def _post_signal(self, name: str, quiet: bool) -> None:
        try:
            self._channel.send({"t": "signal", "name": name, "quiet": quiet})
        except OSError:
            return  # the daemon is gone; the copy loop says so
        with self._counting:
            self._signals_sent += 1
