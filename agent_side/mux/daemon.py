"""``paddock mux serve NAME``: the background process that keeps one target's connections warm.

Started by the first ``paddock run`` for a target (``client.start_daemon``),
it takes ``NAME.lock`` (a second daemon for the same NAME leaves at once),
binds ``NAME.sock`` before loading anything heavy (so that run can connect at
once), then serves each connection on its own thread:

    op "run"     the request is checked (same uid, same route as NAME), a
                 ``Target`` is opened or reused (one per token; for SSH one
                 paramiko connection under it), and the turn is run with the
                 same ``drive``, ``Sink`` and ``SignalForwarder`` as without the
                 multiplexer, its output sent back as frames
    op "status"  pid, route, clients, idle time
    op "stop"    stop listening and remove the socket at once; leave when the
                 turns still running have ended

It leaves by itself after ``persist`` seconds with no client (each run's
``--mux-persist`` sets it), on SIGTERM, or on ``stop``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from agent_side.errors import AgentError, UsageError
from agent_side.mux.client import daemon_name
from agent_side.mux.frames import PROTOCOL, Channel, Message
from agent_side.mux.paths import MuxDir, peer_uid
from agent_side.mux.settings import DEFAULT_PERSIST_S
from agent_side.route import Route
from agent_side.sha256 import sha256_hex

if TYPE_CHECKING:
    from agent_side.api import Target

ACCEPT_POLL_S = 0.5
"""How often the accept loop looks at the idle clock and for a stop."""
LOCK_WAIT_S = 15.0
"""How long a new daemon waits for one that is leaving to let go of NAME."""


def serve(
    directory: str, name: str, persist: float = DEFAULT_PERSIST_S, *, detach: bool = False
) -> int:
    """Serve NAME until idle for ``persist`` seconds; 0 also when another daemon already does.

    ``detach``: fork first and let the parent leave, so that whoever started
    this process can reap it at once and the daemon belongs to no one.
    """
    if detach and os.fork() > 0:
        os._exit(0)
    os.chdir("/")  # hold no directory of whoever started us
    try:
        return _serve(directory, name, persist)
    except BaseException as exc:
        # The next paddock run reads this line and says the start failed.
        _log("failed:\n" + "".join(traceback.format_exception(exc)))
        raise


def _serve(directory: str, name: str, persist: float) -> int:
    mux_dir = MuxDir.open(directory)
    lock = mux_dir.open_file(name, ".lock", os.O_RDWR | os.O_CREAT)
    if not _take_lock(lock, mux_dir, name):
        return 0  # another daemon serves NAME: this one is not needed
    listener = _bind(mux_dir, name)
    _log(f"serving {mux_dir.shown(name)} (pid {os.getpid()})")
    # Loaded after binding: a client waiting to connect need not wait for these too.
    from agent_side.mux import relay  # noqa: F401

    daemon = Daemon(mux_dir, name, listener, persist)
    signal.signal(signal.SIGTERM, daemon.on_sigterm)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        daemon.serve_forever()
    finally:
        daemon.close()
        os.close(lock)
    return 0


def _take_lock(lock: int, mux_dir: MuxDir, name: str) -> bool:
    """Hold NAME's lock; False if another daemon holds it and answers on NAME's socket.

    A holder that does not answer is leaving (stopped, or idle): it has let go
    of the socket and will let go of the lock within moments, so it is waited for.
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if _answers(mux_dir, name) or time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _answers(mux_dir: MuxDir, name: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.connect(mux_dir.address(name))
        except OSError:
            return False
    return True


def _bind(mux_dir: MuxDir, name: str) -> socket.socket:
    """Listen on NAME.sock, replacing a dead daemon's socket; only ours can connect (0600)."""
    mux_dir.unlink(name)  # we hold the lock: any socket there is a dead daemon's
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    previous = os.umask(0o177)
    try:
        listener.bind(mux_dir.address(name))
    finally:
        os.umask(previous)
    listener.listen(64)
    listener.settimeout(ACCEPT_POLL_S)
    return listener


def _log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} paddock mux: {line}", file=sys.stderr, flush=True)


