"""A TCP forwarder on 127.0.0.1 that can cut every connection through it on demand.

The resume benchmark points a client at it and calls ``cut()`` mid-stream: both
ends of each live connection are shut down and closed, as a dropped link that
the kernel notices (RST or FIN) looks to the client. ``accepted`` counts the
connections made so far, so a caller can tell an event that came over a new
connection from one still buffered from the old.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

PUMP_BYTES = 64 * 1024
ACCEPT_POLL_S = 0.2


class CuttingProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:upstream_port``; ``cut()`` drops everything."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.accepted = 0
        self._spawn(self._accept)

    def cut(self) -> None:
        """Shut down and close both ends of every connection open now."""
        with self._lock:
            live, self._live = self._live, set()
        for sock in live:
            _close(sock)

    def close(self) -> None:
        """Stop accepting, cut what is open, and wait for every pump thread."""
        self._stop.set()
        self.cut()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._upstream))
            except OSError:
                _close(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._live.update((client, upstream))
                self.accepted += 1
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(PUMP_BYTES):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._live.difference_update((source, sink))
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@contextlib.contextmanager
def cutting_proxy(upstream_port: int) -> Iterator[CuttingProxy]:
    """A ``CuttingProxy`` in front of ``upstream_port``, closed on leaving."""
    proxy = CuttingProxy(upstream_port)
    try:
        yield proxy
    finally:
        proxy.close()
