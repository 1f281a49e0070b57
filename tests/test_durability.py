"""Turns that lose nothing: stdin, idempotency, the ledger, crash recovery, retention, seams."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import (
    BUILDER_TOKEN,
    OTHER_TOKEN,
    Target,
    events,
    finished,
    make_settings,
    output,
    processes_with,
    run,
    sha,
    submit,
    wait_until,
)
from fastapi import FastAPI

from shared import frames
from shared.walk import canonical_path
from target_side.service import ledger, listing, turns
from target_side.service.app import create_app
from target_side.service.spool import records_on_disk

REPO = Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def served(
    app: FastAPI, token: str | None = BUILDER_TOKEN
) -> AsyncIterator[httpx.AsyncClient]:
    """``app`` running (its lifespan), and a client talking to it in-process with ``token``."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://paddock", headers=headers
        ) as client,
    ):
        yield client


def test_stdin_open_turn_reads_what_is_sent(client: httpx.Client) -> None:
    turn = submit(client, argv=["sh", "-c", "read line; echo got:$line; cat"], stdin="open")
    url = f"/v1/turns/{turn.turn_id}/stdin"
    assert client.post(url, content=b"first\nrest of it").status_code == 202
    assert client.post(url, params={"eof": 1}).status_code == 202
    assert output(events(client, turn.turn_id)) == "got:first\nrest of it"


def test_stdin_to_a_closed_stdin_turn_is_409(client: httpx.Client) -> None:
    turn = submit(client, argv=["sleep", "5"])
    response = client.post(f"/v1/turns/{turn.turn_id}/stdin", content=b"x")
    assert response.status_code == 409
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    finished(client, turn.turn_id)


def test_idempotency_key_returns_the_same_turn_and_runs_once(
    client: httpx.Client, target: Target
) -> None:
    counter = target.workspace / "runs.txt"
    counter.unlink(missing_ok=True)
    body = {"role": "builder", "argv": ["sh", "-c", f"echo run >> {counter}"]}
    headers = {"Idempotency-Key": "retry-me-1"}
    first = client.post("/v1/turns", json=body, headers=headers).json()
    second = client.post("/v1/turns", json=body, headers=headers).json()
    assert first["turn_id"] == second["turn_id"]
    finished(client, first["turn_id"])
    assert counter.read_text() == "run\n"
    third = client.post("/v1/turns", json=body, headers={"Idempotency-Key": "another"}).json()
    assert third["turn_id"] != first["turn_id"]


def test_idempotency_key_is_scoped_to_the_role(target: Target) -> None:
    headers = {"Idempotency-Key": "shared-key"}
    with target.client() as builder, target.client(OTHER_TOKEN) as other:
        a = builder.post(
            "/v1/turns", json={"role": "builder", "argv": ["true"]}, headers=headers
        ).json()
        b = other.post(
            "/v1/turns", json={"role": "other", "argv": ["true"]}, headers=headers
        ).json()
    assert a["turn_id"] != b["turn_id"]


def test_list_turns_shows_only_the_callers_roles(target: Target) -> None:
    with target.client() as builder, target.client(OTHER_TOKEN) as other:
        mine = run(builder, ["true"])[0]
        theirs = run(other, ["true"], role="other")[0]
        listed = builder.get("/v1/turns", params={"limit": 500}).json()
    ids = [t["turn_id"] for t in listed]
    assert mine.turn_id in ids
    assert theirs.turn_id not in ids
    assert {t["role"] for t in listed} == {"builder"}
    created = [t["created_at"] for t in listed]
    assert created == sorted(created, reverse=True)


def test_ledger_records_launch_and_outcome_without_env_values(
    client: httpx.Client, target: Target
) -> None:
    turn, _ = run(client, ["true"], env={"API_KEY": "s3cret-value-never-logged"})
    text = (target.settings.state_root / "ledger.jsonl").read_text()
    assert "s3cret-value-never-logged" not in text
    records = ledger.read_records(target.settings.state_root)
    launch, end = [r for r in records if r.get("turn", {}).get("turn_id") == turn.turn_id]
    assert launch["kind"] == "launch" and end["kind"] == "end"
    assert "API_KEY" in launch["env_names"]
    assert launch["executable"]["path"] == "/usr/bin/true"
    assert launch["executable"]["ino"] == os.stat("/usr/bin/true").st_ino
    assert end["turn"]["exit_code"] == 0
    assert ledger.verify(target.settings.state_root).count >= 2


