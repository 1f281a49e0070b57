"""Client connections, bounded: how many may be open, and how long one may take to ask.

A connection costs a descriptor from the moment it is accepted, long before a
request arrives (TLS first, then the head, then the body). Left alone, a client
that opens thousands and never finishes a request takes every descriptor the
server has, and ``/v1/health`` with them. So:

- every accepted connection has ``request_timeout_s`` to deliver a whole
  request (TLS handshake, head and body); one that has not is closed. The clock
  starts again after each response on a kept-alive connection;
- a route that reads a long body at its own pace (a file upload) marks its
  request ``STREAMING`` while it reads; the clock stops, and the route bounds
  the body itself (idle time between chunks, the role's limits);
- at most ``max_connections`` are open. The one past it closes the *oldest*
  connection still sending its request, so a client with a real request gets
  in however many half-sent ones are queued; only if every connection is busy
  serving a request is the newcomer closed instead.

Counting starts at ``accept``, before any TLS, through ``GuardedListener``,
the listening socket uvicorn is given; the HTTP protocol (``guarded_http``,
uvicorn's over httptools) says when a connection's request is whole and when
its response is done.
Closing goes through ``shutdown(SHUT_RDWR)``: the event loop sees the end of
the stream and closes the transport itself, so no descriptor is pulled from
under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from target_side.service.corked import CorkedTransport

log = logging.getLogger("paddock.target.connections")

WRITE_BUFFER_BYTES = 4 << 20
"""What a connection may have queued for the network before the stream writing it waits."""

STREAMING = "paddock.streaming_body"
"""The key a route sets (true) in its request's scope while it streams the body in itself."""

MAX_HEAD_BYTES = 16 << 10
"""A request's line and headers, at most: a head still incomplete past this is refused (431)."""

FD_RESERVE = 256
"""Descriptors kept for everything but client connections: turns' pipes, spools, the ledger."""


@dataclass
class _Open:
    fd: int
    sock: socket.socket
    busy: bool = False
    """A whole request is in and its response not yet done: not evicted, not timed out."""
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class ConnectionGuard:
    """The open connections of one listener, oldest first."""

    def __init__(self, max_connections: int, request_timeout_s: float) -> None:
        self.limit = _within_descriptors(max_connections)
        self.request_timeout_s = request_timeout_s
        self._open: dict[int, _Open] = {}

    @property
    def open(self) -> int:
        """Connections accepted and not yet seen closed (an upper bound between prunes)."""
        return len(self._open)

    def accepted(self, conn: socket.socket) -> None:
        """A new connection: make room for it, and start its request clock."""
        if len(self._open) >= self.limit:
            self._prune()
        if len(self._open) >= self.limit and not self._evict_one():
            log.warning(
                "%d connections, each serving a request ([server] max_connections); "
                "refusing new ones until one ends",
                len(self._open),
            )
            _close(conn)
            return
        fd = conn.fileno()
        self._open.pop(fd, None)  # a stale entry whose descriptor was reused
        entry = _Open(fd, conn)
        self._open[fd] = entry
        self._arm(entry)

    def entry(self, fd: int) -> _Open | None:
        """The connection just accepted on ``fd``, for its protocol to report on (None if it
        was refused, or already closed)."""
        return self._open.get(fd)

    def request_state(self, entry: _Open, busy: bool) -> None:
        """The protocol's word: a whole request is in (``busy``), or it waits for the next one."""
        if self._open.get(entry.fd) is not entry or entry.busy == busy:
            return
        entry.busy = busy
        if busy:
            _cancel(entry)
        else:
            self._arm(entry)

    def closed(self, entry: _Open) -> None:
        # By identity, never by descriptor: TLS reports a connection lost a loop turn after
        # its socket closed, when a new connection may already have its descriptor number.
        _cancel(entry)
        if self._open.get(entry.fd) is entry:
            del self._open[entry.fd]

    def _arm(self, entry: _Open) -> None:
        _cancel(entry)
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(self.request_timeout_s, self._expire, entry)

    def _expire(self, entry: _Open) -> None:
        if self._open.get(entry.fd) is not entry or entry.busy:
            return
        del self._open[entry.fd]
        log.warning(
            "closed a connection that sent no whole request within %g s "
            "([server] request_timeout_s)",
            self.request_timeout_s,
        )
        _close(entry.sock)

    def _prune(self) -> None:
        for fd, entry in list(self._open.items()):
            if entry.sock.fileno() == -1:
                _cancel(entry)
                del self._open[fd]

    def _evict_one(self) -> bool:
        for fd, entry in self._open.items():
            if not entry.busy:
                del self._open[fd]
                _cancel(entry)
                log.warning(
                    "%d connections open ([server] max_connections): closed the oldest one "
                    "still sending its request",
                    self.limit,
                )
                _close(entry.sock)
                return True
        return False


