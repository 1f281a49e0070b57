"""paddock-deploy.pyz onto this machine: real wheels, a real service user, a real server.

No systemd runs here, so the target is deployed in supervised mode into a
temporary prefix, state root and config dir, with a throwaway service user.
The tests run in file order against that one host: first deploy, a turn,
a no-op re-run, a new role, a failure injected at every step of an upgrade,
then the upgrade itself. The script is the zipapp ``paddock deploy`` uploads, built
from deploy/paddock_deploy by the same function.
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
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from conftest import events, output, wait_until
from deploy_support import (
    REPO,
    STEPS,
    SYSTEM_PYTHON,
    dependency_wheelhouse,
    finished_steps,
    print_unit,
)

from paddock_deploy.archive import build_archive
from paddock_deploy.protocol import ARCHIVE_NAME
from target_side.config import load_settings

RESTARTING = {"restart", "health"}
"""Steps after which the server already runs the new release: a rollback restarts the old one."""

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="deploying needs root (useradd, chown)"),
    pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no system python3"),
    pytest.mark.skipif(
        shutil.which("setpriv") is None or shutil.which("useradd") is None,
        reason="setpriv and useradd are needed",
    ),
]


# --- wheels ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheels:
    old: Path
    new: Path
    wheelhouse: Path


def _copy_tree(destination: Path) -> None:
    """The working tree as it is (tracked and new files), without tests or caches."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in (n.decode() for n in listed if n):
        source = REPO / name
        if name.startswith(("tests/", "bench/")) or not source.is_file():
            continue
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination / name)


def _bump(tree: Path, version: str) -> None:
    for name, pattern in (
        ("pyproject.toml", r'^version = "[^"]+"'),
        ("shared/__init__.py", r'^__version__ = "[^"]+"'),
    ):
        path = tree / name
        replaced = re.sub(
            pattern,
            pattern.split(" = ")[0].lstrip("^") + f' = "{version}"',
            path.read_text(),
            count=1,
            flags=re.M,
        )
        path.write_text(replaced)


