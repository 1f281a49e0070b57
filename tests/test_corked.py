"""A connection's writes of one event-loop pass leave together (target_side.service.corked),
over a real socket pair and the event loop's own transport."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from target_side.service.corked import HELD_BYTES, CorkedTransport


@dataclass
class Wire:
    corked: CorkedTransport
    transport: asyncio.Transport
    peer: socket.socket
    writes: list[bytes] = field(default_factory=list)
    """What reached the real transport, write by write."""

    def received(self) -> bytes:
        self.peer.settimeout(5)
        chunks = []
        while True:
            chunk = self.peer.recv(1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


@pytest.fixture
async def wire() -> AsyncIterator[Wire]:
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    found = Wire(CorkedTransport(transport, loop), transport, peer)
    real_write = transport.write

    def counted(data: bytes | bytearray | memoryview) -> None:
        found.writes.append(bytes(data))
        real_write(data)

    transport.write = counted  # type: ignore[method-assign]
    yield found
    transport.abort()
    peer.close()


async def test_writes_of_one_pass_reach_the_network_as_one(wire: Wire) -> None:
    parts = (b"HTTP/1.1 200 OK\r\n\r\n", b"5\r\nhello\r\n", b"0\r\n\r\n")
    for part in parts:
        wire.corked.write(part)
    assert wire.writes == []
    assert wire.corked.get_write_buffer_size() == sum(map(len, parts))
    await asyncio.sleep(0)
    assert wire.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]
    wire.corked.write(b"next")
    await asyncio.sleep(0)
    assert wire.writes[1:] == [b"next"]


async def test_more_than_it_holds_goes_at_once(wire: Wire) -> None:
    wire.corked.write(b"a")
    wire.corked.write(b"b" * HELD_BYTES)
    assert wire.writes == [b"a" + b"b" * HELD_BYTES]
    await asyncio.sleep(0)
    assert len(wire.writes) == 1


async def test_close_sends_what_is_held_first(wire: Wire) -> None:
    wire.corked.writelines([b"last ", b"words"])
    wire.corked.close()
    await asyncio.sleep(0.05)
    assert wire.received() == b"last words"


@pytest.mark.parametrize("ending", ["abort", "closed"])
async def test_what_is_held_is_dropped_once_the_connection_is_going(
    wire: Wire, ending: str
) -> None:
    # Aborted through the cork, or closed under it: nothing more may reach the network.
    wire.corked.write(b"never sent")
    if ending == "abort":
        wire.corked.abort()
    else:
        wire.transport.close()
    await asyncio.sleep(0.05)
    assert wire.writes == []
    assert wire.received() == b""
