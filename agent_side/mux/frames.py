"""The multiplexer's protocol: a JSON object on one line, then as many raw bytes as it says.

    {"t": "stdout", "size": 5}\\nhello

Every message has ``t`` (its kind) or, the first from a client, ``op``; one
with ``"size": N`` is followed by exactly N bytes (output, stdin), which are
never put through JSON. The kinds each side sends are listed in
``agent_side.mux``'s docstring. Standard library only: the client side of
``paddock run`` loads nothing else.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from agent_side.errors import ProtocolError

PROTOCOL = 1
"""Sent with every request; a daemon of another version answers with an error, not garbage."""
MAX_LINE = 16 * 1024 * 1024
"""Bounds one JSON line (a request carries the command and its environment)."""
MAX_DATA = 16 * 1024 * 1024
"""Bounds the raw bytes after one line."""

Message = dict[str, Any]


class Channel:
    """One end of a multiplexer connection; ``send`` may be called from several threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._sending = threading.Lock()

    def send(self, message: Message, data: bytes = b"") -> None:
        """Send one message (and ``data`` after it); ``OSError`` when the peer has gone."""
        if data:
            message = {**message, "size": len(data)}
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._sending:
            self.sock.sendall(line + data if len(data) < 65536 else line)
            if len(data) >= 65536:
                self.sock.sendall(data)

    def receive(self) -> tuple[Message, bytes] | None:
        """The next message and its bytes; None when the peer closed the connection."""
        line = self._reader.readline(MAX_LINE + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            raise ProtocolError("a multiplexer message was cut short or is too long")
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"a multiplexer message is not JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise ProtocolError("a multiplexer message is not a JSON object")
        size = message.get("size", 0)
        if not isinstance(size, int) or not 0 <= size <= MAX_DATA:
            raise ProtocolError(f"a multiplexer message announces {size!r} bytes")
        data = self._reader.read(size) if size else b""
        if len(data) != size:
            raise ProtocolError("the multiplexer connection ended inside a message")
        return message, data

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self.sock.close()
