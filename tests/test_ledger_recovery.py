"""After a crash: torn tails of the ledger, a spool and a record are cut, kept and recorded;
a ledger that does not chain in the middle stops the target, and ``ledger repair`` mends it.
A turn leaves its spool on disk and nothing else: the ledger says what became of it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from process_support import REPO, TargetProcess, wait_for_exit, write_config

from shared.walk import canonical_path
from shared.wire import EVENTS, Event
from target_side.errors import StorageError
from target_side.service import ledger
from target_side.service.session_store import SessionStore
from target_side.service.spool import EventSpool, records_on_disk
from target_side.service.store import TurnStore, Unreadable

SHORT_WRITE = """
import asyncio, resource, signal, sys
from pathlib import Path
from target_side.service.ledger import Ledger
from target_side.service.spool import EventSpool

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write is cut short, then EFBIG
root = Path(sys.argv[1])
book = Ledger(root)
asyncio.run(book.append("note", text="a" * 100))
spool = EventSpool(root / "turns" / "t-1" / "events.jsonl")
spool.append("stdout", data="a" * 100)
for name in ("ledger.jsonl", "turns/t-1/events.jsonl"):
    size = (root / name).stat().st_size
    # The limit is per file: each of these files may grow by 50 bytes more, no further.
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 50, hard))
    try:
        if name == "ledger.jsonl":
            print("ledger appended:", asyncio.run(book.append("note", text="b" * 200)))
        else:
            spool.append("stdout", data="b" * 200)
    except Exception as exc:
        print("spool refused:", type(exc).__name__)
    if name != "ledger.jsonl":
        # The target's own closing events: held in memory, served, written once it can.
        print("notice on disk:", spool.append_kept("notice", message="c" * 200))
        print("exit on disk:", spool.append_kept("exit", exit_code=125))
        print("served:", [kind for _, kind, _ in asyncio.run(spool.raw_after(1))])
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
print("flushed:", spool.flush_held(), "ledger flushed:", asyncio.run(book.flush()))
"""


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "target_side.tools.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def _records(state: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (state / ledger.LEDGER).read_text().splitlines()]


def _run_one_turn(target: TargetProcess, argv: list[str]) -> str:
    with target.client() as c:
        turn = c.post("/v1/turns", json={"role": "builder", "argv": argv}).json()
        events(c, turn["turn_id"])
    return str(turn["turn_id"])


def test_a_short_write_is_cut_back_leaving_whole_records(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SHORT_WRITE, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "ledger appended: False" in done.stdout
    assert "spool refused: StorageError" in done.stdout
    assert "notice on disk: False\nexit on disk: False" in done.stdout
    assert "served: ['notice', 'exit']" in done.stdout
    assert "flushed: True ledger flushed: True" in done.stdout
    # Nothing torn was left at any point, and what was held went to disk in order.
    assert ledger.verify(tmp_path).count == 2
    lines = (tmp_path / "turns" / "t-1" / "events.jsonl").read_bytes().splitlines()
    assert [EVENTS.validate_json(line).kind for line in lines] == ["stdout", "notice", "exit"]


@pytest.mark.parametrize(
    "torn",
    [b'{"seq":99,"prev":"0123', b"\0" * 40 + b"\n"],
    ids=["cut-mid-line", "zeros-after-a-crash"],
)
def test_a_torn_last_ledger_record_is_cut_kept_and_recorded(tmp_path: Path, torn: bytes) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    state = root / "state"
    first = TargetProcess.start(config, url, root / "first.log")
    _run_one_turn(first, ["true"])
    first.terminate()
    with open(state / ledger.LEDGER, "ab") as f:
        f.write(torn)
    checked = _cli("ledger", "verify", "--config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert f"{len(torn)} bytes after the last whole record" in checked.stdout
    again = TargetProcess.start(config, url, root / "again.log")
    again.terminate()
    (kept,) = state.glob("ledger.jsonl.torn-*")
    assert kept.read_bytes() == torn
    recovery = next(r for r in _records(state) if r["kind"] == "recovery")
    assert recovery["cut"] == {
        "file": "ledger.jsonl",
        "bytes": len(torn),
        "sha256": hashlib.sha256(torn).hexdigest(),
        "kept": kept.name,
    }
    assert ledger.verify(state).torn_bytes == 0


def test_a_mismatch_in_the_middle_stops_the_target_until_repaired(tmp_path: Path) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    state = root / "state"
    first = TargetProcess.start(config, url, root / "first.log")
    turns = [_run_one_turn(first, ["true"]) for _ in range(2)]
    first.terminate()
    lines = (state / ledger.LEDGER).read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"builder"', b'"intruder"', 1)
    (state / ledger.LEDGER).write_bytes(b"".join(lines))

    refused = TargetProcess.start(config, url, root / "refused.log", wait=False)
    assert wait_for_exit(refused.proc, timeout=30) not in (None, 0)
    assert "record 3 does not chain to record 2" in (root / "refused.log").read_text()

    checked = _cli("ledger", "verify", "--config", str(config))
    assert checked.returncode == 1
    assert "record 3 does not chain to record 2" in checked.stderr
    # Record 2 is what record 3 no longer vouches for: only record 1 is proven.
    assert "record 1 checks out" in checked.stderr
    assert "paddock-target ledger repair --config" in checked.stderr
    assert "Repairing the ledger" in checked.stderr

    repaired = _cli("ledger", "repair", "--config", str(config))
    assert repaired.returncode == 0, repaired.stderr
    assert "kept 1 record(s)" in repaired.stdout
    (cut,) = state.glob("ledger.jsonl.cut-*")
    assert cut.read_bytes() == b"".join(lines[1:])
    *_, last = _records(state)
    assert last["kind"] == "recovery"
    assert last["repair"]["cut"]["sha256"] == hashlib.sha256(cut.read_bytes()).hexdigest()  # type: ignore[index]
    assert "record 3 does not chain" in last["repair"]["reason"]  # type: ignore[index]

    mended = TargetProcess.start(config, url, root / "mended.log")
    try:
        with mended.client() as c:
            # The first turn's end line was cut, the second's every line: each one's spool
            # still ends in an event that says how it ended, usage and all.
            first_turn, second = (c.get(f"/v1/turns/{t}").json() for t in turns)
        turns.append(_run_one_turn(mended, ["true"]))
    finally:
        mended.terminate()
    for turn in (first_turn, second):
        assert (turn["state"], turn["exit_code"]) == ("exited", 0)
        assert turn["usage"]["wall_s"] > 0
    rebuilt = {
        r["turn_id"]: r["record"]["rebuilt_from"]  # type: ignore[index]
        for r in _records(state)
        if r["kind"] == "recovery" and "record" in r
    }
    assert rebuilt == {turns[0]: "ledger", turns[1]: "spool"}
    ledger.verify(state)
    # The target recorded again the ends the cut took away: every turn it knows has one.
    ended = {r["turn"]["turn_id"] for r in _records(state) if r["kind"] == "end"}  # type: ignore[index]
    assert ended == set(turns)


@dataclass
class _Stopped:
    """A state root after one ``echo hello`` turn, its target stopped."""

    root: Path
    config: Path
    url: str
    turn_id: str

    @property
    def state(self) -> Path:
        return self.root / "state"

    def spool(self) -> Path:
        return self.state / "turns" / f"{self.turn_id}.frames"

    def served_again(self) -> tuple[dict[str, object], list[Event]]:
        """The turn and its events, from a target started again on the same state root."""
        again = TargetProcess.start(self.config, self.url, self.root / "again.log")
        try:
            with again.client() as c:
                return c.get(f"/v1/turns/{self.turn_id}").json(), events(c, self.turn_id)
        finally:
            again.terminate()


def _after_one_turn(tmp_path: Path) -> _Stopped:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    first = TargetProcess.start(config, url, root / "first.log")
    turn_id = _run_one_turn(first, ["echo", "hello"])
    first.terminate()
    return _Stopped(root, config, url, turn_id)


def _kept_as_an_earlier_version_did(state: Path, turn_id: str) -> Path:
    """The turn's spool moved where earlier versions kept it: a directory of the turn's own."""
    turn_dir = state / "turns" / turn_id
    turn_dir.mkdir()
    (state / "turns" / f"{turn_id}.frames").rename(turn_dir / "events.frames")
    return turn_dir


def test_a_turn_an_earlier_version_kept_in_its_own_directory_is_served_from_there(
    tmp_path: Path,
) -> None:
    """A restart finds a turn's spool where an earlier version kept it (``turns/TURN/``, no
    record beside it: the ledger says the rest), not only as ``turns/TURN.frames``."""
    stopped = _after_one_turn(tmp_path)
    _kept_as_an_earlier_version_did(stopped.state, stopped.turn_id)
    turn, evs = stopped.served_again()
    assert (turn["state"], turn["exit_code"]) == ("exited", 0)
    assert [e.kind for e in evs] == ["started", "stdout", "exit"]
    assert not stopped.spool().exists()  # nothing made in the new place


def test_a_torn_spool_tail_is_cut_kept_beside_it_and_the_turn_served_whole(
    tmp_path: Path,
) -> None:
    stopped = _after_one_turn(tmp_path)
    spool = stopped.spool()
    *whole, exit_record = records_on_disk(spool)
    torn = exit_record[:25]
    spool.write_bytes(b"".join(whole) + torn)

    turn, evs = stopped.served_again()
    assert (turn["state"], turn["exit_code"]) == ("exited", 0)
    assert [e.kind for e in evs] == ["started", "stdout", "exit"]
    (kept,) = spool.parent.glob(f"{spool.name}.torn-*")
    assert kept.read_bytes() == torn
    records = _records(stopped.state)
    cut = next(r["cut"] for r in records if r["kind"] == "recovery" and "cut" in r)
    assert cut == {
        "file": f"turns/{spool.name}",
        "bytes": len(torn),
        "sha256": hashlib.sha256(torn).hexdigest(),
        "kept": kept.name,
    }


def test_a_spool_nothing_can_be_rebuilt_from_goes_to_lost_and_found_with_its_torn_tail(
    tmp_path: Path,
) -> None:
    """A turn made and never launched (a crash while it was built): no ledger line, no end."""
    stopped = _after_one_turn(tmp_path)
    unlaunched = "t-" + "5" * 32
    turns = stopped.spool().parent
    (turns / f"{unlaunched}.frames").write_bytes(b"")
    (turns / f"{unlaunched}.frames.torn-20260101T000000.000000Z").write_bytes(b"half a record")

    turn, _ = stopped.served_again()
    assert turn["state"] == "exited"  # the turn the ledger knows stays
    assert sorted(p.name for p in turns.iterdir()) == [stopped.spool().name]
    (moved,) = (stopped.state / "lost+found").iterdir()
    assert moved.name.startswith(f"{unlaunched}.")
    inside = sorted(p.name for p in moved.iterdir())
    assert inside == [f"{unlaunched}.frames", f"{unlaunched}.frames.torn-20260101T000000.000000Z"]
    records = _records(stopped.state)
    record = next(r["record"] for r in records if r.get("turn_id") == unlaunched)
    assert record["moved_to"] == f"lost+found/{moved.name}"  # type: ignore[index]


def test_torn_spool_tail_and_torn_record_of_an_earlier_version_are_cut_kept_and_rebuilt(
    tmp_path: Path,
) -> None:
    stopped = _after_one_turn(tmp_path)
    state, turn_id = stopped.state, stopped.turn_id
    turn_dir = _kept_as_an_earlier_version_did(state, turn_id)
    spool = turn_dir / "events.frames"
    # What a crash of the machine can leave: a spool record cut short, a record that is not JSON.
    *whole, _exit_record = records_on_disk(spool)
    torn_spool = _exit_record[:25]
    spool.write_bytes(b"".join(whole) + torn_spool)
    # A record as an earlier version wrote one beside the spool, torn by the crash.
    torn_record = b'{"turn": {"turn_id": "' + turn_id.encode()
    (turn_dir / "record.json").write_bytes(torn_record)

    turn, evs = stopped.served_again()
    assert (turn["state"], turn["exit_code"]) == ("exited", 0)
    assert [e.kind for e in evs] == ["started", "stdout", "exit"]
    assert evs[-1].exit_code == 0  # type: ignore[union-attr]
    (kept_spool,) = turn_dir.glob("events.frames.torn-*")
    assert kept_spool.read_bytes() == torn_spool
    (kept_record,) = turn_dir.glob("record.json.torn-*")
    assert kept_record.read_bytes() == torn_record
    recoveries = [r for r in _records(state) if r["kind"] == "recovery"]
    cut = next(r["cut"] for r in recoveries if "cut" in r)
    assert cut == {
        "file": f"turns/{turn_id}/events.frames",
        "bytes": len(torn_spool),
        "sha256": hashlib.sha256(torn_spool).hexdigest(),
        "kept": kept_spool.name,
    }
    rebuilt = next(r for r in recoveries if "record" in r)
    assert rebuilt["turn_id"] == turn_id
    assert rebuilt["record"]["kept"] == kept_record.name  # type: ignore[index]
    assert rebuilt["record"]["rebuilt_from"] == "ledger"  # type: ignore[index]
    assert ledger.verify(state).count >= 4


def test_an_ended_turn_leaves_its_spool_alone_and_comes_back_from_the_ledger(
    tmp_path: Path,
) -> None:
    """No file but its spool per turn; a restart takes the turn as the ledger's end line says,
    with the key of the request that made it, and records no recovery."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    state = root / "state"
    body = {"role": "builder", "argv": ["sh", "-c", "echo hello; exit 3"]}
    first = TargetProcess.start(config, url, root / "first.log")
    try:
        with first.client() as c:
            made = c.post("/v1/turns", json=body, headers={"Idempotency-Key": "k1"}).json()
            events(c, made["turn_id"])
            before = c.get(f"/v1/turns/{made['turn_id']}").json()
    finally:
        first.terminate()
    turns = state / "turns"
    assert sorted(p.name for p in turns.iterdir()) == [f"{made['turn_id']}.frames"]

    again = TargetProcess.start(config, url, root / "again.log")
    try:
        with again.client() as c:
            after = c.get(f"/v1/turns/{made['turn_id']}").json()
            retried = c.post("/v1/turns", json=body, headers={"Idempotency-Key": "k1"}).json()
            evs = events(c, made["turn_id"])
    finally:
        again.terminate()
    assert after == before
    assert retried == before
    assert [e.kind for e in evs] == ["started", "stdout", "exit"]
    assert [r for r in _records(state) if r["kind"] == "recovery"] == []
    ends = [r for r in _records(state) if r["kind"] == "end"]
    assert len(ends) == 1  # nothing recorded twice
    assert sorted(p.name for p in turns.iterdir()) == [f"{made['turn_id']}.frames"]