def test_ledger_refusal_is_recorded(client: httpx.Client, target: Target) -> None:
    turn, _ = run(client, ["cat"], fs={"read": ["/etc/shadow"]})
    records = ledger.read_records(target.settings.state_root)
    end = next(r for r in records if r.get("turn", {}).get("turn_id") == turn.turn_id)
    assert end["turn"]["refusal"]["rule"] == "forbidden-path"
    assert end["request"]["argv"] == ["cat"]


def _ledger_copy(target: Target, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    root.mkdir()
    for name in (ledger.LEDGER, ledger.HEAD):
        (root / name).write_bytes((target.settings.state_root / name).read_bytes())
    return root


def test_ledger_verify_detects_an_edited_record(
    client: httpx.Client, target: Target, tmp_path: Path
) -> None:
    run(client, ["true"])
    root = _ledger_copy(target, tmp_path)
    lines = (root / ledger.LEDGER).read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace('"builder"', '"intruder"', 1)
    (root / ledger.LEDGER).write_text("".join(lines))
    with pytest.raises(ledger.LedgerError, match="does not chain"):
        ledger.verify(root)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
def test_ledger_read_newest_first_is_every_whole_record_in_reverse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Read from the end in blocks of any size; a line still being appended is not a record."""
    book = ledger.Ledger(tmp_path)
    for n in range(40):
        book.append_now("note", n=n, text="x" * (n * 13 % 97))
    book.close_now()
    with open(tmp_path / ledger.LEDGER, "ab") as f:
        f.write(b'{"seq":41,"prev":"')  # half-appended
    monkeypatch.setattr(ledger, "BACKWARD_BLOCK", block)
    backwards = list(ledger.records_newest_first(tmp_path))
    assert backwards == list(reversed(list(ledger.read_records(tmp_path))))
    assert [r["n"] for r in backwards] == list(reversed(range(40)))


def _listed_turn(n: int, at: datetime, role: str = "builder", **changes: object) -> dict:
    stamp = at.isoformat().replace("+00:00", "Z")
    turn = {"turn_id": f"t-{n:032x}", "role": role, "state": "exited", "exit_code": 0}
    return {"kind": "end", "turn": turn | {"created_at": stamp, "ended_at": stamp} | changes}


def test_listing_reads_the_ledger_back_only_as_far_as_it_must() -> None:
    """A day's turns, newest first: the listing stops ten minutes before the oldest it keeps
    was created, and never reads the rest (which would raise here)."""
    now = datetime(2026, 12, 3, 12, tzinfo=UTC)
    # Turn 0 was created first and ended last, turn 2 is another role's.
    old_start = (now - timedelta(hours=5)).isoformat().replace("+00:00", "Z")
    newest = [_listed_turn(0, now, created_at=old_start), _listed_turn(2, now, role="other")]
    newest += [_listed_turn(n, now - timedelta(seconds=n)) for n in range(3, 700)]
    newest.append(_listed_turn(0, now - timedelta(hours=5), state="running"))  # its launch

    def ledger_newest_first() -> Iterator[dict]:
        yield from newest
        yield {"kind": "lease", "lease": {}}
        raise AssertionError("read past what the listing needs")

    listed = listing.newest_turns(ledger_newest_first(), frozenset({"builder"}), 5)
    assert [t.turn_id for t in listed] == [f"t-{n:032x}" for n in range(3, 8)]
    # Turns older than the slack are read only while fewer than asked for are found.
    wanted = listing.newest_turns(iter(newest), frozenset({"builder"}), 1000)
    assert len(wanted) == 698 and wanted[-1].turn_id == f"t-{0:032x}"
    assert wanted[-1].state == "exited"  # as its last record says


def test_ledger_verify_detects_truncation(
    client: httpx.Client, target: Target, tmp_path: Path
) -> None:
    run(client, ["true"])
    root = _ledger_copy(target, tmp_path)
    lines = (root / ledger.LEDGER).read_text().splitlines(keepends=True)
    (root / ledger.LEDGER).write_text("".join(lines[:-2]))
    with pytest.raises(ledger.LedgerError, match="removed"):
        ledger.verify(root)


def test_ledger_verify_cli(target: Target, tmp_path: Path) -> None:
    config = tmp_path / "target.toml"
    config.write_text(
        f'[server]\nstate_root = "{target.settings.state_root}"\n'
        f'[roles.builder]\ntoken_sha256 = "{sha(BUILDER_TOKEN)}"\n'
        f'workspaces = ["{target.workspace}"]\n'
    )
    config.chmod(0o600)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "target_side.tools.cli",
            "ledger",
            "verify",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ledger ok:")


def test_health_turns_failing_set_by_failures_and_cleared_only_by_a_good_turn(
    tmp_path: Path, ca: trustme.CA
) -> None:
    failing = {"on": True}

    def fail(step: str) -> None:
        if failing["on"] and step == "check-to-open":
            raise OSError("disk on fire")

    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    app = create_app(settings, inject=fail)

    async def scenario() -> list[set[str]]:
        seen = []
        async with served(app) as c:

            async def causes() -> set[str]:
                return {x["cause"] for x in (await c.get("/v1/health")).json()["causes"]}

            for _ in range(3):
                await c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            seen.append(await causes())
            # A policy refusal is not a recovery.
            await c.post(
                "/v1/turns",
                json={"role": "builder", "argv": ["true"], "fs": {"read": ["/etc/shadow"]}},
            )
            seen.append(await causes())
            # Another cause, active at the same time, must outlive this recovery.
            app.state.manager.board.degrade("config", "set by the test")
            failing["on"] = False
            turn = (await c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})).json()
            async with c.stream("GET", f"/v1/turns/{turn['turn_id']}/events") as r:
                async for _ in r.aiter_lines():
                    pass
            seen.append(await causes())
        return seen

    after_failures, after_refusal, after_success = asyncio.run(scenario())
    assert "turns-failing" in after_failures
    assert "turns-failing" in after_refusal
    assert "turns-failing" not in after_success
    assert "config" in after_success


def test_retention_sweep_removes_old_finished_turns(tmp_path: Path, ca: trustme.CA) -> None:
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    app = create_app(settings)

    async def scenario() -> tuple[int, int, bool]:
        async with served(app) as c:
            turn = (await c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})).json()
            async with c.stream("GET", f"/v1/turns/{turn['turn_id']}/events") as r:
                async for _ in r.aiter_lines():
                    pass
            manager = app.state.manager
            turns = settings.state_root / "turns"
            (turns / f"{turn['turn_id']}.frames.torn-20260101T000000.000000Z").write_bytes(b"x")
            (turns / f"t-{'7' * 32}.frames.torn-20260101T000000.000000Z").write_bytes(b"y")
            kept = await manager.sweep(datetime.now(UTC))
            gone = await manager.sweep(datetime.now(UTC) + timedelta(hours=25))
            still = (await c.get(f"/v1/turns/{turn['turn_id']}")).status_code
            return kept, gone, still == 404

    kept, gone, vanished = asyncio.run(scenario())
    assert (kept, gone, vanished) == (0, 1, True)
    # The turn's spool and the tail cut off it go; another turn's file stays.
    left = [p.name for p in (settings.state_root / "turns").iterdir()]
    assert left == [f"t-{'7' * 32}.frames.torn-20260101T000000.000000Z"]


def test_ended_turns_rest_and_answer_as_they_did(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond the latest ended turns, the others wait out their retention as plain bytes: a
    target up for days keeps under a quarter of the memory a whole record takes, and the
    collector stops walking them. Asked for again, a turn at rest answers as it did."""
    monkeypatch.setattr(turns, "AWAKE_ENDED", 1)
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    app = create_app(settings)
    body = {"role": "builder", "argv": ["sh", "-c", "echo one; echo two >&2; exit 3"]}
    key = {"Idempotency-Key": "rested"}

    async def answers(c: httpx.AsyncClient, turn_id: str) -> tuple[object, ...]:
        """Its events as SSE data (read to the end), the turn, and its frames after the first."""
        sse = (await c.get(f"/v1/turns/{turn_id}/events")).text
        data = [line for line in sse.splitlines() if line.startswith("data:")]
        turn = (await c.get(f"/v1/turns/{turn_id}")).json()
        accept = {"Accept": frames.MEDIA_TYPE}
        framed = await c.get(f"/v1/turns/{turn_id}/events", params={"after": 1}, headers=accept)
        found = frames.FrameDecoder().feed(framed.content)
        return data, turn, [(f.kind, f.seq, f.at_us, f.payload) for f in found]

    async def scenario() -> None:
        async with served(app) as c:
            manager = app.state.manager
            first = (await c.post("/v1/turns", json=body, headers=key)).json()["turn_id"]
            before = await answers(c, first)
            assert len(before[0]) == 4 and before[1]["exit_code"] == 3  # type: ignore[index]
            for _ in range(2):
                other = await c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
                await answers(c, other.json()["turn_id"])
            assert first in manager._resting and first not in manager._turns
            # A retried POST finds it, and leaves it at rest.
            again = await c.post("/v1/turns", json=body, headers=key)
            assert again.json()["turn_id"] == first and first in manager._resting
            other_role = {"Authorization": f"Bearer {OTHER_TOKEN}"}
            assert (await c.get(f"/v1/turns/{first}", headers=other_role)).status_code == 404
            assert await answers(c, first) == before
            assert first in manager._turns and first not in manager._resting
            # The sweep takes turns at rest as it takes the others.
            await answers(c, (await c.post("/v1/turns", json=body)).json()["turn_id"])
            assert first in manager._resting
            assert await manager.sweep(datetime.now(UTC) + timedelta(hours=25)) == 4
            assert (await c.get(f"/v1/turns/{first}")).status_code == 404
            anew = (await c.post("/v1/turns", json=body, headers=key)).json()["turn_id"]
            await answers(c, anew)
            assert anew != first
            spools = [p.name for p in (settings.state_root / "turns").iterdir()]
            assert spools == [f"{anew}.frames"]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("command", "noticed"),
    [
        # The audit moves the .envrc aside after the turn, with a notice in the spool: the
        # line is written from the event loop, after the notice.
        ("echo kept; touch .envrc", True),
        # Nothing to say: the line is written on the audit's own thread.
        ("echo kept", False),
    ],
    ids=["after-a-notice", "on-the-audits-thread"],
)
def test_a_turns_output_is_on_disk_before_its_end_is_recorded(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch, command: str, noticed: bool
) -> None:
    """The ledger's end line vouches for the turn's output, and for the notices after it (the
    audit's): all synced first. Only the terminal event after it is not, since a restart
    writes it again from the ledger."""
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    app = create_app(settings)
    seen: list[tuple[str, str]] = []
    sizes: list[tuple[str, int]] = []
    real_fdatasync, real_append = os.fdatasync, ledger.Ledger._append_lines

    def fdatasync(fd: int) -> None:
        seen.append(("synced", os.readlink(f"/proc/self/fd/{fd}")))
        sizes.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fdatasync(fd)

    def append_lines(book: ledger.Ledger, lines: list[bytes], count: int, last: str) -> None:
        real_append(book, lines, count, last)
        seen.extend(("recorded", line.decode()) for line in lines)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(ledger.Ledger, "_append_lines", append_lines)

    async def scenario() -> str:
        async with served(app) as c:
            body = {"role": "builder", "argv": ["sh", "-c", command]}
            turn = (await c.post("/v1/turns", json=body)).json()
            async with c.stream("GET", f"/v1/turns/{turn['turn_id']}/events") as r:
                async for _ in r.aiter_lines():
                    pass
            return str(turn["turn_id"])

    turn_id = asyncio.run(scenario())
    spool = str(settings.state_root / "turns" / f"{turn_id}.frames")
    synced = seen.index(("synced", spool))
    end = next(
        i for i, (what, text) in enumerate(seen) if '"kind":"end"' in text and turn_id in text
    )
    assert synced < end
    *vouched_for, _exit = records_on_disk(Path(spool))
    assert (b"notice" in vouched_for[-1]) == noticed
    syncs_before_end = sum(1 for what, _ in seen[:end] if what == "synced")
    synced_sizes = [size for path, size in sizes[:syncs_before_end] if path == spool]
    assert max(synced_sizes) >= sum(map(len, vouched_for))  # the notice, if any, on the disk too


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_target_process(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "target_side.tools.cli", "serve", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.fixture
def target_process_config(tmp_path: Path) -> Iterator[tuple[Path, str, Path]]:
    root = Path(canonical_path(tmp_path))
    (root / "ws").mkdir()
    port = _free_port()
    config = root / "target.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nstate_root = "{root / "state"}"\n'
        "heartbeat_s = 1.0\n"
        f'[roles.builder]\ntoken_sha256 = "{sha(BUILDER_TOKEN)}"\nworkspaces = ["{root / "ws"}"]\n'
    )
    config.chmod(0o600)
    yield config, f"http://127.0.0.1:{port}", root / "state"


