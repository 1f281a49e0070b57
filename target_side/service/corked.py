"""A connection's writes of one event-loop pass, sent to the network together.

An HTTP response leaves uvicorn in several writes: its head, then each body
chunk, then (for a chunked body) its end, each written to the transport as
soon as it is made. Behind TLS each write is a record of its own and a
``send`` of its own, and the client wakes up for each. A ``true`` turn's
stream was four of them: the head, the ``started`` event, the exit event and
the end of the body, the last two written back to back. ``CorkedTransport``
keeps what is written during one pass of the event loop and hands it on in
one write at the start of the next, so writes made together leave together
and a write never waits longer than the callbacks already queued.

What is held is bounded (``HELD_BYTES``: beyond it, it goes at once), so the
real transport's buffer, and the flow control the protocol gets from it, see
every byte within one pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

HELD_BYTES = 64 << 10
"""Held at most; more goes to the network at once (a turn's output comes in bigger blocks)."""


class CorkedTransport(asyncio.Transport):
    """``transport``, with the writes of one loop pass joined into one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._size = 0
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._held.append(bytes(data))
        self._size += len(data)
        if self._size >= HELD_BYTES:
            self.flush()
        elif self._flush is None:
            self._flush = self._loop.call_soon(self.flush)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Hand on whatever is held (nothing once the connection is closing)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        held, self._held, self._size = self._held, [], 0
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held, self._size = [], 0
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()