def test_an_earlier_versions_record_that_missed_its_end_is_ended_as_the_ledger_says(
    tmp_path: Path,
) -> None:
    """Earlier versions wrote a record after the ledger's end line, lazily: a crash of the
    machine could leave it saying ``running`` and the spool without its end."""
    stopped = _after_one_turn(tmp_path)
    state = stopped.state
    turn_dir = _kept_as_an_earlier_version_did(state, stopped.turn_id)
    (launch,) = [r for r in _records(state) if r["kind"] == "launch"]
    ended = next(r["turn"] for r in _records(state) if r["kind"] == "end")
    record = {"turn": launch["turn"], "idempotency": None}
    (turn_dir / "record.json").write_text(json.dumps(record))
    spool = turn_dir / "events.frames"
    *whole, _exit = records_on_disk(spool)
    spool.write_bytes(b"".join(whole))

    turn, evs = stopped.served_again()
    assert (turn["state"], turn["exit_code"]) == ("exited", 0)  # not lost: it did end
    assert turn["usage"] == ended["usage"]  # type: ignore[index]
    assert [e.kind for e in evs] == ["started", "stdout", "exit"]
    assert evs[-1].exit_code == 0  # type: ignore[union-attr]
    ends = [r["turn"] for r in _records(state) if r["kind"] == "end"]
    ends = [t for t in ends if t["turn_id"] == stopped.turn_id]  # type: ignore[index]
    assert len(ends) == 1  # the ledger had it already: nothing recorded twice