def test_kill_9_of_the_target_loses_the_turn_but_not_its_output(
    target_process_config: tuple[Path, str, Path],
) -> None:
    config, url, state = target_process_config
    marker = "333.5"
    headers = {"Authorization": f"Bearer {BUILDER_TOKEN}"}
    server = _start_target_process(config)
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=10) as c:
            assert wait_until(lambda: _up(c), timeout=20)
            turn = c.post(
                "/v1/turns",
                json={"role": "builder", "argv": ["sh", "-c", f"echo before; sleep {marker}"]},
            ).json()
            assert wait_until(lambda: bool(processes_with("sleep", marker)))
            # What the target had spooled survives it: wait until "before" is on disk.
            spool = state / "turns" / f"{turn['turn_id']}.frames"
            assert wait_until(lambda: spool.exists() and b"before" in spool.read_bytes())
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=10)
            # bwrap dies with its parent, and the kernel takes the pid namespace with it.
            assert wait_until(lambda: not processes_with("sleep", marker))
    finally:
        server.kill()
        server.wait()
        if server.stderr:
            server.stderr.close()
    server = _start_target_process(config)
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=10) as c:
            assert wait_until(lambda: _up(c), timeout=20)
            again = c.get(f"/v1/turns/{turn['turn_id']}").json()
            evs = events(c, turn["turn_id"])
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stderr:
            server.stderr.close()
    assert again["state"] == "lost"
    assert again["exit_code"] == 125
    assert output(evs) == "before\n"
    assert evs[-1].kind == "exit" and evs[-1].exit_code == 125
    assert ledger.verify(state).count >= 2


