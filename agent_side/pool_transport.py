"""An httpx transport over an httpcore pool with a network backend of the caller's choosing.

    PoolTransport(backend)              httpx.BaseTransport, for ``TargetClient(transport=...)``
     └── httpcore.ConnectionPool(network_backend=HeldWritesBackend(backend))
          └── HeldWritesStream          a request's writes leave together, at its first read

httpx's own ``HTTPTransport`` takes no network backend, so this does what it
does (build an ``httpcore.Request``, map httpcore's exceptions onto httpx's)
around a pool that takes one: plain TCP for a target reached directly, SSH
channels for one reached through a tunnel (``agent_side.tunnel``).

httpcore writes a request's head and its body separately, and behind TLS each
write is a record and a ``send`` of its own; the target wakes for each, and
reads the body one pass of its event loop after the head. A stream here holds
what is written until the connection is next read from (the request is whole
by then), up to ``HELD_BYTES``: alternated against the two writes, a turn of
``true`` 0.97x at p50 and the target's event loop 0.97x of its CPU.
"""

from __future__ import annotations

import contextlib
import select
import ssl
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)
"""httpx's own client's: what a target reached directly had before this transport."""
HELD_BYTES = 64 << 10
"""Held at most: a bigger body (an upload) goes out as it is written, block by block."""

_HTTPCORE_TO_HTTPX: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    # Most specific first: the first match wins.
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


class HeldWritesStream(httpcore.NetworkStream):
    """``inner``, with what is written held until the next read (or ``HELD_BYTES``)."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._size = 0
        self._timeout: float | None = None
        self._records = _RecordsReady.of(inner.get_extra_info("socket"))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._size += len(buffer)
        self._timeout = timeout
        if self._size >= HELD_BYTES:
            self._send()

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            # As httpcore does when a request cannot be written whole: go on to read the
            # answer, which a target that stopped reading may have sent (a 413), or the end.
            with contextlib.suppress(httpcore.WriteError):
                self._send()
        data = self._inner.read(max_bytes, timeout)
        if self._records is None or not data or len(data) >= max_bytes:
            return data
        parts, size = [data], len(data)
        while size < max_bytes and self._records.ready():
            more = self._inner.read(max_bytes - size, timeout)
            if not more:
                break
            parts.append(more)
            size += len(more)
        return data if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._held, self._size = [], 0
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        self._send()
        return HeldWritesStream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    def _send(self) -> None:
        held, self._held, self._size = self._held, [], 0
        if held:
            self._inner.write(held[0] if len(held) == 1 else b"".join(held), self._timeout)


class _RecordsReady:
    """Whether a TLS socket can hand over another record without waiting for the network."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    @classmethod
    def of(cls, sock: object) -> _RecordsReady | None:
        return cls(sock) if isinstance(sock, ssl.SSLSocket) else None

    def ready(self) -> bool:
        return self._sock.pending() > 0 or bool(self._poll.poll(0))


class HeldWritesBackend(httpcore.NetworkBackend):
    """``inner``'s connections, each a ``HeldWritesStream``."""

    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return HeldWritesStream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        return HeldWritesStream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class PoolTransport(httpx.BaseTransport):
    """An httpx transport whose connections ``network_backend`` opens, kept for reuse."""

    def __init__(
        self,
        network_backend: httpcore.NetworkBackend,
        *,
        ssl_context: ssl.SSLContext | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        self.limits = limits or DEFAULT_LIMITS
        """How many connections the pool opens, and keeps open for reuse."""
        self.network_backend = network_backend
        """How this transport opens connections, for ``TargetClient``'s scheme probe."""
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            max_connections=self.limits.max_connections,
            max_keepalive_connections=self.limits.max_keepalive_connections,
            keepalive_expiry=self.limits.keepalive_expiry,
            network_backend=HeldWritesBackend(network_backend),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not isinstance(request.stream, httpx.SyncByteStream):
            raise TypeError("this transport serves httpx.Client, not httpx.AsyncClient")
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _mapped_httpcore_errors():
            response = self._pool.handle_request(core_request)
        if not isinstance(response.stream, Iterable):  # a sync pool answers with a sync stream
            raise TypeError("httpcore answered a synchronous request with an async stream")
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._pool.close()


class _ResponseStream(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _mapped_httpcore_errors():
            yield from self._stream

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


@contextlib.contextmanager
def _mapped_httpcore_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core_type, httpx_type in _HTTPCORE_TO_HTTPX:
            if isinstance(exc, core_type):
                raise httpx_type(str(exc)) from exc
        raise