def test_the_head_is_overwritten_in_place_not_replaced(tmp_path: Path) -> None:
    book = ledger.Ledger(tmp_path)
    assert book.append_now("note", text="first")
    head = tmp_path / ledger.HEAD
    inode = head.stat().st_ino
    for n in range(5):
        assert book.append_now("note", text=f"more {n}")
    # No file made and none removed per record: the same inode, the same fixed size.
    assert head.stat().st_ino == inode
    assert head.stat().st_size == ledger.HEAD_SIZE
    assert json.loads(head.read_bytes())["count"] == 6
    book.close_now()
    assert ledger.verify(tmp_path).count == 6


def test_records_appended_from_many_threads_at_once_share_fsyncs_and_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit on threads: a record queued while another thread's fsync runs is written
    with the next, under one fsync; each record's ``before`` runs before its line is written,
    and the chain checks out."""
    book = ledger.Ledger(tmp_path)
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        fsyncs.append(fd)
        time.sleep(0.02)  # a disk slow enough for every other thread to queue meanwhile
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    threads = 16
    at_once = threading.Barrier(threads)
    made_durable: list[str] = []

    def append(n: int) -> bool:
        at_once.wait()
        return book.append_here("note", before=lambda: made_durable.append(f"n{n}"), text=f"n{n}")

    with ThreadPoolExecutor(threads) as pool:
        assert all(pool.map(append, range(threads)))
    assert len(fsyncs) <= threads // 4
    book.close_now()
    assert ledger.verify(tmp_path).count == threads
    written = [r["text"] for r in _records(tmp_path)]
    assert sorted(written) == sorted(made_durable) == sorted(f"n{n}" for n in range(threads))


def test_a_record_appended_while_verify_reads_the_chain_is_not_taken_for_a_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    book = ledger.Ledger(tmp_path)
    assert book.append_now("note", text="first")
    walk = ledger._walk_chain

    def walk_then_a_target_appends(path: Path, torn: int | None) -> object:
        chain = walk(path, torn)
        assert book.append_now("note", text="meanwhile")
        return chain

    monkeypatch.setattr(ledger, "_walk_chain", walk_then_a_target_appends)
    # The head was read before the chain: at worst behind what it describes, never ahead.
    assert ledger.verify(tmp_path).count == 1
    book.close_now()


WRITER = """
import sys
from pathlib import Path
from target_side.service.ledger import Ledger
book = Ledger(Path(sys.argv[1]))
print("ready", flush=True)
for n in range(int(sys.argv[2])):
    book.append_now("note", text="x" * 50)