def _build(tree: Path, out: Path) -> subprocess.Popen[bytes]:
    # From a copy: an in-tree build would leave build/ behind, and reuse stale files from it.
    return subprocess.Popen(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(tree)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait(proc: subprocess.Popen[bytes], what: str) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{what}: {out.decode(errors='replace')[-2000:]}"


@pytest.fixture(scope="session")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """paddock-deploy.pyz, built as ``paddock deploy`` builds it before uploading it."""
    return build_archive(tmp_path_factory.mktemp("deploy-script") / ARCHIVE_NAME)


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    """The working tree as 0.1.0 and as 0.1.1, and a wheelhouse of their dependencies."""
    root = tmp_path_factory.mktemp("wheels")
    old_tree, new_tree, old_out, new_out = (root / n for n in ("old", "new", "old-w", "new-w"))
    for tree in (old_tree, new_tree):
        tree.mkdir()
        _copy_tree(tree)
    _bump(old_tree, "0.1.0")
    _bump(new_tree, "0.1.1")
    building = [_build(old_tree, old_out), _build(new_tree, new_out)]
    _wait(building[0], "building the 0.1.0 wheel")
    old = next(old_out.glob("paddock-0.1.0-*.whl"))
    wheelhouse = dependency_wheelhouse(tmp_path_factory, old)
    _wait(building[1], "building the 0.1.1 wheel")
    new = next(new_out.glob("paddock-0.1.1-*.whl"))
    os.chmod(root, 0o755)
    return Wheels(old, new, wheelhouse)


# --- the host -------------------------------------------------------------------------------


@dataclass
class Host:
    """One deployed target on this machine, and the knobs of its deploy."""

    base: Path
    user: str
    port: int
    wheels: Wheels
    script: Path
    tokens: dict[str, str] = field(default_factory=dict)
    first: list[dict[str, Any]] = field(default_factory=list)

    @property
    def prefix(self) -> Path:
        return self.base / "opt"

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def config_dir(self) -> Path:
        return self.base / "etc"

    @property
    def config(self) -> Path:
        return self.config_dir / "target.toml"

    @property
    def workspace(self) -> Path:
        return self.base / "work"

    @property
    def bin_dir(self) -> Path:
        return self.base / "bin"

    @property
    def socket(self) -> Path:
        return self.base / "run" / "launcher.sock"

    def role_ids(self, role: str = "builder") -> tuple[int, int]:
        return load_settings(self.config).role_ids(role)

    @property
    def ca(self) -> Path:
        return self.config_dir / "tls" / "ca.pem"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid

    def deploy(self, wheel: Path, *extra: str, roles: tuple[str, ...] = ("builder",)) -> Deployed:
        argv = [
            SYSTEM_PYTHON,
            str(self.script),
            "--wheel",
            str(wheel),
            "--json",
            *(arg for role in roles for arg in ("--role", role)),
            "--prefix",
            str(self.prefix),
            "--state-root",
            str(self.state),
            "--config-dir",
            str(self.config_dir),
            "--user",
            self.user,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--workspace",
            str(self.workspace),
            "--launcher-socket",
            str(self.socket),
            "--bin-dir",
            str(self.bin_dir),
            "--find-links",
            str(self.wheels.wheelhouse),
            "--no-index",
            *extra,
        ]
        started = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        return Deployed(
            proc.returncode, lines, proc.stdout, proc.stderr, time.monotonic() - started
        )

    def supervise(self, command: str) -> dict[str, Any]:
        proc = subprocess.run(
            [SYSTEM_PYTHON, str(self.prefix / "bin" / "paddock-supervise"), command],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
        return result

    def server(self) -> dict[str, Any]:
        server: dict[str, Any] = self.supervise("status")["server"]
        assert server is not None and server["alive"], "no supervised server runs"
        return server

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify = ssl.create_default_context(cafile=str(self.ca))
        return httpx.Client(base_url=self.url, verify=verify, headers=headers, timeout=30)

    def health(self) -> dict[str, Any]:
        with self.client() as c:
            response = c.get("/v1/health")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def releases(self) -> set[str]:
        return {p.name for p in (self.prefix / "releases").iterdir()}

    def current(self) -> str:
        return Path(os.path.realpath(self.prefix / "current")).name

    def as_user(self, *argv: str) -> subprocess.CompletedProcess[str]:
        pw = pwd.getpwnam(self.user)
        return subprocess.run(
            [
                "setpriv",
                f"--reuid={pw.pw_uid}",
                f"--regid={pw.pw_gid}",
                "--init-groups",
                "--",
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "HOME": pw.pw_dir, "LANG": "C.UTF-8"},
        )


@dataclass
class Deployed:
    """One run of the deploy script: exit status, its JSON lines, its raw output."""

    status: int
    lines: list[dict[str, Any]]
    stdout: str
    stderr: str
    seconds: float

    @property
    def result(self) -> dict[str, Any]:
        results = [line for line in self.lines if line.get("event") == "result"]
        assert len(results) == 1, self.stdout + self.stderr
        return results[0]

    def steps(self) -> dict[str, str]:
        """How each step ended."""
        return {line["step"]: line["status"] for line in finished_steps(self.lines)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
    return found


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def host(wheels: Wheels, script: Path) -> Iterator[Host]:
    """A first deploy of 0.1.0 with role ``builder``; torn down with its user afterwards."""
    # Not under pytest's basetemp: that is 0700, and the service user must reach its files.
    base = Path(tempfile.mkdtemp(prefix="pdk-deploy-", dir="/tmp"))
    os.chmod(base, 0o755)  # the service user must reach its files below
    target = Host(base, f"pdk{secrets.token_hex(3)[:5]}", _free_port(), wheels, script)
    try:
        first = target.deploy(wheels.old)
        target.first = first.lines
        assert first.status == 0, first.stdout + first.stderr
        target.tokens.update(first.result["tokens"])
        yield target
    finally:
        _tear_down(target)


def _tear_down(target: Host) -> None:
    if (target.prefix / "bin" / "paddock-supervise").exists():
        with contextlib.suppress(AssertionError, subprocess.SubprocessError, ValueError):
            target.supervise("stop")
    with contextlib.suppress(KeyError):
        uid = pwd.getpwnam(target.user).pw_uid
        for pid in _processes_of(uid):  # only this test's throwaway user: nothing else runs as it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["userdel", target.user], check=False, capture_output=True)
    with contextlib.suppress(KeyError):
        grp.getgrnam(target.user)
        subprocess.run(["groupdel", target.user], check=False, capture_output=True)
    shutil.rmtree(target.base, ignore_errors=True)


# --- first deploy ---------------------------------------------------------------------------


def test_deploy_first_run_installs_everything_and_serves_health_over_tls(host: Host) -> None:
    steps = finished_steps(host.first)
    assert [s["step"] for s in steps] == list(STEPS)
    assert all(s["status"] == "changed" for s in steps[1:9]), steps
    result = next(line for line in host.first if line.get("event") == "result")
    assert result["ok"] and result["changed"]
    assert result["release"].startswith("0.1.0-") and host.current() == result["release"]
    assert result["url"] == host.url
    assert result["service"]["mode"] == "supervised"
    health = host.health()
    assert health["status"] in {"armed", "degraded"} and health["version"] == "0.1.0"
    assert health["backend"] == "bubblewrap"
    assert result["ca_sha256"] == _fingerprint(host.ca.read_text())


def test_deploy_files_are_owned_and_private_as_the_server_needs(host: Host) -> None:
    uid, gid = pwd.getpwnam(host.user).pw_uid, grp.getgrnam(host.user).gr_gid
    role_uid, _ = host.role_ids()
    expect = {
        host.state: (uid, 0o711),  # searchable: turns reach their home by path
        host.config: (0, 0o640),
        host.config_dir / "tls" / "key.pem": (uid, 0o600),
        host.ca: (0, 0o644),
        host.workspace: (0, 0o755),
        # The role writes, the server reads (setgid: what the role makes stays readable).
        host.workspace / "builder": (role_uid, 0o2750),
        host.socket: (0, 0o660),
    }
    for path, (owner, mode) in expect.items():
        st = path.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (owner, mode), path
    for shared_with_the_server in (host.config, host.workspace / "builder", host.socket):
        assert shared_with_the_server.stat().st_gid == gid, shared_with_the_server
    assert 'launcher = "' in host.config.read_text() and "identity" not in host.config.read_text()
    user = pwd.getpwnam(host.user)
    assert user.pw_shell.endswith("nologin") and user.pw_dir == str(host.state)
    release = host.prefix / "releases" / host.current()
    assert release.stat().st_uid == 0 and not release.stat().st_mode & 0o022


def test_deploy_token_is_shown_once_and_only_its_hash_is_kept(host: Host) -> None:
    token = host.tokens["builder"]
    raw = json.dumps(host.first)
    assert raw.count(token) == 1  # the result line, and nowhere else
    assert token not in host.config.read_text()
    for log in (host.state / "supervisor").glob("*.log"):
        assert token not in log.read_text(errors="replace")


def test_deploy_server_runs_supervised_as_the_service_user(host: Host) -> None:
    server = host.server()
    assert os.stat(f"/proc/{server['pid']}").st_uid == host.uid
    status = Path(f"/proc/{server['pid']}/status").read_text()
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.M)
    assert re.search(r"^CapBnd:\s+0+$", status, re.M)


LAUNCHER_CAPS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)
"""CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_KILL, CAP_SETGID, CAP_SETUID: all the launcher keeps."""


def test_deploy_launcher_runs_as_root_with_only_its_capabilities(host: Host) -> None:
    launcher = host.supervise("status")["launcher"]
    assert launcher and launcher["alive"] and launcher["ready"], launcher
    status = Path(f"/proc/{launcher['pid']}/status").read_text()
    assert re.search(r"^Uid:\s+0\s+0\s+0\s+0$", status, re.M)
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.M)
    bounding = re.search(r"^CapBnd:\s+([0-9a-f]+)$", status, re.M)
    assert bounding and int(bounding[1], 16) == LAUNCHER_CAPS, status


