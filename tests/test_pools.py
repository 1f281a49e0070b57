"""``paddock run -t POOL``: a turn goes to a healthy target of the pool with room for it.

Two real TLS targets on 127.0.0.1, stored as ``paddock deploy`` stores them,
in one pool; the command runs as a user runs it (a subprocess with its own
config and state directories).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from conftest import BUILDER_TOKEN, Target, events, make_settings, submit

from agent_side import targets_file
from agent_side.targets_file import StoredTarget
from target_side.service.server import ServerThread

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent


class Pool:
    """Targets ``a`` and ``b`` (each ``max_turns = 1``), stored, and pool ``ci`` of both."""

    def __init__(self, root: Path, ca: trustme.CA) -> None:
        self.root = root
        self.ca = ca
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDOCK_", "XDG_"))}
        self.env |= {
            "PYTHONPATH": str(REPO),
            "HOME": str(root / "home"),
            "XDG_CONFIG_HOME": str(root / "config"),
            "XDG_STATE_HOME": str(root / "state"),
            "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", str(root)),
        }
        self.servers: dict[str, ServerThread] = {}
        self.targets: dict[str, Target] = {}

    def serve(self, name: str) -> None:
        settings = make_settings(self.root / name, self.ca)
        server = settings.server.model_copy(update={"max_turns": 1})
        settings = settings.model_copy(update={"server": server})
        thread = ServerThread(settings).start()
        self.servers[name] = thread
        cacert = self.root / name / "ca.pem"
        self.ca.cert_pem.write_to_path(str(cacert))
        self.targets[name] = Target(thread.url, str(cacert), settings, self.root / name / "ws")
        pem = self.ca.cert_pem.bytes().decode()
        entry = StoredTarget(
            name=name,
            route="https",
            url=thread.url,
            ca_sha256=targets_file.fingerprint(pem),
            default_role="builder",
        )
        environ = {k: self.env[k] for k in ("HOME", "XDG_CONFIG_HOME")}
        targets_file.save(entry, tokens={"builder": BUILDER_TOKEN}, ca_pem=pem, environ=environ)

    def stop(self, name: str) -> None:
        self.servers.pop(name).stop()

    def write_pool(self, *members: str) -> None:
        index = self.root / "config" / "paddock" / "targets.toml"
        listed = ", ".join(f'"{m}"' for m in members)
        index.write_text(index.read_text() + f"\n[pools.ci]\ntargets = [{listed}]\n")

    def paddock(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )

    def ran_on(self, result: subprocess.CompletedProcess[str]) -> str:
        said = [line for line in result.stderr.splitlines() if "pool ci: turn " in line]
        assert len(said) == 1, result.stderr
        return said[0].rsplit(" runs on ", 1)[1]

    @contextlib.contextmanager
    def occupied(self, name: str, seconds: int = 30) -> Iterator[None]:
        """``name`` running a turn that sleeps: at its cap (max_turns = 1) until the block ends."""
        with self.targets[name].client() as c:
            turn = submit(c, argv=["sleep", str(seconds)])
            try:
                yield
            finally:
                c.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
                events(c, turn.turn_id)


@pytest.fixture
def pool(tmp_path: Path, ca: trustme.CA) -> Iterator[Pool]:
    made = Pool(tmp_path, ca)
    try:
        made.serve("a")
        made.serve("b")
        made.write_pool("a", "b")
        yield made
    finally:
        for name in list(made.servers):
            made.stop(name)


def test_pool_runs_on_its_first_target_and_says_so(pool: Pool) -> None:
    result = pool.paddock("run", "-t", "ci", "--json", "--", "sh", "-c", "echo hi")
    assert result.returncode == 0, result.stderr
    assert pool.ran_on(result) == "a"
    *event_lines, last = result.stdout.splitlines()
    final = json.loads(last)
    assert final["target"] == "a" and final["exit_code"] == 0
    assert any(json.loads(line).get("data") == "hi\n" for line in event_lines)
    # The turn is a's from then on: a's own commands know it.
    logs = pool.paddock("logs", "-t", "a", final["turn_id"])
    assert logs.returncode == 0 and logs.stdout == "hi\n", logs.stderr


def test_pool_target_at_its_cap_passes_the_turn_to_the_next(pool: Pool) -> None:
    with pool.occupied("a"):
        result = pool.paddock("run", "-t", "ci", "--", "sh", "-c", "echo on b")
        assert (result.returncode, result.stdout) == (0, "on b\n"), result.stderr
        assert pool.ran_on(result) == "b"


def test_pool_still_serves_with_a_target_stopped(pool: Pool) -> None:
    pool.stop("a")
    result = pool.paddock("run", "-t", "ci", "--", "true")
    assert result.returncode == 0, result.stderr
    assert pool.ran_on(result) == "b"
    # The other way round too: the first member up, the second gone.
    pool.serve("a")
    pool.stop("b")
    assert pool.ran_on(pool.paddock("run", "-t", "ci", "--", "true")) == "a"


def test_pool_every_target_busy_waits_for_room(pool: Pool) -> None:
    with pool.occupied("a", seconds=2), pool.occupied("b", seconds=60):
        result = pool.paddock("run", "-t", "ci", "--", "true")
    assert result.returncode == 0, result.stderr
    assert pool.ran_on(result) == "a"  # b was busy throughout: a had room once its turn ended


def test_pool_with_no_target_answering_names_each(pool: Pool) -> None:
    pool.stop("a")
    pool.stop("b")
    result = pool.paddock("run", "-t", "ci", "--", "true")
    assert result.returncode == 125
    assert "no target of pool ci answers" in result.stderr
    assert "a: target unreachable" in result.stderr and "b: target unreachable" in result.stderr


def test_pool_refuses_a_lease_and_is_no_target_for_other_commands(pool: Pool) -> None:
    leased = pool.paddock("run", "-t", "ci", "--lease", "l-" + "0" * 32, "--", "true")
    assert leased.returncode == 125 and "a lease belongs to the one target" in leased.stderr
    turns = pool.paddock("turns", "-t", "ci")
    assert turns.returncode == 125 and "is a pool" in turns.stderr


def test_pool_turn_refused_on_its_target_exits_126(pool: Pool) -> None:
    result = pool.paddock("run", "-t", "ci", "--read", "/etc/shadow", "--", "true")
    assert result.returncode == 126
    assert "refused (forbidden-path" in result.stderr


def test_pool_order_is_armed_first_then_degraded_each_in_the_pools_order() -> None:
    from agent_side.pools import Member
    from shared.wire import Health

    def member(name: str, status: str) -> Member:
        health = Health.model_validate({"status": status, "version": "1", "backend": "bwrap"})
        return Member(name, health=health)

    listed = [member("d1", "degraded"), member("a1", "armed"), member("d2", "degraded")]
    listed.append(member("a2", "armed"))
    assert [m.name for m in sorted(listed, key=lambda m: m.rank)] == ["a1", "a2", "d1", "d2"]