book.close_now()
"""


def test_verify_beside_a_writing_ledger_never_reports_damage(tmp_path: Path) -> None:
    ledger.Ledger(tmp_path).close_now()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "3000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
    seen = []
    # Each check passes, or finds the head behind (what a running target leaves); never
    # "records were removed" from a head read after a chain it has since outgrown.
    while writer.poll() is None:
        seen.append(ledger.verify(tmp_path).count)
    assert writer.wait() == 0
    writer.stdout.close()
    assert len(set(seen)) > 10, "the writer did not run beside the checks"
    assert ledger.verify(tmp_path).count == 3000


def _recorded(n: int, **changes: object) -> dict[str, object]:
    at = "2026-12-03T12:00:00Z"
    turn = {"turn_id": f"t-{n}", "role": "builder", "state": "exited", "exit_code": 0}
    return turn | {"created_at": at, "started_at": at, "ended_at": at} | changes


def test_a_restart_reads_the_ledger_back_only_to_its_oldest_kept_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the ledger last said of the turns on disk, read from its end: a target's earlier
    life (here 300 turns, in a real one months of them) is not read at every start."""
    book = ledger.Ledger(tmp_path)
    for n in range(300):
        book.append_now("launch", turn=_recorded(n, state="running"))
        book.append_now("end", turn=_recorded(n))
    book.append_now("launch", turn=_recorded(300, state="running"), idempotency="key-300")
    book.append_now("lease", lease={"lease_id": "l-1"})
    book.append_now("launch", turn=_recorded(301, state="running"))
    book.append_now("end", turn=_recorded(300, exit_code=3))
    book.append_now("end", turn=_recorded(302, state="refused", started_at=None))
    book.close_now()
    read: list[bytes] = []
    whole_lines = ledger._whole_lines_newest_first

    def counted(path: Path) -> Iterator[bytes]:
        for line in whole_lines(path):
            read.append(line)
            yield line

    monkeypatch.setattr(ledger, "_whole_lines_newest_first", counted)
    latest = ledger.Ledger(tmp_path).latest_turns({"t-300", "t-301", "t-302"})
    assert latest == {
        "t-300": ledger.Latest("end", _recorded(300, exit_code=3), "key-300"),
        "t-301": ledger.Latest("launch", _recorded(301, state="running")),
        "t-302": ledger.Latest("end", _recorded(302, state="refused", started_at=None)),
    }
    assert len(read) == 5  # back to turn 300's launch, and not one record further
    # A turn with no record at all leaves nothing unread; the others are as before.
    assert ledger.Ledger(tmp_path).latest_turns({"t-5", "t-none"}) == {
        "t-5": ledger.Latest("end", _recorded(5))
    }


