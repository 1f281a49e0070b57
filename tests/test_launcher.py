"""The privileged launcher with real processes: root launcher, unprivileged server, real turns.

A throwaway service user owns the state root; the launcher runs as root with
exactly the capability bounding set its systemd unit gets; the server runs as
the service user (``setpriv``, no capabilities, no_new_privs), on the system
python with this checkout on its path. Turns go over real HTTP to that server,
which has no way to run them as a role but through the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hashlib
import json
import os
import pwd
import resource
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from conftest import (
    BUILDER_TOKEN,
    OTHER_TOKEN,
    PIDS_PROBE,
    events,
    finished,
    output,
    processes_with,
    reachable,
    run,
    sha,
    submit,
    wait_until,
    zombies_of,
)
from process_support import (
    ABSTRACT_CONNECT,
    abstract_listener,
    parent_pid,
    signal_set,
    socket_opening,
)

from target_side.config import RoleConfig, Settings, load_settings
from target_side.errors import LauncherError
from target_side.fence import launcher as launcher_module
from target_side.fence.launcher import MAX_FDS, Channel, Grants, close_all
from target_side.fence.launcher_client import PreparedLaunches, ViaLauncher

IGNORING_QUIT = ("sh", "-c", 'trap "" QUIT; exec "$@"', "sh")
"""A prefix starting a program with SIGQUIT ignored, as a shell's background job is."""

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
PURELIB = sysconfig.get_paths()["purelib"]
LAUNCHER_CAPS = "-all,+setuid,+setgid,+kill,+chown,+dac_override"
"""The launcher's whole capability set, as its systemd unit bounds it."""
PRIVATE_MOUNTS = ("unshare", "--mount", "--propagation", "private")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not os.path.exists(SYSTEM_PYTHON)
    or shutil.which("setpriv") is None
    or shutil.which("useradd") is None,
    reason="needs root, the system python3, setpriv and useradd",
)