def test_deploy_turn_runs_over_https_as_the_roles_own_uid(host: Host) -> None:
    role_uid, _ = host.role_ids()
    workspace = host.workspace / "builder"
    with host.client(host.tokens["builder"]) as c:
        response = c.post(
            "/v1/turns",
            json={
                "role": "builder",
                "argv": ["sh", "-c", "id -u && touch made-by-a-turn"],
                "cwd": str(workspace),
            },
        )
        assert response.status_code == 201, response.text
        evs = events(c, response.json()["turn_id"])
    assert output(evs).strip() == str(role_uid) != str(host.uid)
    assert evs[-1].kind == "exit" and evs[-1].exit_code == 0
    made = (workspace / "made-by-a-turn").stat()
    assert (made.st_uid, made.st_gid) == (role_uid, grp.getgrnam(host.user).gr_gid)


# --- re-runs --------------------------------------------------------------------------------


def test_deploy_rerun_changes_nothing_and_keeps_the_server(host: Host) -> None:
    pid = host.server()["pid"]
    again = host.deploy(host.wheels.old)
    assert again.status == 0, again.stdout + again.stderr
    assert set(again.steps().values()) == {"unchanged"}, again.steps()
    assert not again.result["changed"] and again.result["tokens"] == {}
    assert all(
        "nothing to do" in line["detail"]
        for line in finished_steps(again.lines)
        if line["step"] not in {"preflight", "health"}
    )
    assert host.server()["pid"] == pid


