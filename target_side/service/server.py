"""Running the app under uvicorn: in the foreground (``serve``) or on a thread (embedded).

The embedded form serves ``paddock run --local`` and the tests: a real uvicorn
with real TLS on a loopback port the kernel picks.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn

from target_side.config import Settings
from target_side.errors import TargetError

START_TIMEOUT_S = 15.0


def uvicorn_config(settings: Settings, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn configuration for ``settings``: TLS when configured, no proxy headers."""
    from target_side.service.app import create_app

    server = settings.server
    return uvicorn.Config(
        create_app(settings),
        host=server.host,
        port=server.port,
        ssl_certfile=server.tls_cert,
        ssl_keyfile=server.tls_key,
        log_level=log_level,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=5,
    )


def serve(settings: Settings) -> None:
    """Serve in the foreground until interrupted."""
    uvicorn.Server(uvicorn_config(settings)).run()


class ServerThread:
    """A uvicorn server on its own thread, bound before it starts so its port is known.

    Use as a context manager; leaving it stops the server and every turn it runs.
    """

    def __init__(self, settings: Settings, log_level: str = "warning") -> None:
        self._config = uvicorn_config(settings, log_level)
        self._server = uvicorn.Server(self._config)
        family = socket.AF_INET6 if ":" in settings.server.host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((settings.server.host, settings.server.port))
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            daemon=True,
            name="paddock-target",
        )
        self._scheme = "https" if settings.server.tls_cert else "http"

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
        self._thread.join(timeout=START_TIMEOUT_S)
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
