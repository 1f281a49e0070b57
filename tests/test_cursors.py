"""The agent's own delivery cursor (agent_side.cursors): what a killed paddock had shown goes on.

The end-to-end tests run a real target and a turn that prints one numbered
line each time the test opens a gate file in its workspace, so the test
decides when each line exists: a paddock process can be killed between two
lines without any timing guess.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import BUILDER_TOKEN, Target, events, submit, wait_until

from agent_side import Target as ApiTarget
from agent_side.cursors import (
    MAX_AGE_S,
    PRUNE_EVERY_S,
    PRUNED_MARK,
    Cursor,
    CursorStore,
    prune,
    target_key,
)
from agent_side.errors import UsageError
from shared.wire import Event

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent
LINES = 6


# --- the store, without a target ---------------------------------------------------------


def _store(root: Path) -> CursorStore:
    return CursorStore.for_user({"XDG_STATE_HOME": str(root)}, "https://127.0.0.1:8443")


def test_cursor_store_is_private_and_written_whole(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with store.open("t-abc") as cursor:
        cursor.delivered(7)
    path = store.path("t-abc")
    assert path.parent.parent.parent == tmp_path / "paddock"
    for directory in (tmp_path / "paddock", path.parent.parent, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    record = json.loads(path.read_text())
    assert record["turn_id"] == "t-abc" and record["seq"] == 7
    assert record["target"] == "https://127.0.0.1:8443"
    assert [p.name for p in path.parent.iterdir()] == ["t-abc"]  # no temporary file left
    assert store.last_delivered("t-abc") == 7
    assert store.last_delivered("t-never") == 0


def test_cursor_goes_to_local_state_without_xdg(tmp_path: Path) -> None:
    store = CursorStore.for_user({"HOME": str(tmp_path), "XDG_STATE_HOME": "rel"}, "https://x:1")
    assert store.root == tmp_path / ".local" / "state" / "paddock"


def test_cursor_keys_keep_targets_apart() -> None:
    assert target_key("https://a:1", name="lab") == "name.lab"
    assert target_key("https://a:1") != target_key("https://a:2")
    assert target_key("https://a:1", ssh="root@h1") != target_key("https://a:1", ssh="root@h2")
    # A stored name can never take the place of a URL's key.
    assert not target_key("https://a:1").startswith("name.")


def test_cursor_refuses_a_turn_id_that_is_a_path(tmp_path: Path) -> None:
    for bad in ("../x", "", ".hidden", "a/b"):
        with pytest.raises(UsageError, match="not a turn id"):
            _store(tmp_path).path(bad)


def test_cursor_batches_a_fast_stream_and_writes_the_end_on_close(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.directory.mkdir(parents=True)
    cursor = Cursor(store.path("t-fast"), "t-fast", "u", interval_s=3600)
    for seq in range(1, 10_001):
        cursor.delivered(seq)
    cursor.close()
    # One write as the stream began, one at the end: not ten thousand fsyncs.
    assert cursor.writes <= 2
    assert store.last_delivered("t-fast") == 10_000


def test_cursor_never_goes_back(tmp_path: Path) -> None:
    with _store(tmp_path).open("t-b", start=5) as cursor:
        cursor.delivered(3)
        assert cursor.seq == 5
    assert not _store(tmp_path).path("t-b").exists()  # nothing new was delivered


def test_unusable_cursor_starts_over_and_says_so(tmp_path: Path, capsys) -> None:
    store = _store(tmp_path)
    with store.open("t-c") as cursor:
        cursor.delivered(4)
    store.path("t-c").write_text("{not json")
    assert store.last_delivered("t-c") == 0
    assert "showing the turn from its first event" in capsys.readouterr().err
    store.path("t-c").write_text(json.dumps({"turn_id": "t-other", "seq": 9}))
    assert store.last_delivered("t-c") == 0


def test_cursors_are_pruned_by_age_but_never_the_one_in_use(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for turn in ("t-old", "t-new"):
        with store.open(turn) as cursor:
            cursor.delivered(1)
    other = CursorStore(store.root, "url.other", "u")
    with other.open("t-gone") as cursor:
        cursor.delivered(1)
    old = time.time() - MAX_AGE_S - 60
    for path in (store.path("t-old"), other.path("t-gone")):
        os.utime(path, (old, old))
    prune(store.root / "cursors", keep=store.path("t-old"))
    assert store.path("t-old").exists()  # the one being opened stays
    assert not other.directory.exists()  # emptied, then removed
    prune(store.root / "cursors", keep=store.path("t-new"))
    assert not store.path("t-old").exists() and store.path("t-new").exists()


def test_opening_cursors_sweeps_old_ones_at_most_once_per_period(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with store.open("t-first") as cursor:
        cursor.delivered(1)
    other = CursorStore(store.root, "url.other", "u")
    other.directory.mkdir(parents=True)
    stale = other.path("t-stale")
    stale.write_text("{}")
    old = time.time() - MAX_AGE_S - 60
    os.utime(stale, (old, old))
    # Swept moments ago (by the first open): the next open does not read every cursor again.
    with store.open("t-second") as cursor:
        cursor.delivered(1)
    assert stale.exists()
    mark = store.root / "cursors" / PRUNED_MARK
    swept = time.time() - PRUNE_EVERY_S - 1
    os.utime(mark, (swept, swept))
    with store.open("t-third") as cursor:
        cursor.delivered(1)
    assert not stale.exists()
    assert time.time() - mark.stat().st_mtime < 60


# --- a real target ---------------------------------------------------------------------------


def _env(target: Target, state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDOCK_")}
    return env | {
        "PYTHONPATH": str(REPO),
        "XDG_STATE_HOME": str(state),
        "PADDOCK_TARGET": target.url,
        "PADDOCK_CACERT": target.cacert,
        "PADDOCK_TOKEN": BUILDER_TOKEN,
        "PADDOCK_ROLE": "builder",
    }


class Gated:
    """A turn printing ``line 1`` .. ``line N``, each once the test has opened its gate."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.tag = uuid.uuid4().hex[:8]

    @property
    def argv(self) -> list[str]:
        script = (
            f'i=1; while [ $i -le {LINES} ]; do echo "line $i"; '
            f"while [ ! -e gate.{self.tag}.$i ]; do sleep 0.02; done; i=$((i+1)); done; exit 3"
        )
        return ["sh", "-c", script]

    def open(self, *numbers: int) -> None:
        for number in numbers:
            (self.target.workspace / f"gate.{self.tag}.{number}").touch()

    def close(self) -> None:
        for path in self.target.workspace.glob(f"gate.{self.tag}.*"):
            path.unlink()