def _env(home: str) -> dict[str, str]:
    # The system python with this checkout and the venv's packages on its path: the
    # service user cannot reach the venv's own interpreter, and no .pth file is read.
    return {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{REPO}:{REPO}/deploy:{PURELIB}",
        "LANG": "C.UTF-8",
        "HOME": home,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _private_pool() -> str:
    """An id pool no other test's target uses: the default pool gives every target's
    ``builder`` the same uid, and tearing a host down kills every process of its roles' uids."""
    return f"{1_000_000_000 + secrets.randbelow(10_000) * 65536}:65536"


@dataclass
class Host:
    """A root launcher and an unprivileged server sharing one config, on this machine."""

    base: Path
    user: str
    port: int = field(default_factory=_free_port)
    id_pool: str = field(default_factory=_private_pool)
    launcher: subprocess.Popen[bytes] | None = None
    server: subprocess.Popen[bytes] | None = None
    cgroup: Path | None = None

    @property
    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid

    @property
    def gid(self) -> int:
        return grp.getgrnam(self.user).gr_gid

    @property
    def config(self) -> Path:
        return self.base / "etc" / "target.toml"

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def socket(self) -> Path:
        return self.base / "run" / "launcher.sock"

    def workspace(self, role: str = "builder") -> Path:
        return self.base / "work" / role

    def role_ids(self, role: str = "builder") -> tuple[int, int]:
        return load_settings(self.config).role_ids(role)

    def write_config(self, **builder: object) -> None:
        extra = "".join(f"{k} = {v}\n" for k, v in builder.items())
        text = (
            f'[server]\nlisten = "127.0.0.1:{self.port}"\nstate_root = "{self.state}"\n'
            f'id_pool = "{self.id_pool}"\n'
            f'[fence]\nlauncher = "{self.socket}"\n'
            f'[roles.builder]\ntoken_sha256 = "{sha(BUILDER_TOKEN)}"\n'
            f'workspaces = ["{self.workspace()}"]\n{extra}'
            "[roles.builder.limits]\nwall_s = 60\n"
            f'[roles.other]\ntoken_sha256 = "{sha(OTHER_TOKEN)}"\n'
            f'workspaces = ["{self.workspace("other")}"]\n'
        )
        self.config.write_text(text)
        os.chown(self.config, 0, self.gid)
        self.config.chmod(0o640)

    def start_launcher(self) -> None:
        log = (self.base / "launcher.log").open("ab")
        self.launcher = subprocess.Popen(
            [
                # As a shell's background job starts it, SIGQUIT ignored: turns must not be.
                *IGNORING_QUIT,
                "setpriv",
                f"--bounding-set={LAUNCHER_CAPS}",
                "--inh-caps=-all",
                f"--groups={self.gid}",  # a supplementary group no turn may keep
                "--no-new-privs",
                "--",
                SYSTEM_PYTHON,
                "-m",
                "target_side.tools.cli",
                "launcher",
                "--config",
                str(self.config),
            ],
            env=_env("/root"),
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        assert wait_until(lambda: self.socket.exists(), timeout=20), self.log("launcher")

    def start_server(self) -> None:
        log = (self.base / "server.log").open("ab")
        join = f"echo $$ > {self.cgroup}/cgroup.procs && " if self.cgroup else ""
        drop = (
            f"setpriv --reuid={self.uid} --regid={self.gid} --clear-groups --no-new-privs "
            "--inh-caps=-all --bounding-set=-all --"
        )
        command = f"{SYSTEM_PYTHON} -m target_side.tools.cli serve --config {self.config}"
        self.server = subprocess.Popen(
            # A mount namespace of its own, as its systemd unit gives it: every descriptor it
            # hands the launcher belongs to a mount the launcher's namespace only mirrors.
            [*PRIVATE_MOUNTS, "sh", "-c", f"{join}exec {drop} {command}"],
            env=_env(str(self.state)),
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()

        def up() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200
            return False

        assert wait_until(up, timeout=30), self.log("server")

    def stop_server(self, sig: int = signal.SIGTERM) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(sig)
            self.server.wait(timeout=30)
        self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, token: str = BUILDER_TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def log(self, which: str) -> str:
        path = self.base / f"{which}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def server_python(self, *args: str) -> list[str]:
        """The server's interpreter with ``args``, as a command run as the server's user."""
        ids = [f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]
        return ["setpriv", *ids, "--", SYSTEM_PYTHON, *args]

    def as_server(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The server's interpreter with ``args``, run as the server's user."""
        return subprocess.run(
            self.server_python(*args),
            env=_env(str(self.state)),
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def _make_host(base: Path, user: str) -> Host:
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
        check=True,
        capture_output=True,
    )
    host = Host(base, user)
    for name in ("etc", "run", "work"):
        (base / name).mkdir(mode=0o755)
    host.state.mkdir()
    os.chown(host.state, host.uid, host.gid)
    host.state.chmod(0o711)
    host.write_config()
    for role in ("builder", "other"):
        # What deploy makes: the role writes, the server reads, nobody else enters.
        workspace = host.workspace(role)
        workspace.mkdir()
        os.chown(workspace, host.role_ids(role)[0], host.gid)
        workspace.chmod(0o2750)
    host.cgroup = _delegated_pids_cgroup(host)
    return host


def _delegated_pids_cgroup(host: Host) -> Path | None:
    """A cgroup v1 pids cgroup of the service user's, as a unit's Delegate= would give."""
    root = Path("/sys/fs/cgroup/pids")
    if not (root / "cgroup.procs").exists():
        return None
    here = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    mine = next((line.split(":", 2)[2] for line in here.splitlines() if ":pids:" in line), None)
    if mine is None:
        return None
    cgroup = root / mine.lstrip("/") / f"pdk-launcher-{host.user}"
    try:
        cgroup.mkdir()
    except OSError:
        return None
    for name in ("", "cgroup.procs", "tasks", "cgroup.clone_children"):
        with contextlib.suppress(OSError):
            os.chown(cgroup / name, host.uid, host.gid)
    return cgroup


def _tear_down(host: Host) -> None:
    with contextlib.suppress(Exception):
        host.stop_server()
    if host.launcher is not None and host.launcher.poll() is None:
        host.launcher.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            host.launcher.wait(timeout=30)
    with contextlib.suppress(Exception):
        ids = {host.uid, *(host.role_ids(r)[0] for r in ("builder", "other"))}
        for pid in _processes_of(ids):  # only this test's throwaway uids
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if host.cgroup is not None:
        for child in (*host.cgroup.glob("paddock-*"), host.cgroup):
            with contextlib.suppress(OSError):
                assert wait_until(lambda c=child: not (c / "cgroup.procs").read_text(), 10)
                child.rmdir()
    subprocess.run(["userdel", host.user], check=False, capture_output=True)
    with contextlib.suppress(KeyError):
        grp.getgrnam(host.user)
        subprocess.run(["groupdel", host.user], check=False, capture_output=True)
    shutil.rmtree(host.base, ignore_errors=True)


def _processes_of(uids: set[int]) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid in uids:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    reachable(REPO)  # the service user runs this checkout
    base = Path(tempfile.mkdtemp(prefix="pdk-launcher-", dir="/tmp"))
    base.chmod(0o755)
    made = None
    try:
        made = _make_host(base, f"pdk{secrets.token_hex(3)[:5]}")
        made.start_launcher()
        made.start_server()
        yield made
    finally:
        if made is not None:
            _tear_down(made)
        else:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def delegated(host: Host) -> Path:
    """The service user's delegated cgroup (v1 ``pids``): what the tests of turns born
    inside their cgroups need. Skipped only where the machine has no such hierarchy, and
    never where ``PADDOCK_REQUIRE_CGROUPS`` is set (CI sets it: there they must run)."""
    if host.cgroup is None:
        if os.environ.get("PADDOCK_REQUIRE_CGROUPS"):
            pytest.fail("no cgroup v1 pids hierarchy to delegate, and CI requires one")
        pytest.skip("no cgroup v1 pids hierarchy to delegate here")
    return host.cgroup


@pytest.fixture
def client(host: Host) -> Iterator[httpx.Client]:
    if host.server is None or host.server.poll() is not None:
        host.start_server()
    with host.client() as c:
        yield c


# --- turns, as the role -----------------------------------------------------------------------


def test_launcher_server_is_unprivileged_and_cannot_switch_uids_itself(host: Host) -> None:
    assert host.server is not None
    status = Path(f"/proc/{host.server.pid}/status").read_text()  # sh and setpriv exec'd it
    assert f"Uid:\t{host.uid}\t{host.uid}\t{host.uid}\t{host.uid}" in status
    assert "CapEff:\t0000000000000000" in status


def test_launcher_turn_gets_the_fences_system_call_filter(client: httpx.Client) -> None:
    """The filter travels with the launch, a descriptor the launcher hands bubblewrap: a socket
    family the fence does not keep is refused by it (EAFNOSUPPORT), not by the kernel, which
    answers EPERM for want of CAP_NET_RAW."""
    script = socket_opening("AF_PACKET", "SOCK_DGRAM")
    turn, evs = run(client, ["python3", "-c", script])
    assert (turn.exit_code, output(evs)) == (0, "97\n")


def test_launcher_turn_runs_as_the_roles_uid_with_no_other_group(
    host: Host, client: httpx.Client
) -> None:
    uid, gid = host.role_ids()
    turn, evs = run(client, ["sh", "-c", "id -u; id -g; grep '^Groups:' /proc/self/status"])
    assert turn.exit_code == 0, evs
    said_uid, said_gid, groups = output(evs).split("\n")[:3]
    assert (said_uid, said_gid, groups.split()) == (str(uid), str(gid), ["Groups:"])


def test_launcher_started_ignoring_a_signal_hands_it_to_no_turn(
    host: Host, client: httpx.Client
) -> None:
    """Ignored signals survive exec: a launcher started with SIGQUIT ignored (the fixture
    starts it so) still ignores it, but the turns it starts have every signal at its default."""
    assert host.launcher is not None
    launcher = Path(f"/proc/{host.launcher.pid}/status").read_text()  # setpriv exec'd it
    assert signal.SIGQUIT not in signal_set(launcher)
    assert signal.SIGQUIT in signal_set(launcher, "SigCgt")
    turn, evs = run(client, ["cat", "/proc/self/status"])
    assert turn.exit_code == 0, evs
    assert signal_set(output(evs)) == set()


def test_launcher_network_turn_reaches_no_abstract_socket_of_the_host(host: Host) -> None:
    """The launcher's child joins the fence's Landlock domain before it becomes bubblewrap
    (``fence.landlock``): a turn with the host's network cannot reach the host's abstract
    unix sockets (EPERM) through the launcher either."""
    host.write_config(allow_network="true")
    host.stop_server()
    host.start_server()
    try:
        with abstract_listener() as name, host.client() as c:
            turn, evs = run(c, ["python3", "-c", ABSTRACT_CONNECT, name], network="host")
        assert turn.exit_code == 0, output(evs, "stderr")
        assert output(evs) == "1\n"
    finally:
        host.write_config()
        host.stop_server()
        host.start_server()


def test_launcher_files_a_turn_creates_are_the_roles(host: Host, client: httpx.Client) -> None:
    uid, _ = host.role_ids()
    turn, evs = run(client, ["sh", "-c", "mkdir -p made && echo hi > made/file"])
    assert turn.exit_code == 0, evs
    made = host.workspace() / "made" / "file"
    st = made.stat()
    # The workspace is setgid: what the role makes keeps the server's group, so it can plan there.
    assert (st.st_uid, st.st_gid) == (uid, host.gid)
    assert host.as_server("-c", f"print(open({str(made)!r}).read(), end='')").stdout == "hi\n"


def test_launcher_file_operations_act_as_the_role(host: Host, client: httpx.Client) -> None:
    """A file written or read through /v1/files is the role's doing, through the launcher too."""
    uid, _ = host.role_ids()
    data = bytes(range(256)) * 4096
    path = host.workspace() / "through-the-file-api"
    query = {"role": "builder", "path": str(path)}
    written = client.put("/v1/files", params=query, content=data)
    assert written.status_code == 200, written.text
    assert written.json()["uid"] == uid == path.stat().st_uid
    assert client.get("/v1/files", params=query).content == data
    refused = client.put("/v1/files", params={**query, "path": f"{host.workspace()}/.envrc"})
    assert refused.status_code == 403
    assert refused.json()["refusal"]["rule"] == "protected-path"


def test_launcher_peer_credentials_on_a_workspace_socket_are_the_roles(
    host: Host, client: httpx.Client
) -> None:
    path = host.workspace() / "peer.sock"
    seen: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        path.chmod(0o666)
        listener.listen(1)
        listener.settimeout(30)

        def accept() -> None:
            conn, _ = listener.accept()
            with conn:
                raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                seen.append(struct.unpack("3i", raw)[1])
                conn.sendall(b"k")

        thread = threading.Thread(target=accept)
        thread.start()
        code = (
            f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r}); s.recv(1)"
        )
        turn, evs = run(client, ["python3", "-c", code])
        thread.join(30)
    path.unlink()
    assert turn.exit_code == 0, evs
    assert seen == [host.role_ids()[0]]


def test_launcher_makes_the_roles_home_as_root_would(host: Host, client: httpx.Client) -> None:
    turn, _ = run(client, ["true"])
    assert turn.exit_code == 0
    uid, gid = host.role_ids()
    home = host.state / "roles" / "builder" / "home"
    st = home.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o700)
    for server_dir in (home.parent, home.parent.parent):
        st = server_dir.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (host.uid, 0o711)
    home.chmod(0o755)  # as the role could have, in a turn: repaired as the role
    turn, _ = run(client, ["true"])
    assert turn.exit_code == 0 and stat.S_IMODE(home.stat().st_mode) == 0o700


def test_server_sees_a_home_as_it_should_be_without_asking_the_launcher(
    host: Host, client: httpx.Client
) -> None:
    # The home is the role's alone (0700): the server looks at it by O_PATH descriptors,
    # which need no read permission, and asks the launcher only when it is not as it
    # should be (a wrong mode is repaired there: the test above).
    turn, _ = run(client, ["true"])
    assert turn.exit_code == 0
    uid, gid = host.role_ids()
    look = (
        "from pathlib import Path; from target_side.fence.home import looks_ready; "
        f"print(looks_ready(Path({str(host.state)!r}), 'builder', {uid}, {gid}))"
    )
    home = host.state / "roles" / "builder" / "home"
    seen = host.as_server("-c", look)
    assert seen.stdout.strip() == "True", seen.stderr
    home.chmod(0o750)
    try:
        seen = host.as_server("-c", look)
    finally:
        home.chmod(0o700)
    assert seen.stdout.strip() == "False", seen.stderr


def test_launcher_stdin_reaches_the_turn(host: Host, client: httpx.Client) -> None:
    turn = submit(client, argv=["cat"], stdin="open")
    response = client.post(
        f"/v1/turns/{turn.turn_id}/stdin", params={"eof": 1}, content=b"through the launcher\n"
    )
    assert response.status_code in (200, 202, 204), response.text
    evs = events(client, turn.turn_id)
    assert output(evs) == "through the launcher\n"


def test_launcher_int_reaches_the_turn(host: Host, client: httpx.Client) -> None:
    marker = "311.5"
    turn = submit(client, argv=["sh", "-c", f"sleep {marker}"])
    assert wait_until(lambda: bool(processes_with("sleep", marker)))
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "INT"})
    assert finished(client, turn.turn_id).exit_code == 128 + signal.SIGINT


