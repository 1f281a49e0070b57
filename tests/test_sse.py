"""The Server-Sent Events decoder (agent_side.sse): every line ending, every chunking."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_side import sse
from agent_side.errors import ProtocolError
from agent_side.sse import ServerSentEvent, SSEDecoder


def decode(*chunks: bytes) -> list[ServerSentEvent]:
    return list(sse.iter_sse(chunks))


STREAM = (
    b": ping\n\n"
    b'id: 1\nevent: stdout\ndata: {"a": 1}\n\n'
    b"id: 2\r\nevent: stderr\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"id: 3\revent: exit\rdata: caf\xc3\xa9 \xe2\x80\xa8 done\r\r"
)
EXPECTED = [
    ServerSentEvent(event="stdout", data='{"a": 1}', id="1"),
    ServerSentEvent(event="stderr", data="line one\nline two", id="2"),
    ServerSentEvent(event="exit", data="caf\u00e9 \u2028 done", id="3"),
]


def test_sse_decoder_reads_lf_crlf_and_cr_streams() -> None:
    assert decode(STREAM) == EXPECTED


def test_sse_decoder_same_events_at_every_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        assert decode(STREAM[:cut], STREAM[cut:]) == EXPECTED, cut


def test_sse_decoder_same_events_one_byte_at_a_time() -> None:
    assert decode(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_sse_decoder_same_events_for_any_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode(*chunks) == EXPECTED


def test_sse_decoder_crlf_split_across_chunks_is_one_line_end() -> None:
    events = decode(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n")
    assert events == [ServerSentEvent(data="a\nb")]


def test_sse_decoder_cr_at_chunk_end_dispatches_without_waiting() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == [ServerSentEvent(data="a")]


def test_sse_decoder_multi_line_data_joined_with_newline() -> None:
    assert decode(b"data: one\ndata:two\ndata\ndata:  three\n\n") == [
        ServerSentEvent(data="one\ntwo\n\n three")
    ]


def test_sse_decoder_ignores_comments_and_heartbeats() -> None:
    assert decode(b": ping\n\n: ping\n\n:\n\ndata: x\n: inside\n\n") == [ServerSentEvent(data="x")]


def test_sse_decoder_keeps_unicode_line_separators_inside_data() -> None:
    text = "a\u2028b\u2029c\x85d\x0be"
    assert decode(f"data: {text}\n\n".encode()) == [ServerSentEvent(data=text)]


def test_sse_decoder_utf8_character_split_across_chunks() -> None:
    body = "data: é€😀\n\n".encode()
    for cut in range(len(body)):
        assert decode(body[:cut], body[cut:]) == [ServerSentEvent(data="é€😀")]


def test_sse_decoder_discards_unterminated_event_at_end() -> None:
    assert decode(b"data: complete\n\ndata: cut off\n") == [ServerSentEvent(data="complete")]


def test_sse_decoder_event_without_data_is_not_dispatched() -> None:
    assert decode(b"event: stdout\nid: 7\n\ndata: x\n\n") == [ServerSentEvent(data="x", id="7")]


def test_sse_decoder_last_id_carries_over_and_retry_is_read() -> None:
    events = decode(b"id: 5\nretry: 250\ndata: a\n\nretry: soon\ndata: b\n\n")
    assert events == [
        ServerSentEvent(data="a", id="5", retry=250),
        ServerSentEvent(data="b", id="5", retry=250),
    ]


def test_sse_decoder_strips_one_leading_bom() -> None:
    assert decode(b"\xef\xbb\xbf", b"data: x\n\n") == [ServerSentEvent(data="x")]


def test_sse_decoder_refuses_an_endless_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_EVENT_CHARS", 64)
    decoder = SSEDecoder()
    with pytest.raises(ProtocolError, match="line exceeds"):
        for _ in range(10):
            decoder.feed(b"data: " + b"x" * 10)


def test_sse_decoder_refuses_endless_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_EVENT_CHARS", 64)
    with pytest.raises(ProtocolError, match="data exceeds"):
        decode(b"data: 0123456789\n" * 10)