def _cancel(entry: _Open) -> None:
    if entry.timer is not None:
        entry.timer.cancel()
        entry.timer = None


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _within_descriptors(wanted: int) -> int:
    """``wanted``, or fewer if the descriptor limit would not leave room for everything else."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted + FD_RESERVE <= soft:
        return wanted
    allowed = max(16, soft - FD_RESERVE)
    log.warning(
        "[server] max_connections = %d does not fit the descriptor limit (%d); using %d",
        wanted,
        soft,
        allowed,
    )
    return allowed


class GuardedListener(socket.socket):
    """A listening socket that reports every connection it accepts to its guard."""

    def __init__(self, family: int, guard: ConnectionGuard) -> None:
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
        # without it every response waits ~40 ms for a delayed ACK (Nagle).
        super().__init__(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.guard = guard

    def accept(self) -> tuple[socket.socket, Any]:
        conn, address = super().accept()
        self.guard.accepted(conn)
        return conn, address


def guarded_http(guard: ConnectionGuard) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, telling ``guard`` when a request is whole and when it is
    served.

    httptools (llhttp, in C) rather than h11: a kept-alive ``GET /v1/health``
    cost the server 0.93 ms of CPU over h11, 0.66 ms here.
    """

    class GuardedHttpProtocol(HttpToolsProtocol):
        _entry: _Open | None = None
        _whole = 0
        """Requests read to their end on this connection."""
        _answered = 0
        """Responses done on this connection."""
        _in_body = False
        """A request's head is in and its body still coming."""
        _head_bytes = 0
        """Bytes read since the last head ended: the next head, or what came before it."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CorkedTransport(transport, asyncio.get_running_loop()))
            # A turn's output goes out in blocks of up to megabytes: a buffer of 64 KiB (the
            # default) would stop and restart the stream many times per block.
            transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
            sock = transport.get_extra_info("socket")
            self._entry = guard.entry(sock.fileno()) if sock is not None else None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._entry is not None:
                guard.closed(self._entry)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # The parser keeps a head whole until it ends, however long: heads are fed at
            # most MAX_HEAD_BYTES at a time, and one not ended by then is refused.
            start = 0
            while start < len(data) and not self.transport.is_closing():
                end = len(data)
                if not self._in_body:
                    end = min(end, start + MAX_HEAD_BYTES - self._head_bytes)
                    self._head_bytes += end - start
                super().data_received(data[start:end] if (start, end) != (0, len(data)) else data)
                start = end
                if not self._in_body and self._head_bytes >= MAX_HEAD_BYTES:
                    self._refuse_head()
                    return
            self._report()

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._in_body = True
            self._head_bytes = 0

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_body = False
            self._whole += 1

        def on_response_complete(self) -> None:
            self._answered += 1
            super().on_response_complete()
            self._report()

        def _refuse_head(self) -> None:
            if self.cycle is None or self.cycle.response_complete:
                said = f"the request's line and headers are longer than {MAX_HEAD_BYTES} bytes"
                self.transport.write(_plain_answer(431, "Request Header Fields Too Large", said))
            # Else a response is on its way, and a second one cannot be written across it.
            self.transport.close()

        def _report(self) -> None:
            # A request read whole and not yet answered: busy. One still arriving (head
            # or body) keeps the clock running, unless its route streams the body itself.
            waiting = self._whole > self._answered
            streaming = self._in_body and bool(self.scope and self.scope.get(STREAMING))
            if self._entry is not None:
                guard.request_state(self._entry, waiting or streaming)

    return GuardedHttpProtocol


def _plain_answer(status: int, reason: str, said: str) -> bytes:
    """A whole HTTP/1.1 answer, closing the connection, with ``said`` as its text."""
    body = f"{said}\n".encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
