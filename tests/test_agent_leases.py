"""The agent's leases: ``paddock lease``, ``paddock run --lease`` and ``Target.lease()``.

Against the session's real target (uvicorn, TLS, bubblewrap); the CLI runs
as a subprocess, in-process and through its multiplexer, with its own state
directory.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import BUILDER_TOKEN, Target, wait_until

from agent_side.api import AsyncTarget
from agent_side.api import Target as ApiTarget
from agent_side.client import TargetClient
from agent_side.errors import FileRefused, LeaseLost, SeatTaken, UsageError
from shared.wire import Lease

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent
SHOW = 'echo "$PADDOCK_LEASE_SEAT $PADDOCK_LEASE_GENERATION"'


class Paddock:
    """``paddock`` as a user runs it against the session's target, with a state dir of its own."""

    def __init__(self, target: Target, home: Path) -> None:
        self.state = home / "state"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDOCK_", "XDG_S"))}
        self.env |= {
            "PYTHONPATH": str(REPO),
            "HOME": str(home),
            "XDG_STATE_HOME": str(self.state),
            "PADDOCK_TARGET": target.url,
            "PADDOCK_CACERT": target.cacert,
            "PADDOCK_TOKEN": BUILDER_TOKEN,
        }

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )

    def take(self, *args: str) -> Lease:
        taken = self("lease", "take", "--json", *args)
        assert taken.returncode == 0, taken.stderr
        return Lease.model_validate_json(taken.stdout)


@pytest.fixture
def paddock(target: Target, tmp_path: Path) -> Paddock:
    return Paddock(target, tmp_path)


def _seat() -> str:
    return f"seat-{uuid.uuid4().hex[:8]}"


def test_cli_lease_take_run_supersede_renew_show_release(paddock: Paddock) -> None:
    seat = _seat()
    line = paddock("lease", "take", "--seat", seat, "--ttl", "120")
    assert line.returncode == 0, line.stderr
    first_id = line.stdout.split()[0]
    assert f"generation 1  seat {seat}" in line.stdout and "held until" in line.stdout
    kept = paddock.state / "paddock" / "leases" / f"{first_id}.json"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert json.loads(kept.read_text())["generation"] == 1

    ran = paddock("run", "--no-mux", "--lease", first_id, "--", "sh", "-c", SHOW)
    assert (ran.returncode, ran.stdout) == (0, f"{seat} 1\n"), ran.stderr

    held = paddock("lease", "take", "--seat", seat)
    assert held.returncode == 125
    assert "seat taken" in held.stderr and "--supersede" in held.stderr

    second = paddock.take("--seat", seat, "--supersede")
    assert second.generation == 2
    stale = paddock("run", "--no-mux", "--lease", first_id, "--", "true")
    assert stale.returncode == 126
    assert "refused (stale-lease, lease.generation)" in stale.stderr
    planned = paddock("plan", "--lease", first_id, "--", "true")
    assert planned.returncode == 126 and "stale-lease" in planned.stdout + planned.stderr

    renewed = paddock("lease", "renew", second.lease_id, "--ttl", "300", "--json")
    assert renewed.returncode == 0, renewed.stderr
    assert Lease.model_validate_json(renewed.stdout).ttl_s == 300
    superseded = paddock("lease", "renew", first_id)
    assert superseded.returncode == 125 and "lease lost" in superseded.stderr

    shown = paddock("lease", "show", first_id, "--json")
    assert Lease.model_validate_json(shown.stdout).state == "superseded"
    every = paddock("lease", "show", "--json")
    listed = [Lease.model_validate_json(x) for x in every.stdout.splitlines()]
    assert second.lease_id in {lease.lease_id for lease in listed}
    assert first_id not in every.stdout  # a seat shows its current lease only

    released = paddock("lease", "release", second.lease_id)
    assert released.returncode == 0 and "released" in released.stdout
    assert not (paddock.state / "paddock" / "leases" / f"{second.lease_id}.json").exists()
    gone = paddock("run", "--no-mux", "--lease", second.lease_id, "--", "true")
    assert gone.returncode == 125 and "no lease" in gone.stderr
    assert paddock.take("--seat", seat).generation == 3