def _torn_start_read_forwards(data: bytes) -> int | None:
    """Where a torn tail begins, found by reading every line from the start: the oracle."""
    last_start, last_line, end = 0, b"", 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            return last_start if last_line and not ledger._is_json(last_line) else end
        last_start, last_line, end = end, raw[:-1], end + len(raw)
    return last_start if last_line and not ledger._is_json(last_line) else None


_LINES = st.sampled_from(
    [b'{"seq":1}', b"{}", b"\0" * 9, b"[1]", b"", b'{"a":"' + b"x" * 90 + b'"}']
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(_LINES, max_size=6),
    tail=st.sampled_from([b"", b'{"seq":9,"pr', b"\0" * 5]),
    block=st.sampled_from([1, 2, 7, 64, 1 << 16]),
)
def test_a_torn_tail_is_found_from_the_end_as_a_read_from_the_start_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[bytes], tail: bytes, block: int
) -> None:
    """A start looks for a torn tail in the last line and what follows it alone; it finds
    the same one a read of the whole ledger would, whatever blocks it reads backwards in."""
    data = b"".join(line + b"\n" for line in lines) + tail
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(ledger, "BACKWARD_BLOCK", block)
    assert ledger._torn_start(path) == _torn_start_read_forwards(data)


def test_a_start_reads_only_the_end_of_a_long_ledger_for_a_torn_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looking for a torn tail does not read the target's whole life at every start."""
    book = ledger.Ledger(tmp_path)
    for n in range(2000):
        book.append_now("note", n=n)
    book.close_now()
    size = (tmp_path / ledger.LEDGER).stat().st_size
    monkeypatch.setattr(ledger, "BACKWARD_BLOCK", 256)
    read = _count_reads(monkeypatch)
    assert ledger._torn_start(tmp_path / ledger.LEDGER) is None
    assert 0 < sum(read) <= 3 * 256 < size // 100


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes read through every file ``ledger`` opens from now on, one entry a read."""
    read: list[int] = []
    real_open = ledger.open_to_read

    def counting_open(path: Path) -> Any:
        f = real_open(path)
        if f is None:
            return None
        real_read = f.read

        def counted(n: int = -1) -> bytes:
            got = real_read(n)
            read.append(len(got))
            return got

        f.read = counted  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(ledger, "open_to_read", counting_open)
    return read


def test_a_chain_is_verified_from_each_records_prefix_without_parsing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start verifies the whole chain; it parses no record the ledger wrote itself (two
    thirds of the time a start took at 100,000 turns), only the last line, for a torn tail."""
    book = ledger.Ledger(tmp_path)
    for n in range(50):
        book.append_now("note", n=n, text="x" * n)
    book.close_now()
    parsed: list[bytes] = []
    real_loads = json.loads

    def counted(text: bytes, **kwargs: Any) -> Any:
        parsed.append(text)
        return real_loads(text, **kwargs)

    monkeypatch.setattr(ledger.json, "loads", counted)
    assert ledger.verify(tmp_path).count == 50
    records = [text for text in parsed if text.startswith(b'{"seq"')]  # not the head
    assert len(records) == 1


