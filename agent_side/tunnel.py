"""HTTP over SSH channels: an httpx transport whose connections are ``direct-tcpip`` channels.

    SshTransport(connection)            a ``PoolTransport``, for ``TargetClient(transport=...)``
     └── httpcore.ConnectionPool(network_backend=SshNetworkBackend(connection))
          └── ChannelStream             one channel = one HTTP/1.1 connection
               └── TlsStream            when the listener speaks HTTPS (TLS inside the channel)

Only public interfaces are used: httpcore's ``NetworkBackend``/``NetworkStream``
and httpx's ``BaseTransport`` (``agent_side.pool_transport``). No port is
opened on this machine: the SSH server connects to the listener itself.
"""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import httpcore
import httpx
import paramiko

from agent_side.errors import AgentError
from agent_side.pool_transport import PoolTransport
from agent_side.ssh import SshConnection

_T = TypeVar("_T")

CHANNEL_READ_BYTES = 1024 * 1024
"""Each read takes up to this much from the channel, however little httpcore asks for.

paramiko's channel buffer moves all its unread bytes on every read; with a
full window, reading 64 KiB at a time spends more time moving than receiving.
"""

TLS_RECORD_BYTES = 16 * 1024 + 512
"""Largest TLS record on the wire (RFC 8446, 5.2): one read always makes progress."""


class ChannelStream(httpcore.NetworkStream):
    """One SSH channel as the byte stream httpcore runs HTTP/1.1 over."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel
        self._pending = b""
        self._offset = 0

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        # b"" at end of stream, which is also what a channel closed by a dropped
        # connection returns: httpcore then sees a peer that hung up mid-response.
        if self._offset >= len(self._pending):
            self._pending, self._offset = self._recv(timeout), 0
        data = self._pending[self._offset : self._offset + max_bytes]
        self._offset += len(data)
        return data

    def _recv(self, timeout: float | None) -> bytes:
        try:
            self._channel.settimeout(timeout)
            data: bytes = self._channel.recv(CHANNEL_READ_BYTES)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(f"no data on the SSH channel for {timeout} s") from exc
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise httpcore.ReadError(f"the SSH channel broke: {exc}") from exc
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._channel.settimeout(timeout)
            self._channel.sendall(buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(f"the SSH channel took no data for {timeout} s") from exc
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise httpcore.WriteError(f"the SSH channel broke: {exc}") from exc

    def close(self) -> None:
        self._channel.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return TlsStream(self, ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # An idle pooled connection with something to read has been closed by
            # the server (or lost with the SSH connection): the pool must drop it.
            channel = self._channel
            unread = self._offset < len(self._pending)
            return unread or channel.recv_ready() or channel.eof_received or channel.closed
        return None


class TlsStream(httpcore.NetworkStream):
    """TLS over another ``NetworkStream``, through memory BIOs (an SSL socket needs an fd)."""

    def __init__(
        self,
        inner: httpcore.NetworkStream,
        context: ssl.SSLContext,
        server_hostname: str | None,
        timeout: float | None,
    ) -> None:
        self._inner = inner
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_hostname=server_hostname
        )
        try:
            self._pump(self._tls.do_handshake, timeout)
        except ssl.SSLError as exc:
            inner.close()
            raise httpcore.ConnectError(f"TLS handshake failed: {exc}") from exc
        except httpcore.NetworkError as exc:
            inner.close()
            raise httpcore.ConnectError(f"TLS handshake failed: {exc}") from exc

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            data = self._pump(lambda: self._tls.read(max_bytes), timeout)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return b""  # the peer closed; HTTP framing tells a complete response from a cut one
        except ssl.SSLError as exc:
            raise httpcore.ReadError(f"TLS failed: {exc}") from exc
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        try:
            while view:
                written = self._pump(functools.partial(self._tls.write, view), timeout)
                view = view[written:]
        except ssl.SSLError as exc:
            raise httpcore.WriteError(f"TLS failed: {exc}") from exc

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return TlsStream(self, ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._tls
        if info == "is_readable":
            return self._tls.pending() > 0 or self._inner.get_extra_info("is_readable")
        return None

    def _pump(self, operation: Callable[[], _T], timeout: float | None) -> _T:
        """Run a TLS operation, moving records between the BIOs and the inner stream."""
        while True:
            try:
                result = operation()
            except ssl.SSLWantReadError:
                self._flush(timeout)
                data = self._inner.read(TLS_RECORD_BYTES, timeout)
                if data:
                    self._incoming.write(data)
                else:
                    self._incoming.write_eof()
                continue
            self._flush(timeout)
            return result

    def _flush(self, timeout: float | None) -> None:
        pending = self._outgoing.read()
        if pending:
            self._inner.write(pending, timeout)


class SshNetworkBackend(httpcore.NetworkBackend):
    """Opens each TCP connection httpcore asks for as a channel of one SSH connection."""

    def __init__(self, connection: SshConnection) -> None:
        self._connection = connection

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            channel = self._connection.open_channel(host, port, timeout)
        except AgentError as exc:
            # httpcore only knows its own errors; the precise one rides along as the
            # cause and errors.map_transport_error hands it on to the caller.
            raise httpcore.ConnectError(str(exc)) from exc
        return ChannelStream(channel)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol("a target is reached over SSH by TCP, not a socket")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class SshTransport(PoolTransport):
    """An httpx transport that sends every request through one ``SshConnection``.

    The pool keeps HTTP connections (channels) open for reuse like httpx's own
    transport does; the SSH connection belongs to the caller and outlives it.
    """

    def __init__(
        self,
        connection: SshConnection,
        *,
        ssl_context: ssl.SSLContext | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        super().__init__(
            SshNetworkBackend(connection),
            ssl_context=ssl_context,
            limits=limits or httpx.Limits(max_connections=20, max_keepalive_connections=5),
        )