def test_launcher_kill_ends_the_whole_turn(host: Host, client: httpx.Client) -> None:
    marker = "312.5"
    turn = submit(client, argv=["sh", "-c", f"(sleep {marker} &); sleep {marker}"])
    assert wait_until(lambda: len(processes_with("sleep", marker)) == 2)
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    assert finished(client, turn.turn_id).exit_code == 128 + signal.SIGKILL
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_launcher_wall_time_kills_the_turn(host: Host, client: httpx.Client) -> None:
    turn, _ = run(client, ["sh", "-c", "sleep 313.5"], limits={"wall_s": 1})
    assert turn.exit_code == 124
    assert wait_until(lambda: not processes_with("sleep", "313.5"))


def test_launcher_turn_that_plants_a_protected_name_has_it_moved_aside(
    host: Host, client: httpx.Client
) -> None:
    # The launcher looks at the turn's protected names as it reaps it; only what it finds
    # not as planned costs the audit request (and its fork as the role): this one does.
    turn, evs = run(client, ["sh", "-c", "echo planted > .envrc"], cwd=str(host.workspace()))
    assert turn.exit_code == 0, evs
    moved = list(host.workspace().glob(f".envrc.paddock-quarantined-{turn.turn_id}"))
    assert moved and not (host.workspace() / ".envrc").exists(), evs
    assert any(".envrc appeared during the turn" in str(getattr(e, "message", "")) for e in evs)
    clean, _ = run(client, ["true"], cwd=str(host.workspace()))
    assert clean.exit_code == 0


