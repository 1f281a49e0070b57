"""``paddock deploy`` of a fleet: two hosts, each a real sshd on 127.0.0.1, side by side.

Both hosts are this machine (no systemd: supervised mode), each with its own
prefix, state root, config dir, service user and port, named in one
inventory. The tests run in file order against them: one host made to fail
while the other deploys and serves; both deployed from sources, the wheel
built once; a re-run that changes nothing anywhere. The inventory rules come
first, without a host.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deploy_support import REPO, STEPS, SYSTEM_PYTHON, dependency_wheelhouse
from sshd import SSHD, Sshd, free_port

from agent_side.deploy import build_wheel, source_root
from agent_side.errors import UsageError
from agent_side.fleet import Shared, read_inventory, requests_for, worst

CLI = [sys.executable, "-m", "agent_side.cli"]

needs_host = pytest.mark.skipif(
    os.geteuid() != 0
    or not os.path.exists(SSHD)
    or not os.path.exists(SYSTEM_PYTHON)
    or shutil.which("setpriv") is None
    or shutil.which("useradd") is None,
    reason="deploying needs root, sshd, the system python3, setpriv and useradd",
)


# --- the inventory, without a host ---------------------------------------------------------


def _inventory(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_inventory_host_table_wins_over_the_command_line_which_wins_over_defaults(
    tmp_path: Path,
) -> None:
    path = _inventory(
        tmp_path,
        """
[defaults]
role = ["builder"]
python = "/usr/bin/python3"
listen = "127.0.0.1:1"

[hosts.a]
ssh = "root@10.0.0.1"