def test_records_written_in_another_layout_still_chain(tmp_path: Path) -> None:
    """The prefix is a shortcut, not the rule: a record laid out otherwise (keys in another
    order, spaces) is parsed and checked as before."""
    last, lines = ledger.GENESIS, []
    for seq in range(1, 4):
        line = json.dumps({"kind": "note", "prev": last, "seq": seq}).encode()
        lines.append(line + b"\n")
        last = hashlib.sha256(line).hexdigest()
    (tmp_path / ledger.LEDGER).write_bytes(b"".join(lines))
    ledger._write_head(tmp_path / ledger.HEAD, 3, last)
    assert (ledger.verify(tmp_path).count, ledger.verify(tmp_path).head_hash) == (3, last)


def test_a_record_damaged_past_its_prefix_is_caught_by_the_next_and_repaired_away(
    tmp_path: Path,
) -> None:
    """Record 2 keeps its seq and prev but not its body: record 3 no longer vouches for it,
    so the chain breaks there, and a repair keeps record 1 alone."""
    book = ledger.Ledger(tmp_path)
    for n in range(4):
        book.append_now("note", n=n, text="original")
    book.close_now()
    path = tmp_path / ledger.LEDGER
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"text":"original"', b'"text":"\0\0\0\0\0\0\0\0', 1)
    path.write_bytes(b"".join(lines))
    with pytest.raises(ledger.LedgerError, match="record 3 does not chain to record 2") as broken:
        ledger.verify(tmp_path)
    assert "record 1 checks out" in str(broken.value)
    repaired = ledger.repair(tmp_path)
    assert repaired.kept == 1
    assert ledger.verify(tmp_path).count == 2  # record 1 and the repair's own record