def test_launcher_terminal_turn_gets_its_pty(host: Host, client: httpx.Client) -> None:
    turn, evs = run(client, ["stty", "size"], tty={"rows": 21, "cols": 77})
    assert turn.exit_code == 0, evs
    assert output(evs).strip() == "21 77"


def test_launcher_session_runs_as_the_role_and_ends_whole(host: Host, client: httpx.Client) -> None:
    uid, _ = host.role_ids()
    marker = "321.5"
    opened = client.post(
        "/v1/sessions", json={"role": "builder", "cwd": str(host.workspace())}
    ).json()
    assert opened["state"] == "open", opened["refusal"]["detail"]
    session = opened["session_id"]
    body = f"export KEPT=yes; sleep {marker} & (sleep 1; echo x > .envrc) &"
    digest = hashlib.sha256(body.encode()).hexdigest()
    first = submit(client, script=body, script_sha256=digest, session=session)
    assert finished(client, first.turn_id).exit_code == 0
    second = submit(client, argv=["sh", "-c", 'id -u; echo "$KEPT"'], session=session)
    evs = events(client, second.turn_id)
    assert output(evs) == f"{uid}\nyes\n", evs
    assert wait_until(lambda: bool(processes_with("sleep", marker)))
    assert all(os.stat(f"/proc/{pid}").st_uid == uid for pid in processes_with("sleep", marker))
    time.sleep(2)  # the background process plants .envrc after the turns' own audits
    ended = client.delete(f"/v1/sessions/{session}").json()
    assert ended["state"] == "closed"
    assert wait_until(lambda: not processes_with("sleep", marker))
    # The audit at the session's end ran through the launcher, as the role.
    assert not (host.workspace() / ".envrc").exists()
    assert list(host.workspace().glob(".envrc.paddock-quarantined-s-*"))


def test_launcher_places_the_fence_in_the_servers_cgroup(
    host: Host, client: httpx.Client, delegated: Path
) -> None:
    marker = "271.5"
    turn = submit(client, argv=["sh", "-c", f"grep :pids: /proc/self/cgroup; sleep {marker}"])
    try:
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
        (pid,) = processes_with("sleep", marker)
        seen_from_host = _pids_cgroup(pid)
        bwrap = _outer_bwrap(pid)  # the launch itself
        assert "/paddock-" in seen_from_host and "-t-" in seen_from_host, seen_from_host
        # Born inside (a prepared launch): bubblewrap itself is in the turn's cgroup, and the
        # fence's cgroup namespace is rooted there, so the turn sees no path of the host's.
        assert _pids_cgroup(bwrap) == seen_from_host
    finally:
        client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    evs = events(client, turn.turn_id)
    assert output(evs).split("\n")[0].endswith(":pids:/"), evs


def _outer_bwrap(pid: int) -> int:
    """The first bubblewrap above ``pid``: the process the launcher started."""
    outer = None
    while pid > 1:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "bwrap":
            outer = pid
        pid = parent_pid(pid)
    assert outer is not None
    return outer


def _pids_cgroup(pid: int) -> str:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line.split(":", 2)[2] for line in lines if ":pids:" in line)


def test_launcher_turn_born_inside_gets_exactly_its_pids_limit(
    host: Host, client: httpx.Client, delegated: Path
) -> None:
    # bubblewrap's outer process is born in the turn's cgroup with the rest (a prepared
    # launch): pids.max counts it as a seat, never as one of the turn's own processes.
    seen = []
    for pids in (8, 16):
        turn, evs = run(client, ["python3", "-c", PIDS_PROBE], limits={"pids": pids})
        assert turn.exit_code == 0, output(evs, "stderr")
        seen.append(int(output(evs)))
    assert seen == [8, 16]


def test_launcher_turn_born_inside_takes_an_argv_as_long_as_any_launch(
    host: Host, client: httpx.Client, delegated: Path
) -> None:
    # Its job is no datagram the socket to a prepared process could carry (EMSGSIZE).
    arguments = [str(n) * 100_000 for n in range(4)]
    turn, evs = run(client, ["sh", "-c", 'echo "$# ${#4}"', "sh", *arguments])
    assert turn.exit_code == 0, output(evs, "stderr")
    assert output(evs).split() == ["4", "100000"]


AS_SERVER = """
import asyncio, json, os, secrets, socket, sys, time
from pathlib import Path
from target_side.fence.launcher import Channel

async def connect():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    return Channel(sock)

def new_slot(parent):
    slot = Path(parent) / f"paddock-{os.getpid()}-t-{secrets.token_hex(16)}"
    slot.mkdir()
    return slot

async def prepare_in_a_new_slot(parent):
    slot = new_slot(parent)
    channel = await connect()
    await channel.send({"op": "prepare", "cgroups": [str(slot)]})
    reply, _ = await channel.recv()
    return slot, channel, reply

def remove_once_empty(slot):
    for _ in range(500):
        try:
            slot.rmdir()
            return
        except OSError:
            time.sleep(0.01)
"""
"""What the scripts run as the server share: a connection to the launcher (``argv[1]``), a
slot cgroup of their own (a process prepared in it), and its removal once what the launcher
forked there is gone."""


