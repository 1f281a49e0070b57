"""Frames: a turn's events as its spool holds them, output as its own bytes, beside SSE."""

from __future__ import annotations

import base64
import itertools
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from conftest import BUILDER_TOKEN, Target, submit, wait_until
from hypothesis import given
from hypothesis import strategies as st
from process_support import TargetProcess, write_config

from agent_side.client import TargetClient
from agent_side.turns import drive, output_bytes
from shared import frames
from shared.walk import canonical_path
from shared.wire import EVENTS, ExitEvent, OutputEvent, Turn, TurnRequest
from target_side.service.spool import EventSpool, events_on_disk, records_on_disk

BYTES = bytes(range(256)) * 64 + b"\0" * 4096 + "é€😀".encode()
"""Every byte value, NULs, and characters of two to four bytes: what text output is not."""
PRINT = ["python3", "-c", f"import sys; sys.stdout.buffer.write({BYTES!r})"]


def _frames_of(c: httpx.Client, turn_id: str, **params: object) -> list[frames.Frame]:
    decoder = frames.FrameDecoder()
    found: list[frames.Frame] = []
    headers = {"Accept": frames.MEDIA_TYPE}
    with c.stream("GET", f"/v1/turns/{turn_id}/events", params=params, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == frames.MEDIA_TYPE
        assert r.headers["vary"] == "Accept"
        for chunk in r.iter_raw():
            found += decoder.feed(chunk)
    assert decoder.pending == 0
    return found


def test_frame_decoder_gives_the_same_frames_however_the_stream_is_split() -> None:
    stream = b"".join(
        [
            frames.encode_header("stdout", 1, 10, 3) + b"abc",
            frames.heartbeat(),
            frames.encode_header("stderr", 2, 11, 0),
            frames.encode_header("notice", 3, 12, 2) + b"{}",
        ]
    )
    whole = frames.FrameDecoder().feed(stream)
    assert [(f.kind, f.seq, f.at_us, f.payload) for f in whole] == [
        ("stdout", 1, 10, b"abc"),
        ("stderr", 2, 11, b""),
        ("notice", 3, 12, b"{}"),
    ]
    for size in (1, 2, 5, 23, 24, 25):
        decoder = frames.FrameDecoder()
        split = [f for i in range(0, len(stream), size) for f in decoder.feed(stream[i : i + size])]
        assert split == whole and decoder.pending == 0


_FRAME = st.tuples(
    st.sampled_from(["heartbeat", *frames.KIND_CODES]),
    st.integers(1, 2**40),
    st.integers(-(2**62), 2**62),
    st.binary(max_size=3000),
)


@given(st.lists(_FRAME, max_size=8), st.lists(st.integers(0, 30000), max_size=12), st.data())
def test_frame_decoder_splits_any_stream_at_any_points_alike(
    sent: list[tuple[str, int, int, bytes]], cuts: list[int], data: st.DataObject
) -> None:
    encoded = [
        frames.heartbeat()
        if kind == "heartbeat"
        else frames.encode_header(kind, seq, at_us, len(payload)) + payload
        for kind, seq, at_us, payload in sent
    ]
    stream = b"".join(encoded)
    bounds = sorted({0, len(stream), *(cut % (len(stream) + 1) for cut in cuts)})
    decoder = frames.FrameDecoder()
    got = [f for a, b in itertools.pairwise(bounds) for f in decoder.feed(stream[a:b])]
    assert [(f.kind, f.seq, f.at_us, f.payload) for f in got] == [
        frame for frame in sent if frame[0] != "heartbeat"
    ]
    assert all(type(f.payload) is bytes for f in got)
    assert decoder.pending == 0
    # Cut short: the frames wholly before the cut, and the rest pending (a torn frame).
    cut = data.draw(st.integers(0, len(stream)))
    short = frames.FrameDecoder()
    before = short.feed(stream[:cut])
    ends = list(itertools.accumulate(len(frame) for frame in encoded))
    whole = [end for end in ends if end <= cut]
    assert short.pending == cut - (whole[-1] if whole else 0)
    kept_ends = [end for end, frame in zip(ends, sent, strict=True) if frame[0] != "heartbeat"]
    assert before == [f for f, end in zip(got, kept_ends, strict=True) if end <= cut]


def test_frame_decoder_refuses_what_is_not_a_frame() -> None:
    with pytest.raises(frames.FrameError, match="unknown kind 9"):
        frames.FrameDecoder().feed(b"\x09" + b"\0" * 23)
    too_big = frames.HEADER.pack(2, frames.MAX_PAYLOAD + 1, 1, 0)
    with pytest.raises(frames.FrameError, match="more than"):
        frames.FrameDecoder().feed(too_big)


def test_frames_carry_output_as_its_own_bytes_and_the_ended_turn(
    client: httpx.Client, target: Target
) -> None:
    turn = submit(client, argv=PRINT)
    found = _frames_of(client, turn.turn_id)
    assert [f.seq for f in found] == list(range(1, len(found) + 1))
    assert found[0].kind == "started" and found[-1].kind == "exit"
    assert b"".join(f.payload for f in found if f.kind == "stdout") == BYTES
    end = EVENTS.validate_json(found[-1].payload)
    assert isinstance(end, ExitEvent) and end.turn is not None
    assert end.turn == Turn.model_validate(client.get(f"/v1/turns/{turn.turn_id}").json())
    # The spool holds exactly what was served: the file's bytes, frame for frame.
    spool = target.settings.state_root / "turns" / f"{turn.turn_id}.frames"
    assert b"".join(records_on_disk(spool)) == b"".join(
        frames.encode_header(f.kind, f.seq, f.at_us, len(f.payload)) + f.payload for f in found
    )


def test_the_event_stream_serves_the_same_events_as_json(client: httpx.Client) -> None:
    turn = submit(client, argv=PRINT)
    found = _frames_of(client, turn.turn_id)
    text = client.get(f"/v1/turns/{turn.turn_id}/events").text
    sse = [EVENTS.validate_json(line[6:]) for line in text.splitlines() if line.startswith("data:")]
    assert [(e.seq, e.kind) for e in sse] == [(f.seq, f.kind) for f in found]
    assert b"".join(output_bytes(e) for e in sse if isinstance(e, OutputEvent)) == BYTES
    # As it always has: the event stream's terminal event has no turn (clients may refuse it).
    assert '"turn"' not in text.splitlines()[-2]


def test_frames_resume_after_any_seq_and_heartbeat_while_quiet(client: httpx.Client) -> None:
    turn = submit(client, argv=["sh", "-c", "echo one; sleep 2; echo two"])
    assert wait_until(lambda: len(_frames_of(client, turn.turn_id, wait=0.1)) >= 2)
    # Quiet now: the stream says so with a heartbeat, then ends when `wait` has passed.
    raw = _raw(client, turn.turn_id, after=2, wait=0.3)
    assert raw == frames.heartbeat()
    found = frames.FrameDecoder().feed(_raw(client, turn.turn_id, after=1))
    assert found[0].seq == 2 and found[-1].kind == "exit"
    assert b"".join(f.payload for f in found if f.kind == "stdout") == b"one\ntwo\n"


def _raw(c: httpx.Client, turn_id: str, **params: object) -> bytes:
    headers = {"Accept": frames.MEDIA_TYPE}
    with c.stream("GET", f"/v1/turns/{turn_id}/events", params=params, headers=headers) as r:
        return b"".join(r.iter_raw())


@pytest.mark.parametrize(
    ("accept", "framed"),
    [
        (f"{frames.MEDIA_TYPE}, text/event-stream;q=0.5", True),
        (f"text/event-stream, {frames.MEDIA_TYPE};q=0", False),
        ("text/event-stream", False),
        ("*/*", False),
    ],
)
def test_frames_only_when_accept_asks_for_them(
    client: httpx.Client, accept: str, framed: bool
) -> None:
    turn = submit(client, argv=["true"])
    response = client.get(f"/v1/turns/{turn.turn_id}/events", headers={"Accept": accept})
    expected = frames.MEDIA_TYPE if framed else "text/event-stream; charset=utf-8"
    assert response.headers["content-type"] == expected


def test_client_runs_a_turn_in_one_request_and_needs_no_get_for_the_end(target: Target) -> None:
    requests: list[str] = []
    with TargetClient(target.url, BUILDER_TOKEN, cacert=target.cacert) as client:
        client._http.event_hooks["request"].append(lambda r: requests.append(r.url.path))
        seen: list[object] = []
        finished = drive(client, TurnRequest(role="builder", argv=PRINT), seen.append)
    assert finished.exit_status == 0 and finished.turn.state == "exited"
    assert b"".join(output_bytes(e) for e in seen if isinstance(e, OutputEvent)) == BYTES
    assert requests == ["/v1/turns"]


def _submitted(c: httpx.Client, key: str, **request: object) -> tuple[str, list[frames.Frame]]:
    body = {"role": "builder", **request}
    headers = {"Accept": frames.MEDIA_TYPE, "Idempotency-Key": key}
    with c.stream("POST", "/v1/turns", json=body, headers=headers) as r:
        assert r.status_code == 201
        assert r.headers["content-type"] == frames.MEDIA_TYPE
        data = b"".join(r.iter_raw())
    prefix, _, turn_id = r.headers["location"].rpartition("/")
    assert prefix == "/v1/turns"
    return turn_id, frames.FrameDecoder().feed(data)


def test_a_submission_asking_for_frames_is_answered_with_the_whole_turn(
    client: httpx.Client,
) -> None:
    turn_id, found = _submitted(client, "streamed-1", argv=PRINT)
    assert [f.seq for f in found] == list(range(1, len(found) + 1))
    assert found[0].kind == "started" and found[-1].kind == "exit"
    assert b"".join(f.payload for f in found if f.kind == "stdout") == BYTES
    end = EVENTS.validate_json(found[-1].payload)
    assert isinstance(end, ExitEvent) and end.turn is not None and end.turn.turn_id == turn_id
    # What the events route serves for it, frame for frame.
    assert found == _frames_of(client, turn_id)
    # The same key again: the same turn, its stream from the start, and no second turn.
    assert _submitted(client, "streamed-1", argv=PRINT) == (turn_id, found)
    # A refused turn is a turn too: its stream is its refusal.
    refused_id, refusal = _submitted(client, "streamed-2", argv=["true"], cwd="/proc")
    assert [f.kind for f in refusal] == ["refused"] and refused_id != turn_id
    # Asked for JSON (or nothing), the answer is the turn alone, as it always was.
    plain = client.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
    assert plain.status_code == 201 and plain.headers["content-type"] == "application/json"
    assert plain.headers["location"] == f"/v1/turns/{plain.json()['turn_id']}"


def test_a_spool_from_before_frames_is_still_served_both_ways(tmp_path: Path) -> None:
    """A target upgraded in place keeps the turns it had: their JSON-line spools are read."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    first = TargetProcess.start(config, url, root / "first.log")
    try:
        with first.client() as c:
            turn_id = submit(c, argv=PRINT).turn_id
            before = _frames_of(c, turn_id)
    finally:
        first.terminate()
    turns = root / "state" / "turns"
    # The same events, as a target before frames spooled them, in the turn's own directory.
    spooled = events_on_disk(turns / f"{turn_id}.frames")
    lines = [e.model_dump_json(exclude_none=True, exclude={"turn"}) + "\n" for e in spooled]
    (turns / turn_id).mkdir()
    (turns / turn_id / "events.jsonl").write_text("".join(lines))
    os.unlink(turns / f"{turn_id}.frames")
    again = TargetProcess.start(config, url, root / "again.log")
    try:
        with again.client() as c:
            after = _frames_of(c, turn_id)
            text = c.get(f"/v1/turns/{turn_id}/events").text
    finally:
        again.terminate()
    assert [(f.seq, f.kind) for f in after] == [(f.seq, f.kind) for f in before]
    assert b"".join(f.payload for f in after if f.kind == "stdout") == BYTES
    data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data:")]
    assert [d["seq"] for d in data] == [f.seq for f in before]
    assert sorted(p.name for p in turns.iterdir()) == [turn_id]
    assert sorted(p.name for p in (turns / turn_id).iterdir()) == ["events.jsonl"]


async def test_a_running_turns_tail_is_served_from_memory_as_the_file_has_it(
    tmp_path: Path,
) -> None:
    spool = EventSpool(tmp_path / "events.frames")
    spool.append_kept("started")
    for i in range(40):
        spool.append("stdout", raw=bytes([i]) * 100_000)  # 4 MB: more than the tail keeps
    on_disk = records_on_disk(tmp_path / "events.frames")
    for after in (0, 1, 20, 35, 40):
        served = b""
        seq = after
        while seq < spool.last_seq:
            seq, _, block = await spool.frames_after(seq)
            served += block
        assert served == b"".join(on_disk[after:]), after
        lines = await spool.raw_after(after)
        assert [seq for seq, _, _ in lines] == list(range(after + 1, min(after + 256, 41) + 1))


def test_a_binary_frame_is_base64_only_for_whoever_asks_for_it() -> None:
    raw = bytes(range(0x80, 0x100))
    event = OutputEvent.of_bytes(4, datetime.now(UTC), "stdout", raw)
    assert output_bytes(event) == raw
    # Writing the bytes out never encoded them.
    assert "data_b64" not in event.__dict__
    as_json = json.loads(event.model_dump_json())
    assert base64.b64decode(as_json["data_b64"]) == raw and as_json["data"] is None
    assert EVENTS.validate_json(event.model_dump_json()).data_b64 == event.data_b64
    text = OutputEvent.of_bytes(5, datetime.now(UTC), "stdout", "é\n".encode())
    assert (text.data, text.data_b64, output_bytes(text)) == ("é\n", None, "é\n".encode())


def test_the_lazy_payload_leaves_the_events_published_schema_as_it_was() -> None:
    for mode in ("validation", "serialization"):
        schema = OutputEvent.model_json_schema(mode=mode)
        assert {"data", "data_b64"} <= set(schema["properties"]), mode
