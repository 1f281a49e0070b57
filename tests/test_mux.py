"""The local multiplexer: ``paddock run`` as a user runs it, against a real target over TLS.

Every test has its own runtime directory (``XDG_RUNTIME_DIR``), so the
multiplexers it sees are its own; they are stopped when it ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BUILDER_TOKEN, Target, mux_daemons, processes_with, stop_muxes, wait_until
from test_cli_imports import loaded_by
from test_resume import CuttingProxy

from agent_side import targets_file
from agent_side.api import Target as ApiTarget
from agent_side.cursors import CursorStore
from agent_side.mux.relay import relay_turn
from agent_side.targets_file import StoredTarget

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


@dataclass
class Mux:
    """One test's runtime directory, and ``paddock`` run against the session's target."""

    runtime: Path
    target: Target

    @property
    def directory(self) -> Path:
        return self.runtime / "paddock-mux"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PADDOCK_")}
        env |= {
            "PYTHONPATH": str(REPO),
            "XDG_RUNTIME_DIR": str(self.runtime),
            "PADDOCK_TARGET": self.target.url,
            "PADDOCK_CACERT": self.target.cacert,
            "PADDOCK_TOKEN": BUILDER_TOKEN,
            "PADDOCK_ROLE": "builder",
        }
        return env | extra

    def paddock(
        self, *args: str, input: bytes | None = None, **env: str
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*CLI, *args],
            env=self.env(**env),
            capture_output=True,
            timeout=60,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )

    def popen(self, *args: str, **options: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*CLI, *args],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **options,  # type: ignore[call-overload]
        )

    def daemons(self) -> list[int]:
        return mux_daemons(self.runtime)

    def ready(self, **env: str) -> int:
        """The pid of the daemon the last run started, once it answers (``paddock mux status``)."""
        found: list[int] = []

        def answers() -> bool:
            status = self.paddock("mux", "status", "--json", **env)
            records = [json.loads(line) for line in status.stdout.splitlines()]
            found[:] = [r["pid"] for r in records if r.get("t") == "status"]
            return len(found) == 1

        assert wait_until(answers, timeout=30), "no multiplexer came up"
        return found[0]

    def warm(self, **env: str) -> int:
        """Run once (in-process, starting the daemon), then wait for it: later runs use it."""
        first = self.paddock("run", "--", "true", **env)
        assert first.returncode == 0, first.stderr
        return self.ready(**env)

    def sockets(self) -> list[Path]:
        if not self.directory.exists():
            return []
        return sorted(self.directory.glob("*.sock"))

    def socket_path(self) -> Path:
        """The socket a run against the target uses: learnt from a run, its daemon then stopped."""
        self.warm()
        (path,) = self.sockets()
        assert self.paddock("mux", "stop").returncode == 0
        assert wait_until(lambda: not self.daemons())
        return path


@pytest.fixture
def mux(target: Target) -> Iterator[Mux]:
    # Short: the tests bind and connect by path, and a unix socket's path is at most 107 bytes.
    runtime = Path(tempfile.mkdtemp(prefix="paddock-mux-test-"))
    try:
        yield Mux(runtime, target)
    finally:
        stop_muxes(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


# -- started on first use, reused, replaced, bypassed, stopped, idle ---------------------


def test_mux_is_started_by_the_first_run_and_serves_the_next(mux: Mux) -> None:
    first = mux.paddock("run", "--", "echo", "one")  # in-process, starting the daemon
    assert (first.returncode, first.stdout, first.stderr) == (0, b"one\n", b"")
    daemon = mux.ready()
    (sock,) = mux.sockets()
    assert sock.stat().st_mode & 0o777 == 0o600
    assert mux.directory.stat().st_mode & 0o777 == 0o700
    for n in range(2):
        again = mux.paddock("run", "--", "echo", str(n))
        assert (again.returncode, again.stdout, again.stderr) == (0, f"{n}\n".encode(), b"")
    assert mux.daemons() == [daemon]
    status = mux.paddock("mux", "status", "--json")
    (record,) = [json.loads(line) for line in status.stdout.splitlines()]
    assert record["pid"] == daemon
    assert record["route"] == mux.target.url
    assert record["targets"] == 1  # it opened the target: the runs went through it


def test_mux_killed_daemon_is_replaced(mux: Mux) -> None:
    killed = mux.warm()
    os.kill(killed, signal.SIGKILL)
    assert wait_until(lambda: not mux.daemons())
    assert len(mux.sockets()) == 1  # left behind by the dead daemon
    result = mux.paddock("run", "--", "echo", "again")
    assert (result.returncode, result.stdout, result.stderr) == (0, b"again\n", b"")
    replacement = mux.ready()
    assert replacement != killed
    through = mux.paddock("run", "--", "echo", "through")
    assert (through.returncode, through.stdout) == (0, b"through\n")
    assert mux.daemons() == [replacement]


def test_mux_second_daemon_for_the_same_target_leaves_at_once(mux: Mux) -> None:
    daemon = mux.warm()
    (sock,) = mux.sockets()
    name = sock.name.removesuffix(".sock")
    serve = [*CLI, "mux", "serve", "--dir", str(mux.directory), name]
    assert subprocess.run(serve, env=mux.env(), timeout=30).returncode == 0
    assert mux.daemons() == [daemon]
    assert mux.paddock("run", "--", "true").returncode == 0


@pytest.mark.parametrize("how", [["--no-mux"], []])
def test_mux_no_mux_runs_in_process(mux: Mux, how: list[str]) -> None:
    env = {} if how else {"PADDOCK_NO_MUX": "1"}
    result = mux.paddock("run", *how, "--", "echo", "direct", **env)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"direct\n", b"")
    assert mux.daemons() == []
    assert mux.sockets() == []


def test_mux_stop_ends_it_and_the_next_run_starts_another(mux: Mux) -> None:
    first = mux.warm()
    stopped = mux.paddock("mux", "stop")
    assert stopped.returncode == 0
    assert f"stopped (pid {first})" in stopped.stdout.decode()
    assert wait_until(lambda: not mux.daemons())
    assert mux.sockets() == []
    assert mux.warm() != first


def test_mux_leaves_when_idle(mux: Mux) -> None:
    result = mux.paddock("run", "--mux-persist", "1", "--", "echo", "brief")
    assert (result.returncode, result.stdout) == (0, b"brief\n")
    mux.ready()
    through = mux.paddock("run", "--mux-persist", "1", "--", "echo", "through")
    assert (through.returncode, through.stdout) == (0, b"through\n")
    assert wait_until(lambda: not mux.daemons(), timeout=20)
    assert mux.sockets() == []


def test_mux_persist_from_the_environment_must_be_a_duration(mux: Mux) -> None:
    result = mux.paddock("run", "--", "true", PADDOCK_MUX_PERSIST="soon")
    assert result.returncode == 125
    assert b"PADDOCK_MUX_PERSIST: 'soon' is not a duration" in result.stderr
    assert mux.daemons() == []


# -- a run through it behaves as one without it -------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--", "sh", "-c", "echo out; printf '\\377' >&2; exit 7"],
        ["--", "printf", "\\000\\377\\376abc"],
        ["--read", "/etc/shadow", "--", "true"],
        ["--net", "--", "true"],
        ["--", "definitely-not-installed"],
        ["--timeout", "1", "--", "sleep", "30"],
        ["--role", "nobody-has-it", "--", "true"],
        ["--cwd", "relative", "--", "true"],
    ],
    ids=["status", "binary", "refused", "net", "not-found", "timeout", "bad-role", "usage"],
)
def test_mux_run_matches_a_run_without_it(mux: Mux, args: list[str]) -> None:
    mux.warm()
    direct = mux.paddock("run", "--no-mux", *args)
    muxed = mux.paddock("run", *args)
    seen = (muxed.returncode, muxed.stdout, muxed.stderr)
    assert seen == (direct.returncode, direct.stdout, direct.stderr), (seen, direct)


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["text", "json"])
def test_mux_token_rejected_matches_a_run_without_it(mux: Mux, flags: list[str]) -> None:
    mux.warm()
    wrong = {"PADDOCK_TOKEN": "not-the-token"}
    direct = mux.paddock("run", *flags, "--no-mux", "--", "true", **wrong)
    muxed = mux.paddock("run", *flags, "--", "true", **wrong)
    assert muxed.returncode == direct.returncode == 125
    assert (muxed.stdout, muxed.stderr) == (direct.stdout, direct.stderr)
    assert b"auth rejected" in muxed.stderr


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["text", "json"])
def test_mux_target_gone_matches_a_run_without_it(mux: Mux, flags: list[str]) -> None:
    proxy = DroppingProxy(int(mux.target.url.rsplit(":", 1)[1]), seed=1)
    via = {"PADDOCK_TARGET": f"https://127.0.0.1:{proxy.port}"}
    try:
        mux.warm(**via)
        assert mux.paddock("run", "--", "true", **via).returncode == 0
    finally:
        # The target is gone from where the multiplexer reached it: nothing new accepted,
        # then every connection accepted so far (the pooled one too) dropped.
        proxy.close()
        proxy.drop_all()
    direct = mux.paddock("run", *flags, "--no-mux", "--", "true", **via)
    muxed = mux.paddock("run", *flags, "--", "true", **via)
    assert muxed.returncode == direct.returncode == 125
    assert (muxed.stdout, muxed.stderr) == (direct.stdout, direct.stderr)
    assert b"target unreachable" in muxed.stderr
    assert len(mux.daemons()) == 1


def test_mux_is_not_started_for_a_target_never_reached(mux: Mux) -> None:
    for _ in range(2):
        result = mux.paddock("run", "--", "true", PADDOCK_TARGET="https://127.0.0.1:9")
        assert result.returncode == 125
        assert b"target unreachable" in result.stderr
    assert mux.daemons() == []


def test_mux_json_events_match_a_run_without_it(mux: Mux) -> None:
    def shape(result: subprocess.CompletedProcess[bytes]) -> list[tuple[object, ...]]:
        records = [json.loads(line) for line in result.stdout.splitlines()]
        return [(r.get("kind"), r.get("data"), r.get("state"), r.get("exit_code")) for r in records]

    command = ["--json", "--", "sh", "-c", "echo a; echo b >&2; exit 3"]
    mux.warm()
    direct = mux.paddock("run", "--no-mux", *command)
    muxed = mux.paddock("run", *command)
    assert muxed.returncode == direct.returncode == 3
    assert shape(muxed) == shape(direct)
    assert shape(muxed)[-1] == (None, None, "exited", 3)


def test_mux_forwards_piped_stdin(mux: Mux) -> None:
    mux.warm()
    data = b"".join(b"line %d\n" % i for i in range(50000))
    result = mux.paddock("run", "--", "sh", "-c", "wc -l; echo done", input=data)
    assert (result.returncode, result.stdout.split()) == (0, [b"50000", b"done"])
    unread = mux.paddock("run", "--", "true", input=b"x" * 300_000)
    assert unread.returncode == 0, unread.stderr
    closed = mux.paddock("run", "--no-stdin", "--", "cat", input=b"ignored")
    assert (closed.returncode, closed.stdout) == (0, b"")
    assert len(mux.daemons()) == 1


@contextlib.contextmanager
def sleeping(mux: Mux, marker: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    mux.warm()
    with mux.popen("run", *args, "--", "sh", "-c", f"echo ready; exec sleep {marker}") as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
        yield proc


def test_mux_ctrl_c_reaches_the_turn(mux: Mux) -> None:
    marker = "322.5"
    with sleeping(mux, marker) as proc:
        assert len(mux.daemons()) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
        assert proc.stderr is not None
        assert b"sent INT to turn t-" in proc.stderr.read()
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_mux_term_kills_the_turn(mux: Mux) -> None:
    marker = "322.625"
    with sleeping(mux, marker) as proc:
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_mux_third_ctrl_c_stops_waiting_for_a_stuck_multiplexer(mux: Mux) -> None:
    marker = "322.75"
    with sleeping(mux, marker) as proc:
        (daemon,) = mux.daemons()
        os.kill(daemon, signal.SIGSTOP)  # nothing reaches the turn while it is stopped
        try:
            for _ in range(3):
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)  # separate presses: Python merges a burst into one
            assert proc.wait(timeout=30) == 128 + signal.SIGINT
            assert proc.stderr is not None
            said = proc.stderr.read().decode()
            assert said == "paddock: interrupted; the turn may still be running on the target\n"
        finally:
            os.kill(daemon, signal.SIGCONT)
    # What was sent before giving up (INT, then KILL) still reaches the turn.
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_mux_run_into_a_closed_pipe_stops_the_turn_and_ends_quietly(mux: Mux) -> None:
    marker = "322.875"
    mux.warm()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*CLI, "run", "--", "sh", "-c", f"echo first; exec sleep {marker}"],
            env=mux.env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, b"")
    assert wait_until(lambda: not processes_with("sleep", marker))
    assert len(mux.daemons()) == 1


class DroppingProxy(CuttingProxy):
    """``CuttingProxy`` that can also drop every connection it carries, idle ones included."""

    def __init__(self, upstream_port: int, seed: int) -> None:
        super().__init__(upstream_port, seed, cuts=0)

    def drop_all(self) -> None:
        for client in self._clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)


def test_mux_resumes_through_dropped_connections(mux: Mux) -> None:
    count = 1_000_000
    expected = subprocess.run(["seq", str(count)], capture_output=True, check=True).stdout
    proxy = DroppingProxy(int(mux.target.url.rsplit(":", 1)[1]), seed=20261130)
    via = {"PADDOCK_TARGET": f"https://127.0.0.1:{proxy.port}"}
    try:
        mux.warm(**via)
        assert mux.paddock("run", "--", "true", **via).returncode == 0
        proxy.drop_all()  # the daemon's pooled connection dies with the others
        proxy.cuts_left = 4  # and the next four are cut mid-stream
        result = mux.paddock("run", "--", "seq", str(count), **via)
    finally:
        proxy.close()
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(result.stdout).hexdigest() == hashlib.sha256(expected).hexdigest()
    assert proxy.cuts_left == 0, "the proxy never cut the stream: the test proved nothing"
    assert len(mux.daemons()) == 1


def test_mux_serves_a_stored_target(mux: Mux) -> None:
    config = mux.runtime / "config"
    stored = StoredTarget(
        name="session-target",
        route="https",
        url=mux.target.url,
        ca_sha256=targets_file.fingerprint(Path(mux.target.cacert).read_text()),
        default_role="builder",
    )
    environ = {"XDG_CONFIG_HOME": str(config)}
    ca_pem = Path(mux.target.cacert).read_text()
    targets_file.save(stored, tokens={"builder": BUILDER_TOKEN}, ca_pem=ca_pem, environ=environ)
    # Nothing but the stored target: no PADDOCK_TARGET, PADDOCK_TOKEN or PADDOCK_CACERT.
    env = {k: v for k, v in mux.env().items() if not k.startswith("PADDOCK_")} | environ
    command = [*CLI, "run", "-t", "session-target", "--", "echo", "stored"]

    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            command, env=env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL
        )

    assert run().stdout == b"stored\n"
    mux.ready()
    through = run()
    assert (through.returncode, through.stdout, through.stderr) == (0, b"stored\n", b"")
    status = mux.paddock("mux", "status", "--json")
    assert json.loads(status.stdout)["targets"] == 1


def test_mux_run_loads_nothing_heavy(mux: Mux) -> None:
    mux.warm()
    status, heavy = loaded_by(["run", "--no-stdin", "--", "echo", "light"], mux.env())
    assert (status, heavy) == (0, [])


def test_mux_run_names_its_daemon_without_loading_openssl(mux: Mux) -> None:
    # hashlib loads OpenSSL's library (~3.5 ms a command); CPython's own SHA-256 does not.
    builtin = importlib.util.find_spec("_sha2") or importlib.util.find_spec("_sha256")
    assert builtin is not None, "this interpreter has no built-in SHA-256 to compare with"
    mux.warm()
    status, loaded = loaded_by(["run", "--no-stdin", "--", "true"], mux.env(), ("_hashlib",))
    assert (status, loaded) == (0, [])


def test_mux_keeps_the_token_out_of_its_command_line_environment_and_log(mux: Mux) -> None:
    daemon = mux.warm()
    assert mux.paddock("run", "--", "true").returncode == 0
    token = BUILDER_TOKEN.encode()
    assert token not in Path(f"/proc/{daemon}/cmdline").read_bytes()
    assert token not in Path(f"/proc/{daemon}/environ").read_bytes()
    for entry in mux.directory.iterdir():
        assert BUILDER_TOKEN not in entry.name
        if entry.suffix == ".log":
            assert token not in entry.read_bytes()


# -- what it refuses to trust -------------------------------------------------------------


@contextlib.contextmanager
def planted(path: Path, *, owner: int | None = None, mode: int = 0o600) -> Iterator[None]:
    """A socket at ``path``, listening in this process, that hangs up on whoever connects."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        path.chmod(mode)
        if owner is not None:
            os.chown(path, owner, owner)
        listener.listen()
    except BaseException:
        listener.close()
        raise
    stop = threading.Event()

    def hang_up() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                listener.accept()[0].close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        listener.close()


