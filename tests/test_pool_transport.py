"""A request's writes leave together (agent_side.pool_transport): over a real TCP connection,
through httpcore's own stream, counted where they reach it."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import httpcore
import pytest
import trustme

from agent_side.client import TargetClient
from agent_side.pool_transport import HELD_BYTES, HeldWritesStream, PoolTransport


class Counted(httpcore.NetworkStream):
    """A real stream, its writes counted (and the next ones refused, when told to)."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self.inner = inner
        self.writes: list[bytes] = []
        self.refuse = False

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self.refuse:
            raise httpcore.WriteError("the peer stopped reading")
        self.writes.append(buffer)
        self.inner.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, timeout)

    def close(self) -> None:
        self.inner.close()

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return self.inner.start_tls(ssl_context, server_hostname, timeout)


@pytest.fixture
def held() -> Iterator[tuple[HeldWritesStream, Counted, socket.socket]]:
    """A held stream over a real connection, the stream under it, and the peer's end."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        counted = Counted(httpcore.SyncBackend().connect_tcp("127.0.0.1", port, timeout=5))
        peer, _ = listener.accept()
        with peer:
            peer.settimeout(5)
            yield HeldWritesStream(counted), counted, peer
        counted.close()


def _received(peer: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += peer.recv(size - len(data))
    return data


def test_a_requests_head_and_body_leave_in_one_write_when_its_answer_is_read(
    held: tuple[HeldWritesStream, Counted, socket.socket],
) -> None:
    stream, counted, peer = held
    stream.write(b"POST /v1/turns HTTP/1.1\r\nContent-Length: 2\r\n\r\n")
    stream.write(b"{}")
    assert counted.writes == []  # held: the request may not be whole yet
    peer.sendall(b"answer")
    assert stream.read(64, timeout=5) == b"answer"
    assert counted.writes == [b"POST /v1/turns HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"]
    assert _received(peer, len(counted.writes[0])) == counted.writes[0]


def test_a_body_bigger_than_what_is_held_goes_out_as_it_is_written(
    held: tuple[HeldWritesStream, Counted, socket.socket],
) -> None:
    stream, counted, peer = held
    stream.write(b"head\r\n\r\n")
    block = b"x" * HELD_BYTES
    stream.write(block)
    assert counted.writes == [b"head\r\n\r\n" + block]  # before any read: never all held
    assert _received(peer, len(counted.writes[0])) == counted.writes[0]


def test_a_request_the_peer_would_not_take_still_lets_its_answer_be_read(
    held: tuple[HeldWritesStream, Counted, socket.socket],
) -> None:
    """As httpcore does for a write that fails: the answer (a 413, say) is read all the same."""
    stream, counted, peer = held
    stream.write(b"PUT /v1/files HTTP/1.1\r\n\r\n")
    counted.refuse = True
    peer.sendall(b"HTTP/1.1 413 Request body too large\r\n")
    assert stream.read(64, timeout=5).startswith(b"HTTP/1.1 413")


@pytest.fixture
def tls(held: tuple[HeldWritesStream, Counted, socket.socket]) -> Iterator[tuple[Any, Any]]:
    """The held stream after a real TLS handshake (a trustme CA), and the peer's TLS end."""
    stream, _, peer = held
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    ends: list[ssl.SSLSocket] = []
    handshake = threading.Thread(target=lambda: ends.append(server.wrap_socket(peer, True)))
    handshake.start()
    secure = stream.start_tls(client, "127.0.0.1", timeout=5)
    handshake.join()
    with ends[0]:
        yield secure, ends[0]
    secure.close()


def test_records_already_here_are_read_together(tls: tuple[Any, ssl.SSLSocket]) -> None:
    """A TLS socket hands over one record a read: an output stream of a hundred MiB was
    12,800 trips through httpcore and h11. Records already here come in one read."""
    stream, peer = tls
    for n in range(5):
        peer.sendall(bytes([n]) * 1000)  # a record each
    wanted = b"".join(bytes([n]) * 1000 for n in range(5))
    assert stream.read(65536, timeout=5) == wanted


def test_a_read_never_waits_for_records_not_sent(tls: tuple[Any, ssl.SSLSocket]) -> None:
    stream, peer = tls
    peer.sendall(b"x" * 1000)
    assert stream.read(65536, timeout=5) == b"x" * 1000  # at once: no ReadTimeout
    peer.sendall(b"y" * 3000)
    assert stream.read(2000, timeout=5) == b"y" * 2000  # never more than asked
    assert stream.read(2000, timeout=5) == b"y" * 1000


def test_a_target_reached_directly_keeps_httpxs_own_connection_limits() -> None:
    """At most 100 connections, 20 kept for reuse, as httpx's own transport had: a pool
    without a bound would open one per thread however many threads ask at once."""
    with TargetClient("http://127.0.0.1:9", None) as client:
        transport = client._http._transport
        assert isinstance(transport, PoolTransport)
        assert (transport.limits.max_connections, transport.limits.max_keepalive_connections) == (
            100,
            20,
        )