def _up(c: httpx.Client) -> bool:
    try:
        return c.get("/v1/health").status_code == 200
    except httpx.TransportError:
        return False


def test_many_concurrent_turns_complete_with_every_byte(target: Target) -> None:
    """Bounded load: 200 turns at 16 in flight, each printing a known 64 KiB."""
    import concurrent.futures

    expected = hashlib.sha256(b"x" * 65536).hexdigest()

    def one(i: int) -> str:
        with target.client() as c:
            turn, evs = run(c, ["head", "-c", "65536", "/dev/zero"])
            data = b"".join(
                (e.data or "").encode() if e.data is not None else b""
                for e in evs
                if e.kind == "stdout"
            )
            assert turn.exit_code == 0, turn.refusal
            return hashlib.sha256(data.replace(b"\0", b"x")).hexdigest()

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        digests = list(pool.map(one, range(200)))
    assert digests == [expected] * 200
    assert time.monotonic() - started < 300


def test_health_config_cause_comes_and_goes_with_the_problem(
    tmp_path: Path, ca: trustme.CA
) -> None:
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    missing = Path(settings.roles["builder"].workspaces[0])
    missing.rmdir()
    fast = settings.server.model_copy(update={"retention_h": 0.0005})  # re-checks every 0.18 s
    app = create_app(settings.model_copy(update={"server": fast}))

    async def scenario() -> tuple[set[str], set[str]]:
        async with served(app, token=None) as c:

            async def causes() -> set[str]:
                return {x["cause"] for x in (await c.get("/v1/health")).json()["causes"]}

            before = await causes()
            missing.mkdir()
            await asyncio.sleep(0.6)
            return before, await causes()

    before, after = asyncio.run(scenario())
    assert "config" in before
    assert "config" not in after