def _launching_script(host: Host, script: str, delegated: Path) -> subprocess.Popen[str]:
    """``script`` (``AS_SERVER``'s) running as the server, given the launcher's socket, the
    turns' parent cgroup and a launch of ``true`` as builder; its stdin and stdout piped."""
    uid, gid = host.role_ids()
    launch = json.dumps(_launch("builder", uid, gid))
    return subprocess.Popen(
        host.server_python(
            "-c", script, str(host.socket), str(delegated / "paddock-turns"), launch
        ),
        env=_env(str(host.state)),
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


STALLED = (
    AS_SERVER
    + """
async def main():
    slot, first, prepared = await prepare_in_a_new_slot(sys.argv[2])
    pid = str(prepared["prepared"])
    for _ in range(500):  # in its slot, then ready for its job: it waits for the launch
        if pid in (slot / "cgroup.procs").read_text().split():
            break
        time.sleep(0.01)
    time.sleep(0.2)
    print(pid, flush=True)
    sys.stdin.readline()  # the test stopped the prepared process meanwhile
    null = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    await first.send(json.loads(sys.argv[3]), null)
    await asyncio.sleep(0.3)  # the launch waits for the stopped process by now
    second = await connect()
    started = time.monotonic()
    await second.send({"op": "hello"})
    hello, _ = await second.recv()
    print(json.dumps({"hello": hello, "waited": time.monotonic() - started}), flush=True)
    second.close()
    sys.stdin.readline()  # the test let the process go on
    launched, _ = await first.recv()
    first.close()
    remove_once_empty(slot)
    print(json.dumps(launched), flush=True)

asyncio.run(main())
"""
)


def test_launcher_serves_other_connections_while_a_prepared_process_is_slow_to_start(
    host: Host, delegated: Path
) -> None:
    # The prepared process runs in cgroups the server owns (their cpu limit, their freezer):
    # waiting for it must not keep the launcher from anything else.
    script = _launching_script(host, STALLED, delegated)
    assert script.stdin is not None and script.stdout is not None
    child = int(script.stdout.readline())
    try:
        os.kill(child, signal.SIGSTOP)
        script.stdin.write("go\n")
        script.stdin.flush()
        said = json.loads(script.stdout.readline())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGCONT)
    out, err = script.communicate("go\n", timeout=60)
    assert script.returncode == 0, err
    assert host.launcher is not None and said["hello"].get("pid") == host.launcher.pid, said
    assert said["waited"] < 5, said
    assert "pid" in json.loads(out) or "error" in json.loads(out), out


def test_launcher_turns_beyond_the_prepared_ones_are_placed_once_started(
    host: Host, client: httpx.Client, delegated: Path
) -> None:
    # Two launches are kept prepared; six turns at once take them and four more, which are
    # launched and placed as before: every one in its own cgroup, seen from the host.
    marker = "2.25"
    turns = [submit(client, argv=["sh", "-c", f"sleep {marker}"]) for _ in range(6)]
    assert wait_until(lambda: len(processes_with("sleep", marker)) == 6)
    places = {_pids_cgroup(pid) for pid in processes_with("sleep", marker)}
    assert len(places) == 6 and all("/paddock-" in p and "-t-" in p for p in places), places
    assert [finished(client, t.turn_id).exit_code for t in turns] == [0] * 6


def _prepared_children(delegated: Path) -> set[int]:
    """The launcher's prepared children: root's processes waiting in the server's slots."""
    found = set()
    for procs in (delegated / "paddock-turns").glob("paddock-*/cgroup.procs"):
        for pid in procs.read_text().split():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == 0:
                    found.add(int(pid))
    return found


def test_launcher_prepared_child_lost_while_idle_is_replaced(
    host: Host, client: httpx.Client, delegated: Path
) -> None:
    # Killed while it waits (as an OOM kill in its slot would): the launcher reaps it and
    # says so, the server drops that launch and prepares another; turns never take it.
    run(client, ["true"])
    assert wait_until(lambda: len(_prepared_children(delegated)) == 2)
    killed = _prepared_children(delegated)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: len(_prepared_children(delegated) - killed) == 2)
    for _ in range(3):
        turn, evs = run(client, ["true"])
        assert turn.exit_code == 0, evs


PREPARE = (
    AS_SERVER
    + """
async def main():
    parent = Path(sys.argv[2])
    slot = new_slot(parent)
    said = {}
    for name, cgroups in (("foreign", [str(parent.parent)]), ("slot", [str(slot)])):
        channel = await connect()  # a connection each: one prepared process per connection
        await channel.send({"op": "prepare", "cgroups": cgroups})
        said[name], _ = await channel.recv()
        if name == "foreign":
            channel.close()
    pid = said["slot"]["prepared"]
    for _ in range(200):
        if str(pid) in (slot / "cgroup.procs").read_text().split():
            break
        time.sleep(0.01)
    status = Path(f"/proc/{pid}/status").read_text()
    said["uid"] = int(next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1])
    said["in_slot"] = str(pid) in (slot / "cgroup.procs").read_text().split()
    said["exe"] = os.readlink(f"/proc/{pid}/exe") if said["uid"] == os.getuid() else None
    channel.close()
    for _ in range(500):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.01)
    said["gone"] = not Path(f"/proc/{pid}").exists()
    slot.rmdir()
    print(json.dumps(said))

asyncio.run(main())
"""
)


LOST_THEN_LAUNCHED = (
    AS_SERVER
    + """
async def main():
    slot, channel, prepared = await prepare_in_a_new_slot(sys.argv[2])
    print(prepared["prepared"], flush=True)
    told, _ = await channel.recv()  # its child was killed meanwhile
    null = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    launch = json.loads(sys.argv[3])
    await channel.send(launch, null)
    refused, _ = await channel.recv()
    await channel.send({"op": "prepare", "cgroups": [str(slot)]})
    again, _ = await channel.recv()
    channel.close()
    remove_once_empty(slot)
    print(json.dumps({"told": told, "launch": refused, "again": again}))

asyncio.run(main())
"""
)


def test_launcher_connection_whose_prepared_child_died_launches_nothing(
    host: Host, delegated: Path
) -> None:
    # Its turn's fence would have no gate: launched any other way, it would run outside
    # the cgroups it was planned in. So the launch is refused, never made unprepared.
    script = _launching_script(host, LOST_THEN_LAUNCHED, delegated)
    assert script.stdout is not None
    child = int(script.stdout.readline())
    os.kill(child, signal.SIGKILL)
    out, err = script.communicate(timeout=60)
    assert script.returncode == 0, err
    said = json.loads(out)
    assert "ended before its launch" in str(said["told"].get("gone")), said
    assert "ended before its launch" in str(said["launch"].get("error")), said
    assert "pid" not in said["launch"], said
    # Nor is another prepared on it: one prepared process per connection, dead or alive.
    assert "one launch per connection" in str(said["again"].get("error")), said


def test_launcher_prepared_process_runs_nothing_and_ends_with_its_connection(
    host: Host, delegated: Path
) -> None:
    turns_parent = delegated / "paddock-turns"
    done = host.as_server("-c", PREPARE, str(host.socket), str(turns_parent))
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert "not a turn's cgroup" in str(said["foreign"].get("error")), said
    assert isinstance(said["slot"].get("prepared"), int), said
    # Forked into the slot, still the launcher (root, nothing executed), until the
    # connection closed: then killed and reaped, leaving the slot empty.
    assert said["in_slot"] and said["uid"] == 0 and said["gone"], said