@pytest.fixture
def gated(target: Target) -> Iterator[Gated]:
    turn = Gated(target)
    yield turn
    turn.open(*range(1, LINES + 1))  # whatever happened, let the turn end
    time.sleep(0.1)
    turn.close()


def _seq_of(client: httpx.Client, turn_id: str, text: str) -> int:
    """The seq of the stdout event that carried ``text``, as the target numbers it."""
    found = [e for e in events(client, turn_id, wait=1) if getattr(e, "data", None) == text]
    assert len(found) == 1, found
    return found[0].seq


def _cursor_file(state: Path, turn_id: str) -> Path:
    (found,) = (state / "paddock" / "cursors").glob(f"*/{turn_id}")
    return found


def _recorded(state: Path, turn_id: str) -> int:
    try:
        return int(json.loads(_cursor_file(state, turn_id).read_text())["seq"])
    except (ValueError, OSError):
        return -1


def _all_output(client: httpx.Client, turn_id: str) -> str:
    return "".join(e.data or "" for e in events(client, turn_id) if e.kind == "stdout")


@contextlib.contextmanager
def _started(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``paddock ARGS`` running for the block, then SIGKILLed: no chance to write anything."""
    with subprocess.Popen(
        [*CLI, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    ) as proc:
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


def _read_lines(proc: subprocess.Popen[bytes], gated: Gated, count: int) -> list[bytes]:
    """Read ``count`` lines from ``proc``, opening the gate for the next after each but the last."""
    assert proc.stdout is not None
    lines = []
    for number in range(1, count + 1):
        lines.append(proc.stdout.readline())
        if number < count:
            gated.open(number)
    return lines


def test_killed_logs_follow_resumes_in_attach_with_nothing_lost_or_repeated(
    target: Target, client: httpx.Client, gated: Gated, tmp_path: Path
) -> None:
    turn = submit(client, argv=gated.argv, cwd=str(target.workspace))
    env = _env(target, tmp_path / "state")
    with _started(["logs", "--follow", turn.turn_id], env) as follow:
        shown = _read_lines(follow, gated, 3)
        assert shown == [b"line 1\n", b"line 2\n", b"line 3\n"]
        # Line 3 was written to our pipe; its record reaches the disk within the interval.
        third = _seq_of(client, turn.turn_id, "line 3\n")
        assert wait_until(lambda: _recorded(tmp_path / "state", turn.turn_id) == third)
    gated.open(*range(3, LINES + 1))
    attached = subprocess.run(
        [*CLI, "attach", turn.turn_id],
        env=env,
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert attached.returncode == 3, attached.stderr
    assert attached.stdout == b"line 4\nline 5\nline 6\n"
    assert f"continuing turn {turn.turn_id} after event {third}".encode() in attached.stderr
    whole = _all_output(client, turn.turn_id)
    assert b"".join(shown).decode() + attached.stdout.decode() == whole
    # Everything was delivered: the next attach shows nothing more, and still the status.
    again = subprocess.run([*CLI, "attach", turn.turn_id], env=env, capture_output=True, timeout=60)
    assert (again.returncode, again.stdout) == (3, b"")
    replay = subprocess.run(
        [*CLI, "attach", "--from-start", turn.turn_id], env=env, capture_output=True, timeout=60
    )
    assert (replay.returncode, replay.stdout.decode()) == (3, whole)


def test_killed_run_is_taken_over_by_attach(
    target: Target, client: httpx.Client, gated: Gated, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    env = _env(target, state)
    with _started(["run", "--cwd", str(target.workspace), "--", *gated.argv], env) as run:
        shown = _read_lines(run, gated, 2)
        cursors = state / "paddock" / "cursors"
        assert wait_until(lambda: len(list(cursors.glob("*/t-*"))) == 1)
        (path,) = cursors.glob("*/t-*")
        turn_id = path.name
        second = _seq_of(client, turn_id, "line 2\n")
        assert wait_until(lambda: _recorded(state, turn_id) == second)
    gated.open(*range(2, LINES + 1))
    attached = subprocess.run([*CLI, "attach", turn_id], env=env, capture_output=True, timeout=60)
    assert attached.returncode == 3, attached.stderr
    assert b"".join(shown) + attached.stdout == b"".join(
        b"line %d\n" % n for n in range(1, LINES + 1)
    )


def test_logs_follow_into_a_closed_pipe_records_nothing_it_could_not_write(
    target: Target, client: httpx.Client, tmp_path: Path
) -> None:
    turn = submit(client, argv=["sh", "-c", "echo one; echo two"], cwd=str(target.workspace))
    events(client, turn.turn_id)  # ended
    state = tmp_path / "state"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*CLI, "logs", "--follow", turn.turn_id],
            env=_env(target, state),
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    first_output = min(
        e.seq for e in events(client, turn.turn_id) if e.kind in ("stdout", "stderr")
    )
    # The started event reached nobody's eyes but was shown (it prints nothing); the first
    # line could not be written, so it is not recorded as delivered.
    assert _recorded(state, turn.turn_id) < first_output
    again = subprocess.run(
        [*CLI, "logs", "--follow", turn.turn_id],
        env=_env(target, state),
        capture_output=True,
        timeout=60,
    )
    assert (again.returncode, again.stdout) == (0, b"one\ntwo\n")


def test_python_target_records_what_it_handed_over_and_attach_goes_on(
    target: Target, tmp_path: Path
) -> None:
    store = CursorStore.for_user({"XDG_STATE_HOME": str(tmp_path)}, target.url)
    seen: list[Event] = []
    with ApiTarget.https(
        target.url, token=BUILDER_TOKEN, cacert=target.cacert, role="builder", cursors=store
    ) as api:
        result = api.run(["sh", "-c", "echo a; echo b >&2; exit 5"], on_event=seen.append)
        assert (result.exit_code, result.stdout, result.stderr) == (5, b"a\n", b"b\n")
        turn_id = result.turn.turn_id
        assert store.last_delivered(turn_id) == seen[-1].seq
        later = api.attach(turn_id)
        assert (later.exit_code, later.stdout, later.stderr) == (5, b"", b"")
        replayed = api.attach(turn_id, from_start=True)
        assert (replayed.stdout, replayed.stderr) == (b"a\n", b"b\n")
