"""Terminal turns over real bubblewrap and a real TLS target: a pty, its size, its keystrokes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import events, finished, output, submit, wait_until

from shared.wire import Session, Turn

TTY = {"rows": 33, "cols": 111, "term": "xterm-256color"}


def keys(client: httpx.Client, turn: Turn, data: bytes, eof: bool = False) -> None:
    params = {"eof": 1} if eof else None
    response = client.post(f"/v1/turns/{turn.turn_id}/stdin", content=data, params=params)
    assert response.status_code == 202, response.text


def output_so_far(client: httpx.Client, turn: Turn) -> str:
    return output(events(client, turn.turn_id, wait=0.3))


def wait_for_output(client: httpx.Client, turn: Turn, text: str, timeout: float = 15) -> None:
    assert wait_until(lambda: text in output_so_far(client, turn), timeout=timeout), output_so_far(
        client, turn
    )


@pytest.fixture
def session(client: httpx.Client) -> Iterator[Session]:
    response = client.post("/v1/sessions", json={"role": "builder"})
    assert response.status_code == 201, response.text
    opened = Session.model_validate(response.json())
    assert opened.state == "open", opened.refusal
    yield opened
    client.delete(f"/v1/sessions/{opened.session_id}")


# --- a turn of its own ---------------------------------------------------------------------------


def test_terminal_turn_sees_a_terminal_of_the_asked_size(client: httpx.Client) -> None:
    turn = submit(
        client,
        argv=["sh", "-c", "stty size; echo $TERM; [ -t 0 ] && [ -t 1 ] && echo tty"],
        tty=TTY,
    )
    evs = events(client, turn.turn_id)
    assert output(evs).replace("\r\n", "\n") == "33 111\nxterm-256color\ntty\n"
    ended = finished(client, turn.turn_id)
    assert ended.exit_code == 0
    assert ended.tty


def test_terminal_turn_output_is_one_stream(client: httpx.Client) -> None:
    turn = submit(client, argv=["sh", "-c", "echo out; echo err >&2"], tty=TTY)
    evs = events(client, turn.turn_id)
    assert not [e for e in evs if e.kind == "stderr"]
    assert output(evs).replace("\r\n", "\n") == "out\nerr\n"


def test_terminal_is_the_commands_controlling_terminal(client: httpx.Client) -> None:
    # /proc/self/stat field 7 is tty_nr: zero for a process without a controlling terminal.
    probe = "cut -d' ' -f7 /proc/self/stat; ps -o stat= -p $$"
    turn = submit(client, argv=["sh", "-c", probe], tty=TTY)
    tty_nr, stat = output(events(client, turn.turn_id)).split()
    assert tty_nr != "0"
    assert "+" in stat  # in the terminal's foreground process group
    plain = submit(client, argv=["sh", "-c", "cut -d' ' -f7 /proc/self/stat"])
    assert output(events(client, plain.turn_id)).strip() == "0"


def test_terminal_resize_reaches_the_command(client: httpx.Client) -> None:
    turn = submit(client, argv=["sh", "-c", "echo ready; read x; stty size"], tty=TTY)
    wait_for_output(client, turn, "ready")
    response = client.post(f"/v1/turns/{turn.turn_id}/resize", json={"rows": 12, "cols": 34})
    assert response.status_code == 202, response.text
    keys(client, turn, b"go\r")
    evs = events(client, turn.turn_id)
    assert output(evs).replace("\r\n", "\n").endswith("12 34\n")


def test_terminal_ctrl_c_interrupts_the_foreground_command(client: httpx.Client) -> None:
    turn = submit(client, argv=["sh", "-c", "echo ready; sleep 30; echo not-reached"], tty=TTY)
    wait_for_output(client, turn, "ready")
    keys(client, turn, b"\x03")
    ended = finished(client, turn.turn_id)
    assert ended.exit_code == 130
    assert "not-reached" not in output(events(client, turn.turn_id))


def test_terminal_job_control_in_an_interactive_shell(client: httpx.Client) -> None:
    turn = submit(client, argv=["bash", "--norc", "--noprofile", "-i"], tty=TTY)
    keys(client, turn, b"PS1='$ '; sleep 30\r")
    time.sleep(1)
    keys(client, turn, b"\x03")  # the line discipline interrupts sleep, not bash
    keys(client, turn, b"echo rc=$?\r")
    wait_for_output(client, turn, "rc=130")
    keys(client, turn, b"sleep 30 &\r")
    keys(client, turn, b"jobs\r")
    wait_for_output(client, turn, "Running")
    keys(client, turn, b"kill %1; exit 3\r")
    ended = finished(client, turn.turn_id)
    assert ended.exit_code == 3


def test_terminal_keystrokes_are_read_and_eof_is_ctrl_d(client: httpx.Client) -> None:
    turn = submit(client, argv=["cat"], tty=TTY)
    keys(client, turn, b"typed\r", eof=True)
    evs = events(client, turn.turn_id)
    assert "typed" in output(evs)
    assert finished(client, turn.turn_id).exit_code == 0


def test_terminal_keeps_the_filter_on_tiocsti(client: httpx.Client) -> None:
    code = (
        "import fcntl, termios\n"
        "try:\n    fcntl.ioctl(0, termios.TIOCSTI, b'x')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
        "else:\n    print('pushed')\n"
    )
    turn = submit(client, argv=["python3", "-c", code], tty=TTY)
    assert output(events(client, turn.turn_id)).strip() == "refused 1"


def test_resize_of_a_turn_without_a_terminal_is_409(client: httpx.Client) -> None:
    turn = submit(client, argv=["sleep", "5"])
    response = client.post(f"/v1/turns/{turn.turn_id}/resize", json={"rows": 10, "cols": 10})
    assert response.status_code == 409
    assert response.json()["title"] == "Turn has no terminal"
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    finished(client, turn.turn_id)
    after = client.post(f"/v1/turns/{turn.turn_id}/resize", json={"rows": 10, "cols": 10})
    assert after.status_code == 409


@pytest.mark.parametrize(
    "size", [{"rows": 0, "cols": 10}, {"rows": 10}, {"rows": 10, "cols": 100000}]
)
def test_terminal_sizes_out_of_range_are_422(client: httpx.Client, size: dict) -> None:
    response = client.post("/v1/turns", json={"role": "builder", "argv": ["true"], "tty": size})
    assert response.status_code == 422, response.text


# --- in a session --------------------------------------------------------------------------------


def test_session_terminal_turn_sees_its_size_and_keeps_the_shell(
    client: httpx.Client, session: Session
) -> None:
    turn = submit(
        client, argv=["sh", "-c", "stty size; echo $TERM"], tty=TTY, session=session.session_id
    )
    assert output(events(client, turn.turn_id)).replace("\r\n", "\n") == "33 111\nxterm-256color\n"
    assert finished(client, turn.turn_id).tty
    plain = submit(
        client, argv=["sh", "-c", "[ -t 1 ] || echo not-a-tty"], session=session.session_id
    )
    assert output(events(client, plain.turn_id)) == "not-a-tty\n"


def test_session_terminal_ctrl_c_interrupts_the_command_not_the_session(
    client: httpx.Client, session: Session
) -> None:
    turn = submit(
        client,
        argv=["sh", "-c", "echo ready; sleep 30"],
        tty=TTY,
        session=session.session_id,
    )
    wait_for_output(client, turn, "ready")
    keys(client, turn, b"\x03")
    assert finished(client, turn.turn_id).exit_code == 130
    after = submit(client, argv=["echo", "alive"], session=session.session_id)
    assert output(events(client, after.turn_id)) == "alive\n"


def test_session_terminal_resize(client: httpx.Client, session: Session) -> None:
    turn = submit(
        client,
        argv=["sh", "-c", "echo ready; read x; stty size"],
        tty=TTY,
        session=session.session_id,
    )
    wait_for_output(client, turn, "ready")
    response = client.post(f"/v1/turns/{turn.turn_id}/resize", json={"rows": 21, "cols": 43})
    assert response.status_code == 202, response.text
    keys(client, turn, b"go\r")
    assert output(events(client, turn.turn_id)).replace("\r\n", "\n").endswith("21 43\n")
