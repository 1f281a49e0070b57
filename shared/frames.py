"""The frame stream: a turn's events as the target spools them (docs/api.md, "Frames").

``GET /v1/turns/{id}/events`` with ``Accept: application/x-paddock-frames``
answers a turn's events as frames, the bytes of its spool as they lie on disk:
output is the bytes the turn wrote, unescaped and unencoded, so text, NUL
bytes and bytes that are not UTF-8 cost the same, and neither side parses or
re-encodes a chunk of output. Each frame is a fixed header and a payload:

    kind    u8     1 started, 2 stdout, 3 stderr, 4 exit, 5 refused, 6 notice;
                   0 is a heartbeat (only on the wire, seq 0, no payload)
    -       3 bytes, zero
    length  u32    the payload's size in bytes
    seq     u64    the event's seq (1, 2, 3, ... per turn)
    at      i64    when it happened: microseconds since the Unix epoch, UTC

all big-endian (24 bytes), then ``length`` bytes of payload: for ``stdout`` and
``stderr`` the output itself, for every other kind the ``Event`` as JSON (the
same JSON the event stream's ``data:`` line carries; a terminal event also
carries the ended ``turn``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

MEDIA_TYPE = "application/x-paddock-frames"
HEADER = struct.Struct(">B3xIQq")
MAX_PAYLOAD = 16 * 1024 * 1024
"""No frame the target writes is larger; a reader refuses one that says it is."""

KIND_CODES = {"started": 1, "stdout": 2, "stderr": 3, "exit": 4, "refused": 5, "notice": 6}
KINDS = {code: kind for kind, code in KIND_CODES.items()}
HEARTBEAT = 0
OUTPUT_CODES = frozenset({KIND_CODES["stdout"], KIND_CODES["stderr"]})

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class FrameError(ValueError):
    """Bytes that are not a frame where one must be."""


def encode_header(kind: str, seq: int, at_us: int, length: int) -> bytes:
    return HEADER.pack(KIND_CODES[kind], length, seq, at_us)


def heartbeat() -> bytes:
    return HEADER.pack(HEARTBEAT, 0, 0, 0)


def micros(at: datetime) -> int:
    """``at`` as microseconds since the epoch (exactly: no float on the way)."""
    delta = at - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def moment(at_us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=at_us)


@dataclass(frozen=True)
class Frame:
    """One frame: its kind's name (``heartbeat`` for code 0), seq, time and payload."""

    kind: str
    seq: int
    at_us: int
    payload: bytes

    @property
    def is_output(self) -> bool:
        return self.kind in ("stdout", "stderr")


def header_of(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int, int, int]:
    """(kind code, length, seq, at) of the header at ``offset``; ``FrameError`` if not one."""
    code, length, seq, at_us = HEADER.unpack_from(data, offset)
    if code != HEARTBEAT and code not in KINDS:
        raise FrameError(f"a frame of unknown kind {code}")
    if length > MAX_PAYLOAD:
        raise FrameError(f"a frame of {length} bytes, more than {MAX_PAYLOAD}")
    return code, length, seq, at_us


class FrameDecoder:
    """Splits a byte stream, in whatever chunks it arrives, into frames (heartbeats dropped).

    A payload is copied once, from the chunks it came in to the frame's bytes:
    output frames run to a mebibyte and arrive in pieces of a few TLS records,
    and a buffer grown piece by piece would copy each one again as it grew.
    """

    def __init__(self) -> None:
        self._head = bytearray()
        """A header's first bytes, while fewer than ``HEADER.size`` came."""
        self._frame: tuple[int, int, int, int] | None = None
        """The header whose payload is still coming: (code, length, seq, at_us)."""
        self._parts: list[memoryview] = []
        self._got = 0

    def feed(self, chunk: bytes) -> list[Frame]:
        frames: list[Frame] = []
        view = memoryview(chunk)
        position, size = 0, len(view)
        while position < size:
            if self._frame is None:
                position = self._take_header(view, position)
                if self._frame is None:
                    break
            code, length, seq, at_us = self._frame
            take = min(length - self._got, size - position)
            self._parts.append(view[position : position + take])
            self._got += take
            position += take
            if self._got < length:
                break
            payload = b"".join(self._parts)
            self._frame, self._parts, self._got = None, [], 0
            if code != HEARTBEAT:
                frames.append(Frame(KINDS[code], seq, at_us, payload))
        return frames

    def _take_header(self, view: memoryview, position: int) -> int:
        """Read a header from ``view`` at ``position`` (or finish one begun); where it ends."""
        if not self._head and len(view) - position >= HEADER.size:
            self._frame = header_of(view, position)
            return position + HEADER.size
        take = min(HEADER.size - len(self._head), len(view) - position)
        self._head += view[position : position + take]
        if len(self._head) == HEADER.size:
            self._frame = header_of(self._head)
            self._head.clear()
        return position + take

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet whole: more than none at the end of a stream is a torn frame."""
        return len(self._head) + (HEADER.size + self._got if self._frame is not None else 0)