def test_launcher_keeps_no_descriptor_of_a_cgroup_path_it_refused(
    host: Host, delegated: Path
) -> None:
    # Cut at its NUL byte, the path would open as the directory above it: each such request
    # left a descriptor open in the launcher, until it could accept no connection at all.
    assert host.launcher is not None
    held = Path(f"/proc/{host.launcher.pid}/fd")
    before = len(list(held.iterdir()))
    cut = f"{delegated / 'paddock-turns'}/\0/paddock-1-t-{'a' * 32}"
    replies = _as_server_ask(host, *[{"op": "prepare", "cgroups": [cut]}] * 5)
    assert all("error" in reply for reply in replies), replies
    assert wait_until(lambda: len(list(held.iterdir())) <= before), list(held.iterdir())


MANY_PREPARED = (
    AS_SERVER
    + """
async def main():
    channels, slots, said = [], [], []
    for _ in range(int(sys.argv[3])):
        slot, channel, reply = await prepare_in_a_new_slot(sys.argv[2])
        slots.append(slot)
        channels.append(channel)
        said.append(reply)
    for channel in channels:
        channel.close()
    for slot in slots:
        remove_once_empty(slot)
    print(json.dumps(said))

asyncio.run(main())
"""
)


def test_launcher_keeps_a_bounded_number_of_processes_prepared(host: Host, delegated: Path) -> None:
    # Each is a root process and five descriptors of the launcher's: a server asking for
    # more than the launcher keeps is refused, whatever number of connections it opens.
    count = launcher_module.MAX_PREPARED + 1
    parent = str(delegated / "paddock-turns")
    done = host.as_server("-c", MANY_PREPARED, str(host.socket), parent, str(count))
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert sum(isinstance(reply.get("prepared"), int) for reply in said) <= count - 1, said
    assert "wait prepared already" in str(said[-1].get("error")), said


def test_launcher_out_of_descriptors_for_a_while_accepts_again_once_it_has_some(
    host: Host,
) -> None:
    # A launcher short of descriptors leaves connections in the backlog and takes them
    # later; it had stopped accepting for good, and every later turn waited for ever.
    assert host.launcher is not None
    pid = host.launcher.pid
    held = len(os.listdir(f"/proc/{pid}/fd"))
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    waiting = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + 2, limits[1]))
        for _ in range(6):
            waiting.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            waiting[-1].connect(str(host.socket))
        time.sleep(0.5)  # accepts fail meanwhile (EMFILE)
    finally:
        for sock in waiting:
            sock.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    # Accepted (and, as root is not the server, refused) within the socket's 10 s.
    assert "not the server's uid" in str(_first_word(host.socket).get("error"))


def test_launcher_closing_the_server_kills_the_turn(host: Host, client: httpx.Client) -> None:
    marker = "314.5"
    submit(client, argv=["sh", "-c", f"sleep {marker}"])
    assert wait_until(lambda: bool(processes_with("sleep", marker)))
    host.stop_server(signal.SIGKILL)  # no goodbye: only the closed connection says it
    assert wait_until(lambda: not processes_with("sleep", marker), timeout=15)


# --- what the launcher refuses ----------------------------------------------------------------


ORPHANED = """
import asyncio, json, os, socket, sys, time
from target_side.fence.launcher import Channel

async def main():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    channel = Channel(sock)
    null = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    status_read, status_write = os.pipe()
    gate_read, gate_write = os.pipe()
    await channel.send(json.loads(sys.argv[2]), [*null, status_write, gate_read])
    started, _ = await channel.recv()
    os.close(status_write)
    os.close(gate_read)
    line = b""
    while b"\\n" not in line:  # the sandbox is named, but the launcher never told
        line += os.read(status_read, 4096)
    sandbox = json.loads(line.split(b"\\n")[0])["child-pid"]
    await channel.send({"op": "kill", "bwrap": True})  # as the runner's kill before the line
    ended, _ = await channel.recv()
    os.close(gate_write)  # the gate shuts once bubblewrap's end is told, as the runner's does
    time.sleep(0.5)
    print(json.dumps({"started": started, "ended": ended, "sandbox": sandbox}))

asyncio.run(main())
"""


def test_launcher_kills_a_sandbox_whose_bubblewrap_it_killed_before_it_was_held(
    host: Host,
) -> None:
    # bubblewrap's child asks for its parent-death signal only past the gate: killed with
    # bubblewrap before it was held, it outlived it, and the gate shutting let it run its
    # command, out of every kill's reach. Now it is the launcher's orphan, killed first.
    uid, gid = host.role_ids()
    marker = "31.75"
    bwrap = [
        "/usr/bin/bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
        "--json-status-fd", "3", "--block-fd", "4", "--", "/usr/bin/sleep", marker,
    ]  # fmt: skip
    launch = {**_launch("builder", uid, gid, bwrap), "fds": [0, 1, 2, 3, 4]}
    try:
        done = host.as_server("-c", ORPHANED, str(host.socket), json.dumps(launch))
        assert done.returncode == 0, done.stderr
        said = json.loads(done.stdout)
        assert "pid" in said["started"] and "exit" in said["ended"], said
        assert not os.path.exists(f"/proc/{said['sandbox']}"), said
        assert processes_with("sleep", marker) == []
    finally:
        for pid in processes_with("sleep", marker):
            os.kill(pid, signal.SIGKILL)


def test_launcher_reaps_the_sandboxes_bubblewrap_leaves_it(
    host: Host, client: httpx.Client
) -> None:
    """bubblewrap exits as its sandbox's first process reports the command's status, often
    before that process is gone, and the launcher, a subreaper, is given it: unreaped, each
    turn left a zombie counted against the turns' pids bound until no turn could start."""
    for _ in range(4):
        turn, evs = run(client, ["true"])
        assert turn.exit_code == 0, evs
    assert host.launcher is not None
    launcher = host.launcher.pid
    assert wait_until(lambda: not zombies_of(launcher), timeout=5), zombies_of(launcher)