def test_cli_cp_and_session_act_under_a_lease(paddock: Paddock, target: Target) -> None:
    seat = _seat()
    place = _role_dir(target)
    first = paddock.take("--seat", seat)
    sent = subprocess.run(
        [*CLI, "cp", "--lease", first.lease_id, "-", f":{place}/f"],
        env=paddock.env,
        input="held",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sent.returncode == 0, sent.stderr
    started = paddock("session", "start", "--lease", first.lease_id, "-w", str(place))
    assert started.returncode == 0, started.stderr
    session = started.stdout.strip()
    try:
        paddock.take("--seat", seat, "--supersede")
        late = paddock("cp", "--lease", first.lease_id, f":{place}/f", "-")
        assert late.returncode == 126 and "stale-lease" in late.stderr, late.stderr
        stale = paddock("run", "--no-mux", "--session", session, "--", "true")
        assert stale.returncode == 126 and "stale-lease" in stale.stderr, stale.stderr
    finally:
        paddock("session", "end", session)
    assert (place / "f").read_text() == "held"


def test_cli_run_with_a_lease_through_the_multiplexer(paddock: Paddock) -> None:
    lease = paddock.take("--seat", _seat(), "--ttl", "120")

    def run() -> subprocess.CompletedProcess[str]:
        ran = paddock("run", "--lease", lease.lease_id, "--", "sh", "-c", SHOW)
        assert (ran.returncode, ran.stdout) == (0, f"{lease.seat} 1\n"), ran.stderr
        return ran

    def daemon_up() -> bool:
        status = paddock("mux", "status", "--json", "--target", paddock.env["PADDOCK_TARGET"])
        return any(json.loads(x).get("t") == "status" for x in status.stdout.splitlines())

    run()  # in-process, or through a daemon another test left: either way it starts one
    assert wait_until(daemon_up, timeout=30)
    run()  # through the daemon
    paddock.take("--seat", lease.seat, "--supersede")
    stale = paddock("run", "--lease", lease.lease_id, "--", "true")
    assert stale.returncode == 126 and "stale-lease" in stale.stderr


def test_cli_lease_id_is_checked_before_anything_is_sent(paddock: Paddock) -> None:
    for args in (["run", "--lease", "../x", "--", "true"], ["lease", "renew", "l-zz"]):
        wrong = paddock(*args)
        assert wrong.returncode == 125 and "is not a lease id" in wrong.stderr, wrong.stderr
    local = paddock("lease", "take", "--local")
    assert local.returncode == 125 and "--local" in local.stderr


def _api(target: Target) -> ApiTarget:
    return ApiTarget.https(target.url, token=BUILDER_TOKEN, cacert=target.cacert, role="builder")


def test_python_lease_is_renewed_while_a_long_turn_runs(target: Target) -> None:
    seat = _seat()
    with (
        _api(target) as api,
        TargetClient(target.url, BUILDER_TOKEN, cacert=target.cacert) as rival,
    ):
        # A ttl of 3 s, renewed each second: 1.5 s was outlasted once by a loaded machine
        # stalling the renewing thread before its first renewal.
        with api.lease(seat, ttl_s=3) as held:
            long = api.run(["sh", "-c", f"sleep 7; {SHOW}"])
            assert (long.exit_code, long.stdout) == (0, f"{seat} 1\n".encode())
            assert held.renewals >= 2 and held.held
            # Still its seat after the turn outlived the ttl twice over: no one else gets it.
            with pytest.raises(SeatTaken):
                rival.take_lease("builder", seat, 60)
            again = api.run(["sh", "-c", SHOW])
            assert again.exit_code == 0 and again.turn.refusal is None
            assert rival.lease(held.lease.lease_id).state == "held"
            lease_id = held.lease.lease_id
        with pytest.raises(LeaseLost):  # released on leaving the block
            rival.lease(lease_id)
        assert rival.take_lease("builder", seat, 60).generation == 2


def test_python_lease_superseded_is_lost_and_its_turns_refused(target: Target) -> None:
    seat = _seat()
    with (
        _api(target) as api,
        TargetClient(target.url, BUILDER_TOKEN, cacert=target.cacert) as rival,
    ):
        with api.lease(seat, ttl_s=1.5) as held:
            assert api.run(["true"]).exit_code == 0
            newer = rival.take_lease("builder", seat, 60, supersede=True)
            assert newer.generation == 2
            assert wait_until(lambda: held.lost is not None, timeout=10)
            refused = api.run(["true"])
            assert refused.exit_code == 126
            assert refused.refusal is not None and refused.refusal.rule == "stale-lease"
            with pytest.raises(UsageError):
                api.lease(_seat())  # one lease per Target at a time
        # A lost lease is not released on leaving: the seat stays its newer holder's.
        assert rival.lease(newer.lease_id).state == "held"


def test_python_lease_is_carried_by_file_operations_and_sessions(target: Target) -> None:
    seat = _seat()
    place = _role_dir(target)
    with (
        _api(target) as api,
        TargetClient(target.url, BUILDER_TOKEN, cacert=target.cacert) as rival,
        api.lease(seat, ttl_s=30),
    ):
        api.write_file(f"{place}/f", b"held")
        with api.session(cwd=str(place)) as session:
            assert session.run(["sh", "-c", SHOW]).stdout == f"{seat} 1\n".encode()
            rival.take_lease("builder", seat, 60, supersede=True)
            refused = session.run(["true"])
            assert refused.refusal is not None and refused.refusal.rule == "stale-lease"
        with pytest.raises(FileRefused) as late:
            api.write_file(f"{place}/f", b"zombie")
        assert late.value.refusal.rule == "stale-lease"
    assert (place / "f").read_bytes() == b"held"


def _role_dir(target: Target) -> Path:
    place = target.workspace / f"leased-{uuid.uuid4().hex[:12]}"
    place.mkdir()
    os.chown(place, *target.settings.role_ids("builder"))
    return place


async def test_async_target_lease_carries_it_and_releases_it(target: Target) -> None:
    seat = _seat()
    options = {"token": BUILDER_TOKEN, "cacert": target.cacert, "role": "builder"}
    async with AsyncTarget.https(target.url, **options) as api:
        async with await api.lease(seat, ttl_s=30) as held:
            result = await api.run(["sh", "-c", SHOW])
            assert (result.exit_code, result.stdout) == (0, f"{seat} 1\n".encode())
            lease_id = held.lease.lease_id
        with (
            TargetClient(target.url, BUILDER_TOKEN, cacert=target.cacert) as client,
            pytest.raises(LeaseLost),
        ):
            client.lease(lease_id)