def test_a_record_only_the_json_module_reads_is_still_read(tmp_path: Path) -> None:
    """A name decoded with ``surrogateescape`` reaches the ledger as a lone surrogate escape,
    which the faster parser refuses: such a record is read back all the same, both ways."""
    book = ledger.Ledger(tmp_path)
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    book.append_now("note", path=name)
    book.append_now("note", path="plain")
    book.close_now()
    assert [r["path"] for r in ledger.read_records(tmp_path)] == [name, "plain"]
    assert [r["path"] for r in ledger.records_newest_first(tmp_path)] == ["plain", name]
    assert [r["path"] for r in ledger.Ledger(tmp_path).records_of("note")] == [name, "plain"]


def test_a_spool_planted_as_a_link_is_never_read_at_a_restart(tmp_path: Path) -> None:
    """Reopening a spool never follows a link put in its place: nothing of what it points to
    is read, indexed or copied aside as a torn tail, and the start is refused naming it."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    turns = tmp_path / "state" / "turns"
    turns.mkdir(parents=True)
    planted = turns / f"t-{'a' * 32}.frames"
    planted.symlink_to(secret)
    with pytest.raises(StorageError, match="cannot open the event spool"):
        EventSpool(planted)
    assert sorted(p.name for p in turns.iterdir()) == [planted.name]  # no torn copy beside it
    assert secret.read_bytes() == b"root:x:0:0:root:/root:/bin/bash\n"


def test_a_ledger_planted_as_a_link_stops_the_target_and_nothing_it_points_to_is_read(
    tmp_path: Path,
) -> None:
    """A link in the ledger's place is refused by name, by the target and by ``ledger
    verify``: no line of what it points to is read, checked or copied aside as torn."""
    stopped = _after_one_turn(tmp_path)
    root, config, url, state = stopped.root, stopped.config, stopped.url, stopped.state
    secret = root / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    (state / ledger.LEDGER).unlink()
    (state / ledger.LEDGER).symlink_to(secret)

    refused = TargetProcess.start(config, url, root / "refused.log", wait=False)
    assert wait_for_exit(refused.proc, timeout=30) not in (None, 0)
    said = f"{state / ledger.LEDGER} is a symbolic link, not the ledger"
    assert said in (root / "refused.log").read_text()
    checked = _cli("ledger", "verify", "--config", str(config))
    assert checked.returncode == 1
    assert said in checked.stderr
    assert not list(state.glob("ledger.jsonl.*"))  # nothing kept aside as a torn tail
    assert secret.read_bytes() == b"root:x:0:0:root:/root:/bin/bash\n"


def test_a_session_or_an_earlier_record_planted_as_a_link_is_set_aside_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart reads a session's file, and an earlier version's turn record, never through
    a link: the link is set aside as unreadable, and what it points to reaches no log."""
    secret = tmp_path / "secret"
    secret.write_text('{"session": "root:x:0:0:root:/root:/bin/bash"}')
    sessions = tmp_path / "state" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / f"s-{'b' * 32}.json").symlink_to(secret)
    turn_dir = tmp_path / "state" / "turns" / f"t-{'c' * 32}"
    turn_dir.mkdir(parents=True)
    (turn_dir / "record.json").symlink_to(secret)

    assert list(SessionStore(tmp_path / "state").load_all()) == []
    (found,) = TurnStore(tmp_path / "state").load_all()
    assert isinstance(found, Unreadable)
    assert [p.name.split(".torn-")[0] for p in sessions.iterdir()] == [f"s-{'b' * 32}.json"]
    assert "root:x" not in caplog.text
    assert secret.read_text() == '{"session": "root:x:0:0:root:/root:/bin/bash"}'