[hosts.b]
ssh = "root@10.0.0.2:2222"
listen = "127.0.0.1:3"
workspace = ["/srv/b"]
fail-at = "config"
""",
    )
    given = {"listen": "127.0.0.1:2", "role": ["reviewer"]}
    a, b, c = requests_for(["root@10.0.0.3"], path, given, Shared())
    # The positional host comes first, with the command line over [defaults].
    assert (a.destination, a.name, a.roles) == ("root@10.0.0.3", None, ("reviewer",))
    assert a.python == "/usr/bin/python3"
    assert b.destination == "root@10.0.0.1" and b.name == "a"
    assert "127.0.0.1:2" in b.script_options  # the command line over [defaults]
    assert c.name == "b" and c.destination == "root@10.0.0.2:2222"
    assert c.script_options[c.script_options.index("--listen") + 1] == "127.0.0.1:3"
    assert c.script_options[-2:] == ("--fail-at", "config")
    assert "--workspace" in c.script_options and "/srv/b" in c.script_options


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[hosts.a]\nssh = "x"\nlisten = 8443\n', "listen must be a string"),
        ('[hosts.a]\nrole = "builder"\n', "role must be a list"),
        ('[hosts.a]\nlisen = "x"\n', "unknown key 'lisen'"),
        ('[defaults]\nssh = "root@x"\n[hosts.a]\n', "'ssh' names one host"),
        ('[host.a]\nssh = "x"\n', "unknown key 'host'"),
        ('[defaults]\nrole = ["r"]\n', "no [hosts.NAME] table"),
        ("[hosts.a\n", "cannot read it"),
    ],
)
def test_inventory_problems_name_the_key_and_the_fix(tmp_path: Path, text: str, problem: str):
    with pytest.raises(UsageError, match=re.escape(problem)):
        read_inventory(_inventory(tmp_path, text))


def test_inventory_refusals_before_anything_runs(tmp_path: Path) -> None:
    two = _inventory(tmp_path, '[hosts.a]\nssh = "root@a"\n[hosts.b]\nssh = "root@b"\n')
    with pytest.raises(UsageError, match="--name names one host"):
        requests_for([], two, {}, Shared(), name="x")
    with pytest.raises(UsageError, match="--url is one host's"):
        requests_for([], two, {"url": "https://a:1", "route": "https"}, Shared())
    with pytest.raises(UsageError, match="name a host to deploy"):
        requests_for([], None, {}, Shared())
    bad_step = _inventory(tmp_path, '[hosts.a]\nfail-at = "nowhere"\n')
    with pytest.raises(UsageError, match="--fail-at 'nowhere'"):
        requests_for([], bad_step, {}, Shared())
    bad_service = _inventory(tmp_path, '[hosts.a]\nservice = "cron"\n')
    with pytest.raises(UsageError, match="--service 'cron'"):
        requests_for([], bad_service, {}, Shared())


def test_fleet_exit_status_is_the_worst_hosts() -> None:
    assert worst([0, 0]) == 0
    assert worst([0, 2]) == 2
    assert worst([2, 1, 0]) == 1
    assert worst([1, 125]) == 125
    assert worst([125, 3, 130]) == 3
    assert worst([0, 99]) == 125  # a status it does not know is paddock failing


def test_fleet_refuses_two_hosts_stored_under_one_name(tmp_path: Path) -> None:
    result = subprocess.run(
        [*CLI, "deploy", "root@127.0.0.1:1", "admin@127.0.0.1:2", "--role", "r"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    assert result.returncode == 125
    assert "would both be stored as target '127.0.0.1'" in result.stderr


# --- two real hosts ---------------------------------------------------------------------------


@dataclass
class Machine:
    """One deploy target: an sshd of its own, and its own prefix, user and port."""

    name: str
    base: Path
    user: str
    port: int
    sshd: Sshd

    @property
    def workspace(self) -> Path:
        return self.base / "work"

    def table(self, known_hosts: Path) -> str:
        return "\n".join(
            [
                f"[hosts.{self.name}]",
                f'ssh = "{self.sshd.destination}"',
                f'identity = ["{self.sshd.client_key}"]',
                f'known-hosts = ["{known_hosts}"]',
                f'prefix = "{self.base / "opt"}"',
                f'state-root = "{self.base / "state"}"',
                f'config-dir = "{self.base / "etc"}"',
                f'bin-dir = "{self.base / "bin"}"',
                f'launcher-socket = "{self.base / "run" / "launcher.sock"}"',
                f'user = "{self.user}"',
                f'listen = "127.0.0.1:{self.port}"',
                f'workspace = ["{self.workspace}"]',
                "",
            ]
        )

    def server_pid(self) -> int:
        proc = subprocess.run(
            [SYSTEM_PYTHON, str(self.base / "opt/bin/paddock-supervise"), "status"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        server = json.loads(proc.stdout.splitlines()[-1])["server"]
        assert server is not None and server["alive"], proc.stdout
        return int(server["pid"])


@dataclass
class Fleet:
    machines: list[Machine]
    known_hosts: Path
    home: Path
    wheel: Path
    wheelhouse: Path
    first: subprocess.CompletedProcess[str] | None = None
    pids: dict[str, int] = field(default_factory=dict)

    def inventory(self, *, failing: str | None = None) -> Path:
        text = '[defaults]\nrole = ["builder"]\nservice = "supervised"\n'
        text += f'python = "{SYSTEM_PYTHON}"\n\n'
        for machine in self.machines:
            text += machine.table(self.known_hosts)
            if machine.name == failing:
                text += 'fail-at = "config"\n'
            text += "\n"
        path = self.home / f"fleet-{failing or 'ok'}.toml"
        path.write_text(text)
        return path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDOCK_", "SSH_"))}
        return env | {
            "PYTHONPATH": str(REPO),
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / "xdg"),
            "XDG_STATE_HOME": str(self.home / "state"),
        }

    def paddock(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def deploy(self, *extra: str, failing: str | None = None, prebuilt: bool = True):
        wheel = ["--wheel", str(self.wheel)] if prebuilt else []
        return self.paddock(
            "deploy",
            "--inventory",
            str(self.inventory(failing=failing)),
            "--parallel",
            "2",
            "--wheelhouse",
            str(self.wheelhouse),
            *wheel,
            *extra,
            timeout=400,
        )

    def run_id(self, machine: Machine) -> subprocess.CompletedProcess[str]:
        return self.paddock(
            "run",
            "-t",
            machine.name,
            "--cwd",
            str(machine.workspace / "builder"),
            "--",
            "id",
            "-un",
        )

    def stored(self) -> set[str]:
        index = self.home / "xdg" / "paddock" / "targets.toml"
        import tomllib

        return set(tomllib.loads(index.read_text())["targets"]) if index.exists() else set()


def _summary(stdout: str) -> dict[str, list[str]]:
    """The summary table's rows by host: result, failed step, release, seconds."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["HOST", "RESULT"])
    rows = {}
    for line in lines[header + 1 :]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if os.geteuid() != 0 or not os.path.exists(SSHD) or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("deploying needs root, sshd and the system python3")
    build = tmp_path_factory.mktemp("fleet-wheel")
    source = source_root()
    assert source == REPO
    wheel = build_wheel(source, build / "dist")
    wheelhouse = dependency_wheelhouse(tmp_path_factory, wheel)
    home = tmp_path_factory.mktemp("fleet-agent")
    machines: list[Machine] = []
    with contextlib.ExitStack() as stack:
        for name in ("east", "west"):
            # Not under pytest's basetemp (0700): the service user must reach its files.
            base = Path(tempfile.mkdtemp(prefix=f"pdk-fleet-{name}-", dir="/tmp"))
            os.chmod(base, 0o755)
            sshd = stack.enter_context(Sshd(tmp_path_factory.mktemp(f"sshd-{name}")))
            machine = Machine(name, base, f"pf{secrets.token_hex(3)[:5]}", free_port(), sshd)
            machines.append(machine)
            stack.callback(_tear_down, machine)
        known = home / "known_hosts"
        known.write_text("".join(m.sshd.known_hosts_line() for m in machines))
        result = Fleet(machines, known, home, wheel, wheelhouse)
        # west fails after its config step: it rolls back; east deploys all the same.
        result.first = result.deploy(failing="west")
        yield result


