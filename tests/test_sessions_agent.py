"""Sessions and terminals from the agent's side: the Python API, and the CLI as a user runs it."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import termios
import time

import pytest
from conftest import Target, wait_until
from test_cli_e2e import CLI, _env, paddock

from agent_side import AsyncTarget
from agent_side import Target as ApiTarget
from agent_side.errors import SessionRefused, SessionUnavailable, UsageError
from shared.wire import Session


def api(target: Target) -> ApiTarget:
    return ApiTarget.https(target.url, token=BUILDER_TOKEN, cacert=target.cacert)


from conftest import BUILDER_TOKEN  # noqa: E402

# --- the Python API ------------------------------------------------------------------------------


def test_target_session_keeps_the_shell_and_mirrors_run(target: Target) -> None:
    with api(target) as t:
        with t.session() as session:
            first = session.run("cd /tmp && export WHO=me && mkdir -p made")
            assert first.exit_code == 0
            result = session.run(["sh", "-c", 'pwd; echo "$WHO"; echo err >&2; exit 4'])
            assert result.exit_code == 4
            assert result.stdout == b"/tmp\nme\n"
            assert result.stderr == b"err\n"
            assert result.turn.session_id == session.id
            timed_out = session.run("sleep 30", timeout=1)
            assert timed_out.exit_code == 124
            assert session.run("echo $WHO").stdout == b"me\n"
            assert session.state().turns == 4
        assert t.client.session(session.id).state == "closed"


def test_target_session_refused_raises_with_the_refusal(target: Target) -> None:
    with api(target) as t, pytest.raises(SessionRefused) as refused:
        t.session(cwd="/etc")
    assert refused.value.refusal.rule in ("outside-workspace", "forbidden-path")


def test_target_session_runs_one_turn_at_a_time(target: Target) -> None:
    with api(target) as t, t.session() as session:
        turn = t.client.submit(
            new_session_turn(session.role, session.id, ["sleep", "30"]), idempotency_key=None
        )
        with pytest.raises(SessionUnavailable) as busy:
            session.run(["true"])
        assert busy.value.turn_id == turn.turn_id
        t.client.signal(turn.turn_id, "KILL")


def new_session_turn(role: str, session_id: str, argv: list[str]):
    from agent_side.turns import new_request

    return new_request(role=role, argv=argv, session=session_id)


def test_session_turn_request_refuses_fence_options_by_name() -> None:
    from agent_side.turns import new_request

    with pytest.raises(UsageError, match="session's fence"):
        new_request(role="r", argv=["true"], cwd="/srv", session="s-" + "0" * 32)


async def test_async_target_session(target: Target) -> None:
    async with AsyncTarget.https(target.url, token=BUILDER_TOKEN, cacert=target.cacert) as t:
        async with t.session() as session:
            await session.run("export ASYNC=yes")
            result = await session.run(["sh", "-c", 'echo "$ASYNC"'])
            assert result.stdout == b"yes\n"
            sid = session.id
        ended = await t.call(t.target.client.session, sid)
        assert ended.state == "closed"


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_session_start_run_list_end(target: Target) -> None:
    started = paddock("session", "start", "--timeout", "20", target=target)
    assert started.returncode == 0, started.stderr
    session_id = started.stdout.decode().strip()
    assert session_id.startswith("s-")
    first = paddock("run", "--session", session_id, "--", "export", "KEPT=1", target=target)
    assert first.returncode == 0, first.stderr
    second = paddock(
        "run", "--session", session_id, "--", "sh", "-c", 'echo "$KEPT"; exit 3', target=target
    )
    assert (second.returncode, second.stdout) == (3, b"1\n")
    listed = paddock("sessions", target=target)
    assert session_id in listed.stdout.decode()
    as_json = paddock("sessions", "--json", target=target)
    mine = [
        Session.model_validate_json(line)
        for line in as_json.stdout.decode().splitlines()
        if session_id in line
    ]
    assert mine[0].turns == 2 and mine[0].state == "open"
    ended = paddock("session", "end", session_id, target=target)
    assert ended.returncode == 0, ended.stderr
    after = paddock("run", "--session", session_id, "--", "true", target=target)
    assert after.returncode == 125
    assert b"session" in after.stderr


def test_cli_run_session_through_the_multiplexer(target: Target) -> None:
    started = paddock("session", "start", target=target)
    session_id = started.stdout.decode().strip()
    try:
        for n in range(3):  # the first runs in-process, the later ones through the daemon
            result = paddock(
                "run",
                "--session",
                session_id,
                "--",
                "sh",
                "-c",
                f"echo {n} >> /tmp/n; cat /tmp/n",
                target=target,
            )
            assert result.returncode == 0, result.stderr
        assert result.stdout == b"0\n1\n2\n"
    finally:
        paddock("session", "end", session_id, target=target)


def test_cli_session_start_refused_exits_as_a_refused_turn(target: Target) -> None:
    refused = paddock("session", "start", "--cwd", "/etc", target=target)
    assert refused.returncode == 126
    assert refused.stdout == b""
    assert b"refused" in refused.stderr


def test_cli_run_session_refuses_fence_options(target: Target) -> None:
    result = paddock("run", "--session", "s-" + "0" * 32, "--net", "--", "true", target=target)
    assert result.returncode == 125
    assert b"--net" in result.stderr and b"paddock session start" in result.stderr


# --- a terminal, driven through a pty ------------------------------------------------------------


class Terminal:
    """``paddock ARGS`` on a pty this test holds, as a person at a terminal would run it."""

    def __init__(self, target: Target, *args: str, rows: int = 30, cols: int = 90) -> None:
        self.master, slave = os.openpty()
        self.resize(rows, cols)
        self.before = termios.tcgetattr(slave)
        self.slave_path = os.ttyname(slave)

        def controlling_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [*CLI, *args],
            env=_env(target, TERM="xterm"),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            preexec_fn=controlling_terminal,
        )
        self.slave = slave
        self.seen = b""

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def read_until(self, text: bytes, timeout: float = 20) -> bool:
        deadline = time.monotonic() + timeout
        while text not in self.seen and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:
                    break
        return text in self.seen

    def wait(self) -> int:
        status = self.proc.wait(timeout=30)
        self.read_until(b"\0", timeout=0.5)
        return status

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal(target: Target):
    opened: list[Terminal] = []

    def start(*args: str, **size: int) -> Terminal:
        made = Terminal(target, *args, **size)
        opened.append(made)
        return made

    yield start
    for made in opened:
        made.close()


def test_paddock_shell_runs_commands_and_passes_the_exit_status(terminal) -> None:
    shell = terminal("shell", "--", "bash", "--norc", "--noprofile", "-i")
    shell.type(b"PS1='> '; stty size; echo sum=$((6*7))\r")
    assert shell.read_until(b"sum=42"), shell.seen
    assert b"30 90" in shell.seen
    raw = termios.tcgetattr(shell.slave)
    assert not raw[3] & termios.ICANON and not raw[3] & termios.ECHO  # raw while it runs
    shell.resize(41, 101)
    time.sleep(0.5)
    shell.type(b"stty size\r")
    assert shell.read_until(b"41 101"), shell.seen
    shell.type(b"sleep 30\r")
    time.sleep(0.5)
    shell.type(b"\x03")  # Ctrl-C: a byte, which the target's line discipline makes INT
    shell.type(b"echo rc=$?\r")
    assert shell.read_until(b"rc=130"), shell.seen
    shell.type(b"exit 7\r")
    assert shell.wait() == 7
    assert termios.tcgetattr(shell.slave) == shell.before  # the terminal is as it was


def test_paddock_shell_default_is_a_login_shell(terminal) -> None:
    shell = terminal("shell")
    shell.type(b"echo $0; shopt -q login_shell && echo login\r")
    assert shell.read_until(b"login\r\n"), shell.seen
    shell.type(b"exit\r")
    assert shell.wait() == 0


def test_paddock_run_it_is_a_terminal_too(terminal) -> None:
    run = terminal("run", "-it", "--", "sh", "-c", "stty size; read x; echo got=$x; exit 4")
    assert run.read_until(b"30 90"), run.seen
    run.type(b"typed\r")
    assert run.read_until(b"got=typed"), run.seen
    assert run.wait() == 4
    assert termios.tcgetattr(run.slave) == run.before


def test_paddock_shell_terminal_restored_when_killed(terminal) -> None:
    shell = terminal("shell", "--", "sleep", "60")
    assert wait_until(lambda: not termios.tcgetattr(shell.slave)[3] & termios.ICANON, timeout=20)
    shell.proc.terminate()  # TERM: paddock puts the terminal back before it goes
    assert shell.wait() == 128 + 15
    assert termios.tcgetattr(shell.slave) == shell.before


def test_paddock_run_in_a_session_on_a_terminal(terminal, target: Target) -> None:
    started = paddock("session", "start", target=target)
    session_id = started.stdout.decode().strip()
    try:
        run = terminal("run", "--session", session_id, "-it", "--", "sh", "-c", "stty size; exit 2")
        assert run.read_until(b"30 90"), run.seen
        assert run.wait() == 2
    finally:
        paddock("session", "end", session_id, target=target)
