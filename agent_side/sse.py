"""An incremental Server-Sent Events decoder (WHATWG HTML, "Parsing an event stream").

Fed raw bytes in whatever chunks the network delivers, it yields the same events
however the stream was split. Lines end only at CRLF, LF or CR: ``str.splitlines``
(and so ``httpx.Response.iter_lines``) also splits at U+2028 and friends, which
JSON leaves unescaped inside a ``data:`` line, and would tear an event in two.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from agent_side.errors import ProtocolError

MAX_EVENT_CHARS = 16 * 1024 * 1024
"""Bounds one line and one event's data, so a broken stream cannot exhaust memory."""

_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event; ``id`` is the stream's last event id when it was dispatched."""

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry: int | None = None


class _LineSplitter:
    """Splits text into lines at CRLF, LF or CR, across chunk boundaries.

    Only the new text is scanned; an unfinished line is kept in pieces and
    joined once, so a long line arriving in many chunks costs linear time.
    """

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._partial_chars = 0
        # A chunk ending in CR ends a line at once; an LF opening the next chunk
        # is that CR's other half, not an empty line (which would dispatch early).
        self._swallow_lf = False

    def feed(self, text: str) -> list[str]:
        if not text:
            return []
        if self._swallow_lf and text.startswith("\n"):
            text = text[1:]
        self._swallow_lf = False
        lines: list[str] = []
        start = 0
        for match in _LINE_END.finditer(text):
            lines.append(self._finish(text[start : match.start()]))
            start = match.end()
        if start and text[start - 1] == "\r" and start == len(text):
            self._swallow_lf = True
        if start < len(text):
            self._pieces.append(text[start:])
            self._partial_chars += len(text) - start
        if self._partial_chars > MAX_EVENT_CHARS:
            raise ProtocolError(f"an event-stream line exceeds {MAX_EVENT_CHARS} characters")
        return lines

    def _finish(self, tail: str) -> str:
        if not self._pieces:
            return tail
        line = "".join([*self._pieces, tail])
        self._pieces, self._partial_chars = [], 0
        return line


class SSEDecoder:
    """Turns event-stream bytes into ``ServerSentEvent`` values, one chunk at a time."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lines = _LineSplitter()
        self._at_start = True
        self._event = ""
        self._data: list[str] = []
        self._data_chars = 0
        self._last_id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Events completed by ``chunk`` (possibly none)."""
        text = self._text.decode(chunk)
        if self._at_start and text:
            self._at_start = False
            text = text.removeprefix("\ufeff")
        events: list[ServerSentEvent] = []
        for line in self._lines.feed(text):
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> None:
        """End of stream: an event not closed by a blank line is discarded, as the spec says."""
        self._text.decode(b"", final=True)
        self._event, self._data, self._data_chars = "", [], 0

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        self._field(name, value.removeprefix(" "))
        return None

    def _field(self, name: str, value: str) -> None:
        if name == "event":
            self._event = value
        elif name == "data":
            self._data_chars += len(value) + 1
            if self._data_chars > MAX_EVENT_CHARS:
                raise ProtocolError(f"an event's data exceeds {MAX_EVENT_CHARS} characters")
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)

    def _dispatch(self) -> ServerSentEvent | None:
        data, event = self._data, self._event
        self._event, self._data, self._data_chars = "", [], 0
        if not data:
            return None
        return ServerSentEvent(
            event=event or "message", data="\n".join(data), id=self._last_id, retry=self._retry
        )


def iter_sse(chunks: Iterable[bytes]) -> Iterator[ServerSentEvent]:
    """The events in a byte stream, yielded as soon as each is complete."""
    decoder = SSEDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)
    decoder.close()