def _first_word(path: Path) -> dict[str, object]:
    """What the launcher says to a connection before anything is asked (a refusal, if any)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        size = int.from_bytes(_recv_exactly(s, 4), "big")
        said: dict[str, object] = json.loads(_recv_exactly(s, size))
        assert s.recv(1) == b""  # and then it hangs up
        return said


def _recv_exactly(s: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = s.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def test_launcher_refuses_a_connection_from_any_uid_but_the_servers(host: Host) -> None:
    said = _first_word(host.socket)  # as root: not the server's uid either
    assert "not the server's uid" in str(said.get("error")), said
    st = host.socket.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, host.gid, 0o660)


REQUESTS = """
import asyncio, json, os, socket, sys
from target_side.fence.launcher import Channel

async def ask(message, fds):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    channel = Channel(sock)
    await channel.send(message, fds)
    reply, _ = await channel.recv()
    channel.close()
    return reply

async def main():
    null = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    replies = []
    for message in json.loads(sys.argv[2]):
        replies.append(await ask(message, null if message.get("op") == "launch" else []))
    print(json.dumps(replies))

asyncio.run(main())
"""


def _as_server_ask(host: Host, *messages: dict[str, object]) -> list[dict[str, object]]:
    done = host.as_server("-c", REQUESTS, str(host.socket), json.dumps(messages))
    assert done.returncode == 0, done.stderr
    replies: list[dict[str, object]] = json.loads(done.stdout)
    return replies


def _launch(role: str, uid: int, gid: int, argv: list[str] | None = None) -> dict[str, object]:
    return {
        "op": "launch",
        "role": role,
        "uid": uid,
        "gid": gid,
        "argv": argv or ["/usr/bin/true"],
        "fds": [0, 1, 2],
    }


def test_launcher_refuses_a_role_not_in_the_config_and_root(host: Host) -> None:
    uid, gid = host.role_ids()
    unknown, root, other_ids, fine = _as_server_ask(
        host,
        _launch("intruder", uid, gid),
        _launch("builder", 0, 0, ["/usr/bin/id", "-u"]),
        _launch("builder", host.uid, host.gid),
        _launch("builder", uid, gid),
    )
    assert "not in" in str(unknown.get("error")), unknown
    assert "error" in root and "pid" not in root, root
    assert "error" in other_ids and "pid" not in other_ids, other_ids
    assert fine.get("uid") == uid and "pid" in fine, fine


def test_launcher_refuses_a_program_root_does_not_own(host: Host) -> None:
    uid, gid = host.role_ids()
    planted = host.workspace() / "planted"
    planted.write_text("#!/bin/sh\n")
    os.chown(planted, uid, gid)
    planted.chmod(0o755)
    (reply,) = _as_server_ask(host, _launch("builder", uid, gid, [str(planted)]))
    assert "root-owned" in str(reply.get("error")), reply


def test_launcher_audit_never_touches_a_path_outside_the_roles_workspaces(host: Host) -> None:
    uid, gid = host.role_ids()
    outside = host.base / "outside"
    outside.mkdir(exist_ok=True)
    os.chown(outside, uid, gid)  # the role could rename here: only the check stops it
    rc = outside / ".envrc"
    rc.write_text("echo planted\n")
    inside = host.workspace() / ".envrc"
    inside.write_text("echo planted\n")
    os.chown(inside, uid, gid)
    audit = {"op": "audit", "role": "builder", "uid": uid, "gid": gid, "turn_id": "t-0a1b"}
    refused, moved = _as_server_ask(
        host,
        audit | {"expected": {str(rc): None}},
        audit | {"expected": {str(inside): None}},
    )
    assert "does not lie inside" in str(refused.get("error")), refused
    assert rc.exists()
    assert moved.get("moved") and not inside.exists(), moved
    assert (host.workspace() / ".envrc.paddock-quarantined-t-0a1b").exists()


def test_launcher_audit_never_calls_clean_what_the_role_hid_from_itself(host: Host) -> None:
    # The launcher looks first as root and forks the role's child only for what is not as
    # planned: a name in a directory the role made unsearchable is still found, and the
    # child's failure to move it is said, never an empty answer.
    uid, gid = host.role_ids()
    hidden = host.workspace() / "hidden"
    hidden.mkdir()
    (hidden / ".envrc").write_text("echo planted\n")
    os.chown(hidden / ".envrc", uid, gid)
    os.chown(hidden, uid, gid)
    hidden.chmod(0o000)
    audit = {"op": "audit", "role": "builder", "uid": uid, "gid": gid, "turn_id": "t-0a1c"}
    try:
        clean, hid = _as_server_ask(
            host,
            audit | {"expected": {str(host.workspace() / ".bashrc"): None}},
            audit | {"expected": {str(hidden / ".envrc"): None}},
        )
    finally:
        hidden.chmod(0o755)
    assert clean == {"moved": []}, clean
    assert [str(hidden / ".envrc")] == [m.split(" ")[0] for m in hid.get("moved", [])], hid
    assert "could not be moved aside" in hid["moved"][0], hid
    assert (hidden / ".envrc").exists()


# --- what the operator's tools say ------------------------------------------------------------


def test_config_check_and_doctor_report_the_launcher(host: Host, client: httpx.Client) -> None:
    cli = ("-m", "target_side.tools.cli")
    check = host.as_server(*cli, "config", "check", "--json", str(host.config))
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["roles"]["builder"]["uid"] == host.role_ids()[0]
    assert any("through the launcher" in n and "root" in n for n in report["notes"]), report
    doctor = host.as_server(*cli, "doctor", "--json", "--config", str(host.config))
    found = {f["area"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert found["launcher"]["status"] == "ok", found["launcher"]
    assert found["backend"]["status"] == "ok", found["backend"]
    assert found["workspaces"]["status"] == "ok", found["workspaces"]
    other = host.workspace("other")
    other.chmod(0o2755)  # anyone may enter: another role's uid included
    try:
        doctor = host.as_server(*cli, "doctor", "--json", "--config", str(host.config))
    finally:
        other.chmod(0o2750)
    found = {f["area"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert found["workspaces"]["status"] == "degraded", found["workspaces"]
    assert any("any uid may enter it" in d for d in found["workspaces"]["details"])
    assert f"chmod 2750 {other}" in found["workspaces"]["fix"]


# --- the wire, in process ---------------------------------------------------------------------


def test_channel_carries_more_descriptors_than_one_message_can() -> None:
    async def exchange() -> tuple[dict[str, object], list[int]]:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sending, receiving = Channel(left), Channel(right)
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(MAX_FDS * 2 + 7)]
        try:
            sent = asyncio.create_task(sending.send({"op": "launch"}, fds))
            got = await receiving.recv()
            await sent
            return got
        finally:
            for fd in fds:
                os.close(fd)
            sending.close()
            receiving.close()

    message, fds = asyncio.run(exchange())
    try:
        assert message == {"op": "launch", "nfds": MAX_FDS * 2 + 7}
        assert len(fds) == MAX_FDS * 2 + 7 and all(os.fstat(fd) for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)


def test_config_check_and_doctor_say_a_server_without_root_or_launcher_refuses_turns(
    host: Host,
) -> None:
    config = host.base / "etc" / "no-launcher.toml"
    text = host.config.read_text().replace(f'launcher = "{host.socket}"\n', "")
    config.write_text(text)
    os.chown(config, 0, host.gid)
    config.chmod(0o640)
    cli = ("-m", "target_side.tools.cli")
    check = host.as_server(*cli, "config", "check", str(config))
    assert check.returncode == 1
    assert "every turn would be refused" in check.stderr and "[fence] launcher" in check.stderr
    doctor = host.as_server(*cli, "doctor", "--json", "--config", str(config))
    found = {f["area"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert found["launcher"]["status"] == "degraded", found["launcher"]
    assert "launcher" in found["launcher"]["fix"] and "identity" in found["launcher"]["fix"]


# --- who may be whom, in process --------------------------------------------------------------


def _grants(server: tuple[int, int], **builder: object) -> Grants:
    role = RoleConfig(token_sha256="0" * 64, workspaces=("/srv/w",), **builder)
    return Grants(Settings(roles={"builder": role}), server)


def test_grants_never_give_the_servers_uid_or_group_or_an_unknown_role() -> None:
    with pytest.raises(LauncherError, match="server's own uid"):
        _grants((5000, 5000), uid=5000, gid=6000).role_ids("builder")
    with pytest.raises(LauncherError, match="server's group"):
        _grants((5000, 5000), uid=7000, gid=5000).role_ids("builder")
    with pytest.raises(LauncherError, match="not in"):
        _grants((5000, 5000)).role_ids("intruder")
    assert _grants((5000, 5000), uid=7000).role_ids("builder") == (7000, 7000)
    asked = {"role": "builder", "uid": 0, "gid": 0}
    with pytest.raises(LauncherError, match="this launcher's config says 7000:7000"):
        _grants((5000, 5000), uid=7000).checked_ids(asked)


FAKE_LAUNCHER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
print("listening", flush=True)
conn, _ = s.accept()
print(repr(conn.recv(65536)), flush=True)
"""