def _refused(result: subprocess.CompletedProcess[bytes], *said: str) -> None:
    assert result.returncode == 125, result.stderr
    text = result.stderr.decode()
    assert text.startswith("paddock: mux refused: "), text
    assert "--no-mux" in text
    for part in said:
        assert part in text, text
    assert result.stdout == b""


def test_mux_refuses_a_socket_owned_by_another_user(mux: Mux) -> None:
    path = mux.socket_path()
    with planted(path, owner=NOBODY):
        before = path.stat().st_ino
        result = mux.paddock("run", "--", "true")
        _refused(result, str(path), f"belongs to uid {NOBODY}", f"rm {path}")
        assert path.stat().st_ino == before  # refused, not replaced
    assert mux.daemons() == []


def test_mux_refuses_a_socket_open_to_others(mux: Mux) -> None:
    path = mux.socket_path()
    with planted(path, mode=0o666):
        result = mux.paddock("run", "--", "true")
    _refused(result, str(path), "open to group or others (mode 666)")
    assert mux.daemons() == []


def test_mux_refuses_a_socket_served_by_another_user(mux: Mux) -> None:
    path = mux.socket_path()
    # Bound as us (so the file is ours, 0600), listening as nobody: only SO_PEERCRED tells.
    server = (
        "import os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o600)\n"
        f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "s.listen(); print('ready', flush=True)\n"
        "while True:\n"
        "    s.accept()[0].close()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", server, str(path)], stdout=subprocess.PIPE
    ) as impostor:
        try:
            assert impostor.stdout is not None
            assert impostor.stdout.readline() == b"ready\n"
            assert path.stat().st_uid == os.getuid()
            result = mux.paddock("run", "--", "true")
        finally:
            impostor.kill()
    _refused(result, str(path), f"runs as uid {NOBODY}, not as you")
    assert mux.daemons() == []