def _tear_down(machine: Machine) -> None:
    supervise = machine.base / "opt" / "bin" / "paddock-supervise"
    if supervise.exists():
        subprocess.run(
            [SYSTEM_PYTHON, str(supervise), "stop"], capture_output=True, timeout=90, check=False
        )
    with contextlib.suppress(KeyError):
        uid = pwd.getpwnam(machine.user).pw_uid
        for entry in os.listdir("/proc"):  # only this test's throwaway user runs as that uid
            with contextlib.suppress(OSError):
                if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
        subprocess.run(["userdel", machine.user], check=False, capture_output=True)
    with contextlib.suppress(KeyError):
        grp.getgrnam(machine.user)
        subprocess.run(["groupdel", machine.user], check=False, capture_output=True)
    shutil.rmtree(machine.base, ignore_errors=True)


@needs_host
def test_fleet_one_host_fails_and_rolls_back_the_other_deploys_and_serves(fleet: Fleet) -> None:
    first = fleet.first
    assert first is not None
    assert first.returncode == 1, first.stdout + first.stderr  # the worst: rolled back
    for name in ("east", "west"):
        # Each host's lines carry its name; each ran the steps in order, up to where it stopped.
        started = re.findall(rf"^{name}: \[\d+/10\] (\w+) \.\.\.$", first.stdout, re.M)
        assert started == list(STEPS if name == "east" else STEPS[: STEPS.index("config") + 1])
    assert "west: [6/10] config: FAILED: failure injected" in first.stdout
    assert "west: deploy failed at step config" in first.stderr
    rows = _summary(first.stdout)
    assert rows["east"][:2] == ["deployed", "-"] and rows["east"][2].startswith("0.1.0-")
    assert rows["west"][:3] == ["rolled back", "config", "-"]
    assert fleet.stored() == {"east"}
    ran = fleet.run_id(fleet.machines[0])
    # The turn acts as its role (named in the fence's passwd), not as the service user.
    assert (ran.returncode, ran.stdout.strip()) == (0, "builder"), ran.stderr
    fleet.pids["east"] = fleet.machines[0].server_pid()


@needs_host
def test_fleet_from_sources_builds_the_wheel_once_for_every_host(fleet: Fleet) -> None:
    again = fleet.deploy(prebuilt=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("building the paddock wheel from") == 1
    rows = _summary(again.stdout)
    assert rows["east"][0] == "unchanged"  # the same sources: the same wheel, nothing to do
    assert rows["west"][0] == "deployed"
    assert rows["east"][2] == rows["west"][2]  # one release everywhere
    assert fleet.machines[0].server_pid() == fleet.pids["east"]
    assert fleet.stored() == {"east", "west"}
    for machine in fleet.machines:
        ran = fleet.run_id(machine)
        assert (ran.returncode, ran.stdout.strip()) == (0, "builder"), ran.stderr
        fleet.pids[machine.name] = machine.server_pid()


@needs_host
def test_fleet_rerun_with_unchanged_sources_changes_nothing_on_any_host(fleet: Fleet) -> None:
    again = fleet.deploy("--json", prebuilt=False)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = [json.loads(line) for line in again.stdout.splitlines()]
    for name in ("east", "west"):
        steps = [
            line
            for line in lines
            if line.get("host") == name
            and line.get("event") == "step"
            and line.get("status") in {"changed", "unchanged", "failed"}
        ]
        assert [s["step"] for s in steps] == list(STEPS)
        assert {s["status"] for s in steps} == {"unchanged"}, name
    summary = lines[-1]
    assert summary["event"] == "summary" and summary["exit_code"] == 0
    assert {h["host"]: h["result"] for h in summary["hosts"]} == {
        "east": "unchanged",
        "west": "unchanged",
    }
    for machine in fleet.machines:
        assert machine.server_pid() == fleet.pids[machine.name]
