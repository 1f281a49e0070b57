"""``paddock deploy USER@HOST`` through a real sshd on 127.0.0.1, then ``paddock run -t NAME``.

The deploy lands on this machine (no systemd: supervised mode) in a temporary
prefix, state root and config dir, with a throwaway service user. The stored
target lives in a temporary XDG_CONFIG_HOME. The tests run in file order
against that one host: deploy, a turn over the SSH route, a no-op re-run that
switches the entry to the direct HTTPS route, a turn over that, then failures.
The agent side's own rules are tested first, without a host.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_support import REPO, STEPS, SYSTEM_PYTHON, dependency_wheelhouse, finished_steps
from sshd import SSHD, Sshd, free_port

from agent_side.deploy import (
    DeployRequest,
    _finish,
    _Outcome,
    _Progress,
    build_wheel,
    checked_script,
    checked_wheel,
    direct_url,
    script_options,
    source_root,
)
from agent_side.errors import UsageError
from agent_side.ssh import Endpoint
from target_side.config import load_settings

CLI = [sys.executable, "-m", "agent_side.cli"]
NAME = "lab"

needs_host = pytest.mark.skipif(
    os.geteuid() != 0
    or not os.path.exists(SSHD)
    or not os.path.exists(SYSTEM_PYTHON)
    or shutil.which("setpriv") is None
    or shutil.which("useradd") is None,
    reason="deploying needs root, sshd, the system python3, setpriv and useradd",
)


# --- the agent side of the deploy, without a host ----------------------------------------


@pytest.fixture
def environ(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def _endpoint(hostname: str) -> Endpoint:
    return Endpoint(alias=hostname, hostname=hostname, port=22, user="root", identity_files=())


def test_direct_url_reaches_wildcard_listeners_by_the_ssh_host_and_loopback_only_locally() -> None:
    assert direct_url({"listen": "0.0.0.0:8443"}, _endpoint("build")) == "https://build:8443"
    assert direct_url({"listen": "[::]:9"}, _endpoint("::1")) == "https://[::1]:9"
    assert direct_url({"listen": "127.0.0.1:8443"}, _endpoint("127.0.0.1")) == (
        "https://127.0.0.1:8443"
    )
    with pytest.raises(UsageError, match="not reachable from here"):
        direct_url({"listen": "127.0.0.1:8443"}, _endpoint("build"))


def _request(**changes: object) -> DeployRequest:
    return DeployRequest(destination="root@127.0.0.1", roles=("builder",), **changes)


def test_deploy_statuses_follow_the_script_and_125_when_no_result_arrives(environ, capsys) -> None:
    endpoint = _endpoint("127.0.0.1")
    dropped = _Outcome(status=None, result=None)
    assert _finish(dropped, _request(), endpoint, "x", environ) == 125
    assert "dropped before the deploy's result" in capsys.readouterr().err
    assert _finish(_Outcome(status=2), _request(), endpoint, "x", environ) == 2
    failed = {
        "event": "result",
        "ok": False,
        "failed_step": "config",
        "error": "boom",
        "rolled_back": True,
        "rollback_problems": [],
        "summary": "rolled back: fine",
    }
    assert _finish(_Outcome(1, failed), _request(), endpoint, "x", environ) == 1
    assert "deploy failed at step config: boom" in capsys.readouterr().err
    stuck = failed | {"rolled_back": False, "rollback_problems": ["current: EIO"]}
    assert _finish(_Outcome(3, stuck), _request(), endpoint, "x", environ) == 3
    assert _finish(_Outcome(None, stuck), _request(), endpoint, "x", environ) == 3
    assert "ROLLBACK IS INCOMPLETE" in capsys.readouterr().err
    assert not (Path(environ["XDG_CONFIG_HOME"]) / "paddock").exists()  # nothing stored


def test_deploy_progress_shows_steps_and_makes_target_text_harmless(capsys) -> None:
    progress = _Progress(False, sys.stdout)
    lines = [
        {"event": "step", "index": 3, "total": 10, "step": "dirs", "status": "started"},
        {
            "event": "step",
            "index": 3,
            "total": 10,
            "step": "dirs",
            "status": "running",
            "detail": "still \x1b[31mred",
        },
        {
            "event": "step",
            "index": 3,
            "total": 10,
            "step": "dirs",
            "status": "changed",
            "detail": "made \x1b[31mred",
        },
        {
            "event": "step",
            "index": 4,
            "total": 10,
            "step": "release",
            "status": "failed",
            "detail": "pip said no",
        },
        {"event": "note", "detail": "careful"},
        {"event": "rollback", "detail": "undone: x"},
        {"event": "result", "ok": False, "tokens": {}},
    ]
    for line in lines:
        progress.line(json.dumps(line).encode() + b"\n")
    progress.line(b"not json\n")
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "[3/10] dirs ...",
        "  dirs: still \\x1b[31mred",
        "[3/10] dirs: made \\x1b[31mred",
        "[4/10] release: FAILED: pip said no",
        "  careful",
        "  rollback: undone: x",
    ]
    assert "target: not json" in err
    assert progress.outcome.result == lines[-1] and progress.outcome.garbled == ["not json"]


def test_deploy_refuses_relative_paths_and_a_renamed_wheel(tmp_path) -> None:
    with pytest.raises(UsageError, match="absolute path on the target"):
        script_options([("--prefix", "opt/paddock")], None)
    assert script_options([("--user", "svc"), ("--listen", None)], "config") == (
        "--user",
        "svc",
        "--fail-at",
        "config",
    )
    renamed = tmp_path / "paddock.whl"
    renamed.write_bytes(b"")
    with pytest.raises(UsageError, match="file name"):
        checked_wheel(renamed)
    not_an_archive = tmp_path / "paddock-deploy"
    not_an_archive.write_text("#!/usr/bin/python3\n")
    with pytest.raises(UsageError, match=r"not a paddock-deploy\.pyz file"):
        checked_script(not_an_archive)


# --- a deployed host --------------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    wheel: Path
    wheelhouse: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """This checkout's wheel, built once by paddock deploy's own builder, and its dependencies."""
    root = tmp_path_factory.mktemp("deploy-ssh-wheel")
    source = source_root()
    assert source == REPO
    leftovers = {p.name for p in REPO.iterdir()}
    wheel = build_wheel(source, root / "dist")
    # The build ran on a copy: nothing new in the checkout (no build/, no *.egg-info).
    assert {p.name for p in REPO.iterdir()} == leftovers
    wheelhouse = dependency_wheelhouse(tmp_path_factory, wheel)
    return Built(wheel, wheelhouse)


@dataclass
class Host:
    """This machine as a deploy target, reached through ``sshd``; ``home`` is the agent's."""

    base: Path
    user: str
    port: int
    sshd: Sshd
    known_hosts: Path
    home: Path
    built: Built
    first: subprocess.CompletedProcess[str] | None = None
    uploads_dir: Path = Path("/nonexistent")

    @property
    def workspace(self) -> Path:
        return self.base / "work"

    def uploads(self) -> set[str]:
        """What ``paddock deploy`` left in the target login's TMPDIR."""
        return {p.name for p in self.uploads_dir.iterdir()}

    @property
    def config_dir(self) -> Path:
        return self.base / "etc"

    @property
    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid

    @property
    def role_uid(self) -> int:
        """The host uid the builder role's turns run as (never the service user's)."""
        return load_settings(self.config_dir / "target.toml").role_ids("builder")[0]

    @property
    def stored(self) -> Path:
        return self.home / "xdg" / "paddock"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDOCK_", "SSH_"))}
        return env | {
            "PYTHONPATH": str(REPO),
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / "xdg"),
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

    def deploy(
        self,
        *extra: str,
        roles: tuple[str, ...] = ("builder",),
        known: bool = True,
        prebuilt: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``paddock deploy``; with ``prebuilt`` False it builds the wheel from this checkout."""
        ssh = ["-i", str(self.sshd.client_key)]
        if known:
            ssh += ["--known-hosts", str(self.known_hosts)]
        wheel = ["--wheel", str(self.built.wheel)] if prebuilt else []
        return self.paddock(
            "deploy",
            self.sshd.destination,
            *ssh,
            "--name",
            NAME,
            *(arg for role in roles for arg in ("--role", role)),
            *wheel,
            "--wheelhouse",
            str(self.built.wheelhouse),
            "--prefix",
            str(self.base / "opt"),
            "--state-root",
            str(self.base / "state"),
            "--config-dir",
            str(self.config_dir),
            "--user",
            self.user,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--workspace",
            str(self.workspace),
            "--launcher-socket",
            str(self.base / "run" / "launcher.sock"),
            "--bin-dir",
            str(self.base / "bin"),
            # The system python3: root's shell here may put another first on the PATH.
            "--service",
            "supervised",
            "--python",
            SYSTEM_PYTHON,
            *extra,
            timeout=240,
        )

    def run_id(self) -> subprocess.CompletedProcess[str]:
        cwd = str(self.workspace / "builder")
        return self.paddock("run", "-t", NAME, "--cwd", cwd, "--", "id", "-u")

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

    def table(self) -> dict[str, object]:
        entry: dict[str, object] = tomllib.loads((self.stored / "targets.toml").read_text())[
            "targets"
        ][NAME]
        return entry


@pytest.fixture(scope="module")
def host(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    # Not under pytest's basetemp: that is 0700, and the service user must reach its files.
    base = Path(tempfile.mkdtemp(prefix="pdk-deploy-ssh-", dir="/tmp"))
    os.chmod(base, 0o755)
    home = tmp_path_factory.mktemp("agent-home")
    # Logins get a TMPDIR of their own: what this test uploads is all that lands there.
    uploads = tmp_path_factory.mktemp("uploads")
    settings = (f"SetEnv TMPDIR={uploads}",)
    with Sshd(tmp_path_factory.mktemp("deploy-sshd"), settings=settings) as sshd:
        known = sshd.write_known_hosts(tmp_path_factory.mktemp("known") / "known_hosts")
        target = Host(base, f"pdk{secrets.token_hex(3)[:5]}", free_port(), sshd, known, home, built)
        try:
            target.uploads_dir = uploads
            target.first = target.deploy()
            assert target.first.returncode == 0, target.first.stdout + target.first.stderr
            yield target
        finally:
            _tear_down(target)


def _tear_down(target: Host) -> None:
    supervise = target.base / "opt" / "bin" / "paddock-supervise"
    if supervise.exists():
        subprocess.run(
            [SYSTEM_PYTHON, str(supervise), "stop"], capture_output=True, timeout=90, check=False
        )
    with contextlib.suppress(KeyError):
        uid = pwd.getpwnam(target.user).pw_uid
        for entry in os.listdir("/proc"):  # only this test's throwaway user runs as that uid
            with contextlib.suppress(OSError):
                if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
        subprocess.run(["userdel", target.user], check=False, capture_output=True)
    with contextlib.suppress(KeyError):
        grp.getgrnam(target.user)
        subprocess.run(["groupdel", target.user], check=False, capture_output=True)
    shutil.rmtree(target.base, ignore_errors=True)


@needs_host
def test_deploy_over_ssh_shows_each_step_and_stores_the_target(host: Host) -> None:
    first = host.first
    assert first is not None
    started = re.findall(r"^\[\d+/10\] (\w+) \.\.\.$", first.stdout, re.M)
    ended = re.findall(r"^\[\d+/10\] (\w+): ", first.stdout, re.M)
    assert started == ended == list(STEPS)
    assert "[1/10] preflight: root, Python" in first.stdout
    # The SSH host was checked before the script's first step.
    assert first.stdout.index("host key verified") < first.stdout.index("[1/10] preflight ...")
    assert f"next: paddock run -t {NAME} -- CMD" in first.stdout
    table = host.table()
    assert table["route"] == "ssh" and table["ssh"] == host.sshd.destination
    assert table["url"] == f"https://127.0.0.1:{host.port}"
    assert table["known_hosts"] == [str(host.known_hosts)]
    assert table["identity_files"] == [str(host.sshd.client_key)]
    assert table["default_role"] == "builder"
    token_file = host.stored / str(table["tokens"]["builder"])  # type: ignore[index]
    token = token_file.read_text().strip()
    assert token and token not in first.stdout + first.stderr  # stored, never printed
    assert str(token_file) in first.stdout
    assert stat.S_IMODE(host.stored.stat().st_mode) == 0o700
    for path in (host.stored / "targets.toml", token_file, host.stored / str(table["ca_file"])):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    pinned = (host.stored / str(table["ca_file"])).read_text()
    assert pinned == (host.config_dir / "tls" / "ca.pem").read_text()
    assert f"paddock-deploy.pyz to {host.uploads_dir}/paddock-deploy." in first.stdout
    assert host.uploads() == set()  # the uploaded directory is gone


@needs_host
def test_run_with_the_stored_target_goes_through_the_ssh_route(host: Host) -> None:
    logins = host.sshd.accepted_logins()
    ran = host.run_id()
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == str(host.role_uid)
    assert host.sshd.accepted_logins() == logins + 1  # one SSH connection carried the turn
    health = host.paddock("health", "-t", NAME)
    assert json.loads(health.stdout)["status"] in {"armed", "degraded"}, health.stderr


@needs_host
@needs_host
def test_wheel_built_twice_from_the_same_sources_is_the_same(built: Built, tmp_path) -> None:
    again = build_wheel(REPO, tmp_path / "dist")
    assert again.name == built.wheel.name
    assert _sha256(again) == _sha256(built.wheel)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@needs_host
def test_rerun_building_the_same_sources_changes_nothing_and_can_store_the_https_route(
    host: Host,
) -> None:
    pid = host.server_pid()
    token = (host.stored / f"targets/{NAME}/token-builder").read_text()
    before = host.uploads()
    # paddock deploy builds the wheel itself this time: the same sources give the same wheel.
    again = host.deploy("--route", "https", "--json", prebuilt=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"built {host.built.wheel.name} (sha256 {_sha256(host.built.wheel)[:12]})" in (
        again.stderr  # paddock's own stages: on stderr with --json
    )
    lines = [json.loads(line) for line in again.stdout.splitlines()]
    steps = finished_steps(lines)
    assert [s["step"] for s in steps] == list(STEPS)
    assert {s["status"] for s in steps} == {"unchanged"}
    assert all("nothing to do" in s["detail"] for s in steps[1:-1])
    result = next(line for line in lines if line["event"] == "result")
    assert result["ok"] and not result["changed"] and result["tokens"] == {}
    assert lines[-1]["event"] == "target" and lines[-1]["route"] == "https"
    assert host.server_pid() == pid
    assert (host.stored / f"targets/{NAME}/token-builder").read_text() == token  # kept
    assert host.table()["route"] == "https"
    assert host.table()["url"] == f"https://127.0.0.1:{host.port}"
    assert host.uploads() == before
    logins = host.sshd.accepted_logins()
    ran = host.run_id()
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == str(host.role_uid)
    assert host.sshd.accepted_logins() == logins  # straight over HTTPS, pinned CA


@needs_host
def test_failed_deploy_rolls_back_and_the_previous_install_keeps_serving(host: Host) -> None:
    pid = host.server_pid()
    before = host.uploads()
    failed = host.deploy("--fail-at", "config", roles=("builder", "reviewer"))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "[6/10] config: FAILED: failure injected" in failed.stdout
    assert "rollback: undone:" in failed.stdout
    assert "deploy failed at step config" in failed.stderr
    assert "reviewer" not in host.table()["tokens"]  # type: ignore[operator]
    assert host.uploads() == before
    assert host.server_pid() == pid
    ran = host.run_id()
    assert ran.returncode == 0 and ran.stdout.strip() == str(host.role_uid), ran.stderr


@needs_host
def test_refused_deploy_exits_2_and_changes_nothing(host: Host) -> None:
    refused = host.deploy("--fail-at", "preflight")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "nothing was changed" in refused.stderr


@needs_host
def test_unknown_host_key_fails_with_125_before_anything_is_built_or_run(host: Host) -> None:
    before = host.uploads()
    refused = host.deploy(known=False, prebuilt=False)
    assert refused.returncode == 125, refused.stdout + refused.stderr
    assert "SSH host key unknown" in refused.stderr and "ssh-keyscan" in refused.stderr
    assert "building" not in refused.stdout + refused.stderr
    assert host.uploads() == before
