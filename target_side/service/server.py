"""Running the app under uvicorn: in the foreground (``serve``) or on a thread (embedded).

The embedded form serves ``paddock run --local`` and the tests: a real uvicorn
with real TLS on a loopback port the kernel picks.

Either way the listening socket is bound here and handed to uvicorn, so that
every connection is counted from ``accept`` (``connections``), and the server
stops in the order a supervisor can rely on (``TargetServer.shutdown``).
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import threading
import time
from types import TracebackType
from typing import cast

import uvicorn
from fastapi import FastAPI

from target_side.config import Settings
from target_side.errors import TargetError
from target_side.fence import orphans, signals
from target_side.service.connections import ConnectionGuard, GuardedListener, guarded_http
from target_side.service.log_repeats import collapse_repeats
from target_side.service.log_writer import LogWriters, every_logger
from target_side.service.state_lock import StateLock

log = logging.getLogger("paddock.target")

START_TIMEOUT_S = 15.0
GRACEFUL_CLOSE_S = 5
"""After the turns: how long open connections get to finish their last response."""


def uvicorn_config(
    settings: Settings,
    log_level: str = "info",
    guard: ConnectionGuard | None = None,
    state_lock: StateLock | None = None,
) -> uvicorn.Config:
    """The uvicorn configuration for ``settings``: TLS when configured, no proxy headers."""
    from target_side.service.app import create_app

    server = settings.server
    guard = guard or ConnectionGuard(server.max_connections, server.request_timeout_s)
    return uvicorn.Config(
        create_app(settings, state_lock=state_lock),
        host=server.host,
        port=server.port,
        ssl_certfile=server.tls_cert,
        ssl_keyfile=server.tls_key,
        http=guarded_http(guard),
        ws="none",
        # Never uvloop, which uvicorn's "auto" takes wherever it is installed (uvicorn[standard]
        # brings it): the fence hands descriptors between the loop and the threads that start
        # bubblewrap, and under uvloop a burst of turns met closed descriptors
        # ("could not start bubblewrap: Bad file descriptor") and once the server's end.
        loop="asyncio",
        log_level=log_level,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
    )


class TargetServer(uvicorn.Server):
    """uvicorn, stopping in order: no new connection, turns ended and recorded, then the rest.

    uvicorn alone would wait a few seconds for open connections (event streams
    of running turns never close by themselves) and then cut them. Here the
    turns end first (within ``[server] stop_grace_s``, killed and recorded after
    it), so every stream gets its terminal event and closes; only then does
    uvicorn close connections and run the app's shutdown, which gives up the
    state root's lock last.
    """

    def __init__(self, config: uvicorn.Config, settings: Settings) -> None:
        super().__init__(config)
        self._settings = settings

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listening in getattr(self, "servers", []):
            listening.close()
        # The app this server was made with (uvicorn types it as any ASGI app).
        manager = cast(FastAPI, self.config.app).state.manager
        await manager.stop(self._settings.server.stop_grace_s, hurry=lambda: self.force_exit)
        await super().shutdown(sockets)


def listen(settings: Settings, guard: ConnectionGuard) -> GuardedListener:
    """The bound (not yet listening) socket of ``[server] listen``."""
    family = socket.AF_INET6 if ":" in settings.server.host else socket.AF_INET
    sock = GuardedListener(family, guard)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.server.host, settings.server.port))
    except OSError as exc:
        sock.close()
        raise TargetError(f"cannot listen on {settings.server.listen}: {exc.strerror}") from exc
    return sock


def serve(settings: Settings) -> None:
    """Serve in the foreground until SIGTERM or SIGINT, holding the state root throughout.

    The lock comes before the port: a second server on a busy state root says
    whose it is, not that the port is taken.
    """
    collapse_repeats()
    kept = signals.stop_passing_on_inherited()
    # The process is the target's own here (not an embedder's): a sandbox orphaned before
    # it was held comes back to it, to be killed (``fence.orphans``).
    orphans.become_subreaper()
    lock = StateLock.acquire(settings.state_root, settings.server.listen)
    try:
        server = settings.server
        guard = ConnectionGuard(server.max_connections, server.request_timeout_s)
        sock = listen(settings, guard)
        scheme = "https" if server.tls_cert else "http"
        log.info("paddock target on %s://%s, state in %s", scheme, server.listen, server.state_root)
        if kept:
            names = ", ".join(signal.Signals(signum).name for signum in kept)
            log.info("inherited ignored or blocked, still here but not in turns: %s", names)
        config = uvicorn_config(settings, guard=guard, state_lock=lock)
        target = TargetServer(config, settings)
        # Once uvicorn has set up its loggers: theirs too.
        writers = LogWriters(every_logger())
        # What exists now (modules, the app, its models) lives as long as the process: the
        # collector's full passes need not walk it again. A burst of 200 turns brought about
        # two, each holding up every turn for up to 100 ms (30 ms once this is left out).
        gc.freeze()
        try:
            target.run(sockets=[sock])
        finally:
            writers.stop()
    finally:
        lock.release()


class ServerThread:
    """A uvicorn server on its own thread, bound before it starts so its port is known.

    Use as a context manager; leaving it stops the server and every turn it runs.
    """

    def __init__(self, settings: Settings, log_level: str = "warning") -> None:
        collapse_repeats()
        server = settings.server
        guard = ConnectionGuard(server.max_connections, server.request_timeout_s)
        self._config = uvicorn_config(settings, log_level, guard)
        self._server = TargetServer(self._config, settings)
        self._socket = listen(settings, guard)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="paddock-target")
        self._scheme = "https" if server.tls_cert else "http"
        self._stop_s = START_TIMEOUT_S + server.stop_grace_s

    def _serve(self) -> None:
        # Every thread the server starts inherits this one's mask, and every fence theirs:
        # what its host process has blocked (the CLI's, in ``paddock run --local``) stays there.
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        self._server.run(sockets=[self._socket])

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        host = self._socket.getsockname()[0]
        shown = f"[{host}]" if ":" in host else host
        return f"{self._scheme}://{shown}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._socket.close()
                raise TargetError(f"the embedded target did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=self._stop_s)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