def test_server_sends_nothing_to_a_launcher_that_is_not_root(host: Host) -> None:
    fake = host.state / "fake-launcher.sock"  # a place the service user can write
    listener = subprocess.Popen(
        host.server_python("-c", FAKE_LAUNCHER, str(fake)),
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline() == "listening\n"
        with pytest.raises(LauncherError, match=f"served by uid {host.uid}, not root"):
            asyncio.run(ViaLauncher(str(fake)).hello())
        out, _ = listener.communicate(timeout=10)
        assert out == "b''\n"  # it heard nothing: no request, no descriptor
    finally:
        listener.kill()
        fake.unlink(missing_ok=True)


def test_server_without_a_launcher_that_prepares_launches_as_before(tmp_path: Path) -> None:
    # A launcher that does not know "prepare" (an older one) refuses it: the server says so
    # once, removes the slots it made, and gives every turn a plain launch from then on.
    async def exchange() -> tuple[list[object], list[Path]]:
        path = str(tmp_path / "launcher.sock")
        asked: list[object] = []
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        listener.setblocking(False)

        async def refuse_each() -> None:
            while True:
                conn, _ = await asyncio.get_running_loop().sock_accept(listener)
                channel = Channel(conn)
                message, _ = await channel.recv()
                asked.append(message.get("op"))
                await channel.send({"error": "unknown request 'prepare'"})
                channel.close()

        serving = asyncio.create_task(refuse_each())
        parents = [tmp_path / "pids", tmp_path / "memory"]
        for parent in parents:
            parent.mkdir()
        launches = ViaLauncher(path).prepared_launches(asyncio.get_running_loop(), parents)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(asked) == 2 and not any(p.iterdir() for p in parents):
                break
        taken = launches.take()
        launches.close()
        serving.cancel()
        listener.close()
        return [*asked, taken], [entry for p in parents for entry in p.iterdir()]

    asked, left = asyncio.run(exchange())
    assert asked == ["prepare", "prepare", None], asked
    assert left == [], left


def test_a_prepared_launch_whose_child_died_after_a_turn_took_it_is_a_refused_launch(
    tmp_path: Path,
) -> None:
    # The turn took the launch, then its child died: the launcher's word of it comes first on
    # the connection, and the launch's own refusal after it. Neither is the launch's pid.
    async def exchange() -> str:
        path = str(tmp_path / "launcher.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        listener.setblocking(False)
        gone = "its prepared process ended before its launch"

        async def prepare_then_lose() -> None:
            conn, _ = await asyncio.get_running_loop().sock_accept(listener)
            channel = Channel(conn)
            try:
                await channel.recv()
                await channel.send({"prepared": os.getpid()})
                _, fds = await channel.recv()
                close_all(fds)
                await channel.send({"gone": gone})
                await channel.send({"error": gone})
                await channel.recv()  # until the server hangs up
            finally:
                channel.close()

        serving = asyncio.create_task(prepare_then_lose())
        (tmp_path / "pids").mkdir()
        loop = asyncio.get_running_loop()
        launches = PreparedLaunches(loop, ViaLauncher(path), [tmp_path / "pids"], idle=1)
        taken = None
        for _ in range(200):
            await asyncio.sleep(0.01)
            taken = launches.take()
            if taken is not None:
                break
        assert taken is not None
        try:
            await ViaLauncher(path).spawn(
                "builder", (1, 1), ["/usr/bin/true"], (), False, cast(Any, Slotted(taken))
            )
        except LauncherError as exc:
            return str(exc)
        finally:
            serving.cancel()
            launches.close()
            listener.close()
        return "launched"

    assert "ended before its launch" in asyncio.run(exchange())


class Slotted:
    """What ``spawn`` reads of a turn's limits: the slot it took."""

    def __init__(self, slot: object) -> None:
        self.slot = slot
