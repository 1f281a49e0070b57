"""An ASGI middleware that refuses request bodies over a size limit before anything parses them.

Routes in ``STREAMED`` take bodies larger than that (file uploads) and bound them
themselves, by the role's own limit, once they know the role.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

STREAMED = frozenset({("PUT", "/v1/files"), ("PUT", "/v1/archive")})
"""Method and path of the routes that stream their bodies and bound them themselves."""


class BodyLimit:
    """Answer 413 (problem+json) for a body over ``max_bytes``, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in STREAMED:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        seen = 0
        started = rejected = False

        async def counting_receive() -> Message:
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not rejected:
                    rejected = True
                    if not started:
                        await self._reject(send)
                    # The app sees a client that went away, and answers no one.
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception:
            if not rejected:
                raise

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            {
                "type": "about:blank",
                "title": "Request body too large",
                "status": 413,
                "detail": f"the body is over {self.max_bytes} bytes; send a smaller request",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/problem+json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