class Daemon:
    """The accept loop, the clients being served, and the targets kept open for them."""

    def __init__(self, mux_dir: MuxDir, name: str, listener: socket.socket, persist: float) -> None:
        self._dir = mux_dir
        self._name = name
        self._listener: socket.socket | None = listener
        self._socket_inode = mux_dir.lstat(name)
        self.persist = persist
        self._lock = threading.Lock()
        self._clients = 0
        self._last_active = time.monotonic()
        self._started = time.time()
        self._stopping = False
        self._terminated = False
        self._targets = Targets()
        self._route: str | None = None
        self._runs = 0

    def serve_forever(self) -> None:
        while not self._leaving():
            listener = self._listener
            if listener is None:
                time.sleep(ACCEPT_POLL_S)
                continue
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._listener is None:
                    continue  # closed by stop
                raise
            sock.settimeout(None)
            with self._lock:
                self._clients += 1
            threading.Thread(target=self._serve_client, args=(sock,), daemon=True).start()

    def _leaving(self) -> bool:
        with self._lock:
            idle = time.monotonic() - self._last_active
            if self._terminated:
                why = "terminated"
            elif self._clients:
                return False
            elif self._stopping:
                why = "stopped"
            elif idle >= self.persist:
                why = f"idle for {idle:.0f} s"
            elif self._runs and not self._targets.count():
                # Nothing to keep warm (the target could not be opened): no reason to stay.
                why = "no target open"
            else:
                return False
            _log(f"{why}; leaving")
            self._stop_listening_locked()
            return True

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # No lock here: the handler runs between bytecodes of whatever holds it.
        self._terminated = True  # unlike stop, TERM does not wait for running turns

    def stop(self) -> None:
        """Stop listening now (a new run starts a new daemon); leave once no client is left."""
        with self._lock:
            self._stopping = True
            self._stop_listening_locked()

    def _stop_listening_locked(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        # Only our own socket is removed: a new daemon may already have replaced it.
        if _same_file(self._dir.lstat(self._name), self._socket_inode):
            self._dir.unlink(self._name)
        listener.close()

    def close(self) -> None:
        with self._lock:
            self._stop_listening_locked()
        self._targets.close()

    def status(self) -> Message:
        with self._lock:
            others = self._clients - 1  # not counting the one asking
            idle = 0.0 if others else time.monotonic() - self._last_active
            return {
                "t": "status",
                "pid": os.getpid(),
                "name": self._name,
                "clients": others,
                "idle_s": round(idle, 1),
                "persist_s": self.persist,
                "targets": self._targets.count(),
                "up_s": round(time.time() - self._started, 1),
                "route": self._route or "(no run yet)",
            }

    def _serve_client(self, sock: socket.socket) -> None:
        channel = Channel(sock)
        try:
            # The socket is ours alone (0600 in a 0700 directory); this holds even if not.
            if peer_uid(sock) != os.getuid():
                _log(f"refused a client running as uid {peer_uid(sock)}")
                return
            received = channel.receive()
            if received is None:
                return
            message, _ = received
            self._dispatch(channel, message)
        except (OSError, AgentError) as exc:
            _log(f"a client connection ended: {type(exc).__name__}")
        except Exception as exc:
            # A defect here must not take the other clients down; this one is told.
            _log("failed serving a client:\n" + "".join(traceback.format_exception(exc)))
            _send_error(channel, AgentError(f"the multiplexer failed: {type(exc).__name__}: {exc}"))
        finally:
            channel.close()
            with self._lock:
                self._clients = max(0, self._clients - 1)
                self._last_active = time.monotonic()

    def _dispatch(self, channel: Channel, message: Message) -> None:
        op = message.get("op")
        if message.get("protocol", PROTOCOL) != PROTOCOL:
            _send_error(channel, UsageError("this multiplexer speaks another protocol version"))
        elif op == "status":
            channel.send(self.status())
        elif op == "stop":
            self.stop()
            channel.send({"t": "stopped", "pid": os.getpid()})
        elif op == "run":
            self._run(channel, message)
        else:
            _send_error(channel, UsageError(f"unknown multiplexer operation {op!r}"))

    def _run(self, channel: Channel, message: Message) -> None:
        from agent_side.mux.relay import relay_turn

        identity = message.get("route")
        if not isinstance(identity, dict) or daemon_name(identity) != self._name:
            _send_error(channel, UsageError("this multiplexer serves another target"))
            return
        persist = message.get("persist")
        if isinstance(persist, int | float) and persist > 0:
            self.persist = float(persist)
        channel.send({"t": "accepted"})
        with self._lock:
            self._runs += 1
        try:
            route = Route.from_identity(identity)
            self._route = route.describe()
            with _asking(channel, message):
                target = self._targets.get(route, message.get("token"))
            relay_turn(target, channel, message)
        except AgentError as exc:
            _send_error(channel, exc)


def _same_file(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _send_error(channel: Channel, exc: AgentError) -> None:
    with contextlib.suppress(OSError):
        channel.send({"t": "error", "type": type(exc).__name__, "message": str(exc)})


# -- passphrases: asked of the client whose request needs one --------------------------

_asker = threading.local()


@contextlib.contextmanager
def _asking(channel: Channel, message: Message) -> Iterator[None]:
    """While the block runs on this thread, a key's passphrase comes from this client."""
    given = message.get("passphrase")

    def passphrase(path: str) -> str | None:
        if isinstance(given, str):
            return given
        if not message.get("can_prompt"):
            return None
        channel.send({"t": "passphrase", "path": path})
        reply = channel.receive()
        value = reply[0].get("value") if reply is not None else None
        return value if isinstance(value, str) else None

    _asker.source = passphrase
    try:
        yield
    finally:
        _asker.source = None


def _current_passphrase(path: str) -> str | None:
    source: Callable[[str], str | None] | None = getattr(_asker, "source", None)
    return source(path) if source is not None else None


class Targets:
    """One open ``Target`` per token, made on first use, kept until the daemon leaves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Target] = {}
        self._opening: dict[str, threading.Lock] = {}

    def get(self, route: Route, token: object) -> Target:
        if token is not None and not isinstance(token, str):
            raise UsageError("the token must be text")
        key = sha256_hex((token or "").encode())
        with self._lock:
            opening = self._opening.setdefault(key, threading.Lock())
        with opening:
            with self._lock:
                found = self._open.get(key)
            if found is not None:
                return found
            # Opened without a role: each request names its own, or the token's only one is used.
            target = route.open(token=token, role=None, passphrase=_current_passphrase)
            with self._lock:
                self._open[key] = target
            return target

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        with self._lock:
            targets, self._open = list(self._open.values()), {}
        for target in targets:
            with contextlib.suppress(Exception):
                target.close()