@pytest.mark.parametrize("unsafe", ["mode", "owner"])
def test_mux_refuses_a_directory_others_could_write(mux: Mux, unsafe: str) -> None:
    mux.directory.mkdir(mode=0o700)
    if unsafe == "mode":
        mux.directory.chmod(0o777)
        said = ["open to group or others (mode 777)", f"chmod 700 {mux.directory}"]
    else:
        os.chown(mux.directory, NOBODY, NOBODY)
        said = [f"belongs to uid {NOBODY}, not to you"]
    result = mux.paddock("run", "--", "true")
    _refused(result, str(mux.directory), *said)
    assert mux.daemons() == []


def test_mux_daemon_serves_no_other_user(mux: Mux) -> None:
    mux.warm()
    (sock,) = mux.sockets()
    # Opened up by hand (as only root could): the daemon still checks who connects.
    for directory in (mux.runtime, mux.directory):
        directory.chmod(0o711)
    sock.chmod(0o666)
    client = (
        "import json, os, socket, sys\n"
        f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1])\n"
        "try:\n"
        "    c.sendall(json.dumps({'op': 'status', 'protocol': 1}).encode() + b'\\n')\n"
        "    sys.stdout.buffer.write(c.recv(65536))\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    pass  # hung up on\n"
    )
    answer = subprocess.run(
        [sys.executable, "-c", client, str(sock)], capture_output=True, timeout=30
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout == b""  # hung up on, told nothing
    for directory in (mux.runtime, mux.directory):
        directory.chmod(0o700)
    sock.chmod(0o600)
    own = mux.paddock("mux", "status", "--json")
    assert json.loads(own.stdout)["t"] == "status"


class _SlowConfirmingClient:
    """A ``paddock run`` on the other end of a relay's channel that confirms each event it
    is shown a moment late, as a loaded machine's client may."""

    def __init__(self, late_s: float) -> None:
        self._late_s = late_s
        self._replies: queue.SimpleQueue[tuple[dict[str, object], bytes] | None] = (
            queue.SimpleQueue()
        )
        self.exited = threading.Event()

    def send(self, message: dict[str, object], data: bytes = b"") -> None:
        if message.get("t") == "seq":
            confirm = ({"t": "delivered", "seq": message["seq"]}, b"")
            threading.Timer(self._late_s, self._replies.put, (confirm,)).start()
        elif message.get("t") == "exit":
            self.exited.set()
            threading.Timer(self._late_s * 2, self._replies.put, (None,)).start()

    def receive(self) -> tuple[dict[str, object], bytes] | None:
        return self._replies.get()


def test_a_relayed_turns_last_event_is_in_its_cursor_however_late_the_client_confirms(
    target: Target, tmp_path: Path
) -> None:
    """The relay closed the turn's cursor once the turn ended, and a confirmation still on
    its way was lost: ``paddock logs --follow`` then showed the turn's last output again."""
    api = ApiTarget.https(target.url, token=BUILDER_TOKEN, cacert=target.cacert, role="builder")
    environ = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    message = {
        "options": {"argv": ["sh", "-c", "echo last words"]},
        "stdin": "closed",
        "cursor": {"name": None, "ssh": None, "environ": environ},
    }
    client = _SlowConfirmingClient(late_s=0.2)
    with api:
        relay_turn(api, client, message)  # type: ignore[arg-type]
        turn = api.client.turns(limit=1)[0]
        shown = [e.seq for e in api.client.events(turn.turn_id)]
    assert client.exited.is_set()
    store = CursorStore.for_user(environ, api.client.base_url)
    assert store.last_delivered(turn.turn_id) == shown[-1]
