"""An event stream ends when its client leaves, and only then (target_side.service.event_stream).

The response is driven as uvicorn drives it: ``receive`` says ``http.disconnect``
when the client has gone, and also once the response is complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from target_side.service.event_stream import EventStreamResponse


class Peer:
    """The server's side of one request: what was sent, and a way to leave."""

    def __init__(self, settle_after_end: bool = False) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.first_chunk = asyncio.Event()
        self.settle_after_end = settle_after_end
        """Yield once more after the response's end (as a middleware's send may), then note it."""
        self.settled = False

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message.get("body"):
            self.first_chunk.set()
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.gone.set()  # as uvicorn: once the response is complete, receive says so
            if self.settle_after_end:
                await asyncio.sleep(0.01)
                self.settled = True


def _stream(closed: list[str], chunks: int | None) -> AsyncIterator[bytes]:
    """``chunks`` chunks, then the end; None: one, then waits for ever, as a running turn's."""

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"started"
            for _ in range(chunks or 0):
                yield b"output"
            if chunks is None:
                await asyncio.Event().wait()
        finally:
            closed.append("closed")

    return events()


async def _served(response: EventStreamResponse, peer: Peer) -> int:
    """Serve ``response`` as a request's task does; how many cancellations are left pending."""
    await response({"type": "http"}, peer.receive, peer.send)
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling()


async def test_a_client_that_leaves_ends_the_stream_and_nothing_fails() -> None:
    peer, closed = Peer(), []
    task = asyncio.create_task(_served(EventStreamResponse(_stream(closed, None)), peer))
    await asyncio.wait_for(peer.first_chunk.wait(), 5)
    peer.gone.set()
    # Returns, with no cancellation left pending: nothing reaches the server as one.
    assert await asyncio.wait_for(task, 5) == 0
    assert closed == ["closed"]


async def test_a_stream_that_ends_leaves_its_task_running_on() -> None:
    """The "disconnect" that follows a complete response cancels nothing after it."""
    peer, closed = Peer(settle_after_end=True), []
    response = EventStreamResponse(_stream(closed, 3))

    async def request() -> str:
        assert await _served(response, peer) == 0
        await asyncio.sleep(0.05)  # what the server does after the response, untouched
        return "served"

    assert await asyncio.wait_for(request(), 5) == "served"
    assert peer.settled  # the send that ended the response was not cut short either
    bodies = [m["body"] for m in peer.sent if m["type"] == "http.response.body"]
    assert bodies == [b"started", b"output", b"output", b"output", b""]


async def test_a_stream_cancelled_from_outside_stays_cancelled() -> None:
    """The server stopping cancels the request: that is not a client leaving."""
    peer, closed = Peer(), []
    response = EventStreamResponse(_stream(closed, None))
    task = asyncio.create_task(response({"type": "http"}, peer.receive, peer.send))
    await asyncio.wait_for(peer.first_chunk.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == ["closed"]