def test_a_turns_started_at_is_bubblewraps_start_however_late_the_loop_gets_there(
    tmp_path: Path, ca: trustme.CA
) -> None:
    """The gate opens without the event loop, so a busy loop can get to a turn after its
    command ran: ``started_at`` must still come before anything the command did."""

    loops: list[asyncio.AbstractEventLoop] = []

    def busy_loop_at_launch(step: str) -> None:
        if step == "open-to-launch":  # just before bubblewrap starts (on a planning thread)
            loops[0].call_soon_threadsafe(time.sleep, 0.5)

    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    app = create_app(settings, inject=busy_loop_at_launch)

    async def scenario() -> tuple[dict[str, str], float]:
        loops.append(asyncio.get_running_loop())
        async with served(app) as c:
            made = await c.post("/v1/turns", json={"role": "builder", "argv": ["date", "+%s.%N"]})
            turn_id = made.json()["turn_id"]
            stream = (await c.get(f"/v1/turns/{turn_id}/events")).text
            said = [json.loads(line[5:]) for line in stream.splitlines() if line[:5] == "data:"]
            printed = "".join(e.get("data", "") for e in said if e["kind"] == "stdout")
            return (await c.get(f"/v1/turns/{turn_id}")).json(), float(printed)

    turn, printed = asyncio.run(scenario())
    started = datetime.fromisoformat(turn["started_at"]).timestamp()
    assert turn["exit_code"] == 0
    assert started <= printed <= datetime.fromisoformat(turn["ended_at"]).timestamp()
