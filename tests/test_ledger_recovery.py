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

import pytest
from conftest import events
from process_support import REPO, TargetProcess, wait_for_exit, write_config

from shared.walk import canonical_path
from shared.wire import EVENTS, Event
from target_side.service import ledger
from target_side.service.spool import records_on_disk

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