def test_deploy_says_when_each_step_starts_and_beats_only_inside_it(host: Host) -> None:
    seen = [(line["step"], line["status"]) for line in host.first if line.get("event") == "step"]
    bare = [pair for pair in seen if pair[1] != "running"]
    assert bare[0::2] == [(step, "started") for step in STEPS]
    assert [step for step, _ in bare[1::2]] == list(STEPS)
    current = None
    for step, status in seen:  # a heartbeat names the step that is running at the time
        if status == "started":
            current = step
        elif status == "running":
            assert step == current
        else:
            assert step == current
            current = None


def test_deploy_links_paddock_target_onto_roots_path(host: Host) -> None:
    link = host.bin_dir / "paddock-target"
    assert os.readlink(link) == str(host.prefix / "current" / "bin" / "paddock-target")
    proc = subprocess.run(
        [str(link), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_deploy_puts_a_foreign_command_link_back_on_rollback_and_fixes_it_on_a_rerun(
    host: Host,
) -> None:
    link = host.bin_dir / "paddock-target"
    wanted = os.readlink(link)
    link.unlink()
    link.symlink_to("/elsewhere/paddock-target")
    pid = host.server()["pid"]
    failed = host.deploy(host.wheels.old, "--fail-at", "switch")
    assert failed.status == 1 and failed.result["rolled_back"], failed.stdout
    assert os.readlink(link) == "/elsewhere/paddock-target"
    fixed = host.deploy(host.wheels.old)
    assert fixed.status == 0, fixed.stdout + fixed.stderr
    assert fixed.steps()["switch"] == "changed" and fixed.steps()["restart"] == "unchanged"
    switch = next(line for line in finished_steps(fixed.lines) if line["step"] == "switch")
    assert "(was -> /elsewhere/paddock-target)" in switch["detail"]
    assert os.readlink(link) == wanted
    assert host.server()["pid"] == pid


def test_deploy_new_role_gets_a_token_and_old_tokens_still_work(host: Host) -> None:
    added = host.deploy(host.wheels.old, roles=("builder", "reviewer"))
    assert added.status == 0, added.stdout + added.stderr
    assert set(added.result["tokens"]) == {"reviewer"}
    assert added.steps()["config"] == "changed" and added.steps()["restart"] == "changed"
    host.tokens.update(added.result["tokens"])
    for role, token in host.tokens.items():
        with host.client(token) as c:
            listed = c.get("/v1/turns")
        assert listed.status_code == 200, (role, listed.text)


# --- failures while building, then the upgrade ------------------------------------------------

BUILDING = ("release", "health")
"""Failing these on an upgrade builds 0.1.1 afresh: right after it is built, and with the
server already restarted on it. The other steps fail later, against a kept 0.1.1 release."""


def _fail_upgrade(host: Host, step: str, *, builds: bool) -> None:
    """Upgrade to 0.1.1 with a failure injected after ``step``: nothing may have changed."""
    before = host.server()
    release, releases = host.current(), host.releases()
    config = host.config.read_bytes()
    tls = sorted((p.name, p.read_bytes()) for p in (host.config_dir / "tls").iterdir())
    failed = host.deploy(host.wheels.new, "--fail-at", step)
    result = failed.result
    assert not result["ok"] and result["failed_step"] == step
    assert failed.steps()[step] == "failed"
    # Until the first change (a build, or else the switch) the exit status is 2, "nothing was
    # changed"; after it, 1, "rolled back".
    unchanged = STEPS.index(step) < STEPS.index("release" if builds else "switch")
    assert failed.status == (2 if unchanged else 1), failed.stdout
    assert result["rolled_back"] is not unchanged and result["rollback_problems"] == []
    assert host.current() == release
    assert host.releases() == releases  # no half-built (or unused) new release is left
    assert host.config.read_bytes() == config
    assert sorted((p.name, p.read_bytes()) for p in (host.config_dir / "tls").iterdir()) == tls
    after = host.server()
    assert after["release"] == before["release"]
    if step in RESTARTING:
        assert "serving again" in result["summary"]
    else:
        assert after["pid"] == before["pid"]
    assert host.health()["version"] == "0.1.0"
    assert not list(host.config_dir.glob(".staging-*")) and not list(host.prefix.glob(".current-*"))


@pytest.mark.parametrize("step", BUILDING)
def test_deploy_failure_after_building_leaves_the_previous_install_serving(
    host: Host, step: str
) -> None:
    _fail_upgrade(host, step, builds=True)


def test_deploy_upgrade_switches_release_and_keeps_tokens_config_and_ledger(host: Host) -> None:
    old_release, old_pid = host.current(), host.server()["pid"]
    config = host.config.read_bytes()
    ledger_before = _ledger_count(host)
    upgraded = host.deploy(host.wheels.new, roles=("builder", "reviewer"))
    assert upgraded.status == 0, upgraded.stdout + upgraded.stderr
    result = upgraded.result
    assert result["release"].startswith("0.1.1-") and result["previous_release"] == old_release
    assert result["tokens"] == {}
    assert upgraded.steps()["release"] == "changed"
    assert upgraded.steps()["switch"] == "changed" and upgraded.steps()["restart"] == "changed"
    assert host.current() == result["release"] and old_release in host.releases()
    assert host.server()["pid"] != old_pid
    assert host.health()["version"] == "0.1.1"
    assert host.config.read_bytes() == config
    with host.client(host.tokens["builder"]) as c:
        response = c.post(
            "/v1/turns",
            json={"role": "builder", "argv": ["id", "-u"], "cwd": str(host.workspace / "builder")},
        )
        assert response.status_code == 201, response.text
        assert output(events(c, response.json()["turn_id"])).strip() == str(host.role_ids()[0])
    assert _ledger_count(host) > ledger_before


def test_deploy_back_to_a_kept_release_switches_without_building(host: Host) -> None:
    newer = host.current()
    back = host.deploy(host.wheels.old, roles=("builder", "reviewer"))
    assert back.status == 0, back.stdout + back.stderr
    release_line = next(s for s in finished_steps(back.lines) if s["step"] == "release")
    assert "built before; reusing it" in release_line["detail"]
    assert back.steps()["switch"] == "changed" and back.result["previous_release"] == newer
    assert host.health()["version"] == "0.1.0" and newer in host.releases()
    with host.client(host.tokens["builder"]) as c:
        assert c.get("/v1/turns").status_code == 200


@pytest.mark.parametrize("step", [s for s in STEPS if s not in BUILDING])
def test_deploy_failure_at_each_other_step_leaves_the_previous_install_serving(
    host: Host, step: str
) -> None:
    # 0.1.1 is a kept release now: these runs switch to it without building, then fail.
    _fail_upgrade(host, step, builds=False)


def test_deploy_failure_on_a_fresh_host_leaves_nothing_behind(wheels: Wheels, script: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="pdk-fresh-", dir="/tmp"))
    os.chmod(base, 0o755)
    fresh = Host(base, f"pdk{secrets.token_hex(3)[:5]}", _free_port(), wheels, script)
    try:
        failed = fresh.deploy(wheels.old, "--fail-at", "health")
        assert failed.status == 1 and failed.result["rolled_back"], failed.stdout
        assert failed.steps()["restart"] == "changed"  # a server ran, and was stopped again
        assert list(base.iterdir()) == []  # prefix, state, config and workspace all gone
        with pytest.raises(KeyError):
            pwd.getpwnam(fresh.user)
        # Nothing of this deploy runs on (zombies, which have no command line, do not count).
        assert wait_until(lambda: not _processes_mentioning(str(base)), timeout=10)
    finally:
        _tear_down(fresh)


def _ledger_count(host: Host) -> int:
    verified = host.as_user(
        str(host.prefix / "current" / "bin" / "paddock-target"),
        "ledger",
        "verify",
        "--config",
        str(host.config),
    )
    assert verified.returncode == 0, verified.stderr
    found = re.search(r"ledger ok: (\d+) records", verified.stdout)
    assert found, verified.stdout
    return int(found[1])


# --- doctor, on the deployed host -----------------------------------------------------------


def test_doctor_on_the_deployed_host_says_what_is_enforced(host: Host) -> None:
    proc = subprocess.run(
        [
            str(host.prefix / "current" / "bin" / "paddock-target"),
            "doctor",
            "--config",
            str(host.config),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout, proc.stderr
    report = json.loads(proc.stdout)
    assert report["uid"] == host.uid  # root's run re-ran the checks as the server's user
    found = {f["area"]: f for f in report["findings"]}
    for area in (
        "config",
        "launcher",
        "workspaces",
        "backend",
        "seccomp",
        "state",
        "disk",
        "tls-key",
        "tls-cert",
    ):
        assert found[area]["status"] == "ok", found[area]
    assert found["server"]["summary"].startswith(host.url)
    assert found["forbidden"]["status"] == "info"
    assert any(str(host.state) in d for d in found["forbidden"]["details"])
    degraded = [f for f in report["findings"] if f["status"] == "degraded"]
    assert proc.returncode == (1 if degraded else 0)
    for finding in degraded:
        assert finding["fix"], finding  # every degraded finding says what to do


def test_doctor_names_each_degraded_thing_with_a_fix(
    tmp_path: Path, ca: trustme.CA, capsys: pytest.CaptureFixture[str]
) -> None:
    from target_side.tools import doctor

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    key.chmod(0o644)  # readable by everyone: the config check and the key check both say so
    (tmp_path / "ws").mkdir()
    config = tmp_path / "target.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{_free_port()}"\ntls_cert = "{cert}"\n'
        f'tls_key = "{key}"\nstate_root = "{tmp_path / "state"}"\n'
        f'[roles.builder]\ntoken_sha256 = "{"0" * 64}"\nworkspaces = ["{tmp_path / "ws"}"]\n'
    )
    config.chmod(0o600)
    found = {f.area: f for f in doctor.examine(config)}
    assert found["config"].status == "degraded"
    assert any("chmod 0600" in d for d in found["config"].details)
    assert found["tls-key"].status == "degraded" and "chmod 0600" in (found["tls-key"].fix or "")
    assert found["server"].status == "degraded"  # nothing listens on that port
    assert found["limits"].status == "degraded"
    assert "start the server" in (found["limits"].fix or "")
    assert found["backend"].status == "ok"
    assert doctor.run(config) == 1
    printed = capsys.readouterr().out
    assert "DEGRADED  tls-key" in printed and "fix: chmod 0600" in printed


@pytest.mark.parametrize(
    ("pattern", "status", "says"),
    [
        ("|/usr/share/apport/apport -p%p -s%s -c%c -d%d -P%P -- %E\n", "degraded", "apport"),
        ("|/lib/systemd/systemd-coredump %P %u %g %s %t %c %h\n", "degraded", "systemd-coredump"),
        ("core\n", "ok", "inside the fence"),
        ("/var/crash/core.%p\n", "ok", "inside the fence"),
    ],
)
def test_doctor_says_when_a_crash_in_a_fence_starts_a_program_as_root_on_the_host(
    pattern: str, status: str, says: str
) -> None:
    """A core pattern that pipes (``|``) makes the kernel start its program as root, outside
    every namespace, for each crash anywhere: a turn can crash at will, and the program reads
    what the crashed process made itself. Any other pattern writes inside the fence."""
    from target_side.tools import doctor

    found = doctor.crash_dumps(pattern)
    assert (found.area, found.status) == ("crash-dumps", status)
    assert says in found.summary
    if status == "degraded":
        assert "kernel.core_pattern" in (found.fix or "")


@pytest.mark.parametrize(
    ("abi", "network", "status"),
    [
        (7, True, "ok"),
        (6, False, "ok"),
        (5, True, "degraded"),
        (0, True, "degraded"),
        (3, False, "info"),
    ],
)
def test_doctor_says_when_turns_with_network_reach_the_hosts_abstract_sockets(
    tmp_path: Path, abi: int, network: bool, status: str
) -> None:
    from target_side.config import parse_settings
    from target_side.tools import doctor

    text = (
        f'[server]\nstate_root = "{tmp_path}"\n[roles.web]\ntoken_sha256 = "{"0" * 64}"\n'
        f'workspaces = ["{tmp_path}"]\nallow_network = {str(network).lower()}\n'
    )
    found = doctor.abstract_sockets(parse_settings(text), abi)
    assert (found.area, found.status) == ("abstract-sockets", status)
    if status == "degraded":
        assert "web" in found.summary and "Linux 6.12" in (found.fix or "")


# --- the unit file, for a deployed user and prefix -------------------------------------------


def test_unit_files_pass_systemd_analyze_verify(host: Host, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze is not installed here; the units were checked by "
            "tests/test_deploy_systemd_unit.py only"
        )
    options = (
        "--user",
        host.user,
        "--prefix",
        str(host.prefix),
        "--state-root",
        str(host.state),
        "--config-dir",
        str(host.config_dir),
        "--workspace",
        str(host.workspace),
    )
    units = {
        tmp_path / "paddock-target.service": print_unit(*options),
        tmp_path / "paddock-launcher.service": print_unit("--print-launcher-unit", *options),
    }
    for unit, text in units.items():
        unit.write_text(text)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if any(unit.name in line for unit in units)
    ]
    assert proc.returncode == 0 and said == [], proc.stdout + proc.stderr


def _fingerprint(pem: str) -> str:
    import hashlib

    der = ssl.PEM_cert_to_DER_cert(pem)
    return hashlib.sha256(der).digest().hex(":").upper()


def test_deploy_refuses_a_wheel_with_a_renamed_file(
    tmp_path: Path, wheels: Wheels, script: Path
) -> None:
    renamed = tmp_path / "paddock.whl"
    shutil.copy(wheels.old, renamed)
    proc = subprocess.run(
        [
            SYSTEM_PYTHON,
            str(script),
            "--wheel",
            str(renamed),
            "--role",
            "r",
            "--json",
            "--prefix",
            str(tmp_path / "p"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["summary"] == "nothing was changed" and "file name" in result["error"]
    assert not (tmp_path / "p").exists()
