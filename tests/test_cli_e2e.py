"""The `paddock` CLI as a user runs it, against a real target over TLS."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BUILDER_TOKEN, Target, processes_with, wait_until

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent
STATE_HOME = tempfile.mkdtemp(prefix="paddock-cli-state-")
"""Where these runs keep their cursors: never the real user's state directory."""
atexit.register(shutil.rmtree, STATE_HOME, True)


def _env(target: Target | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDOCK_")}
    env["PYTHONPATH"] = str(REPO)
    env["XDG_STATE_HOME"] = STATE_HOME
    if target is not None:
        env |= {
            "PADDOCK_TARGET": target.url,
            "PADDOCK_CACERT": target.cacert,
            "PADDOCK_TOKEN": BUILDER_TOKEN,
            "PADDOCK_ROLE": "builder",
        }
    return env | extra


def paddock(
    *args: str, target: Target | None = None, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CLI, *args],
        env=_env(target, **env),
        capture_output=True,
        timeout=60,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def test_run_passes_output_and_exit_status_through(target: Target) -> None:
    result = paddock("run", "--", "sh", "-c", "echo out; echo err >&2; exit 7", target=target)
    assert result.returncode == 7
    assert result.stdout == b"out\n"
    assert result.stderr == b"err\n"


def test_run_binary_output_arrives_byte_exact(target: Target) -> None:
    result = paddock("run", "--", "printf", "\\000\\377\\376abc", target=target)
    assert result.returncode == 0
    assert result.stdout == b"\x00\xff\xfeabc"


def test_run_refusal_is_126_with_one_sentence_on_stderr(target: Target) -> None:
    result = paddock("run", "--read", "/etc/shadow", "--", "true", target=target)
    assert result.returncode == 126
    text = result.stderr.decode()
    assert "forbidden-path" in text
    assert "/etc/shadow" in text
    assert result.stdout == b""


def test_run_program_not_found_is_127(target: Target) -> None:
    result = paddock("run", "--", "definitely-not-installed", target=target)
    assert result.returncode == 127
    assert b"not-found" in result.stderr


def test_run_timeout_is_124(target: Target) -> None:
    result = paddock("run", "--timeout", "1", "--", "sleep", "30", target=target)
    assert result.returncode == 124


def test_run_unreachable_target_is_125(target: Target) -> None:
    result = paddock("run", "--", "true", target=target, PADDOCK_TARGET="https://127.0.0.1:9")
    assert result.returncode == 125
    assert b"unreachable" in result.stderr.lower()


def test_run_wrong_token_is_125_naming_auth(target: Target) -> None:
    result = paddock("run", "--", "true", target=target, PADDOCK_TOKEN="not-the-token")
    assert result.returncode == 125
    assert b"auth" in result.stderr.lower() or b"token" in result.stderr.lower()


def test_run_untrusted_certificate_is_125_naming_tls(target: Target, tmp_path: Path) -> None:
    import trustme

    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    result = paddock("run", "--", "true", target=target, PADDOCK_CACERT=str(other_ca))
    assert result.returncode == 125
    assert b"tls" in result.stderr.lower()


@contextlib.contextmanager
def sleeping_turn(target: Target, marker: str) -> Iterator[subprocess.Popen[bytes]]:
    """``paddock run`` of a turn that sleeps ``marker`` seconds, once the sleep has begun."""
    with subprocess.Popen(
        [*CLI, "run", "--", "sh", "-c", f"echo ready; sleep {marker}"],
        env=_env(target),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
        yield proc


def test_run_ctrl_c_is_forwarded_to_the_turn(target: Target) -> None:
    marker = "321.5"
    with sleeping_turn(target, marker) as proc:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_run_output_is_streamed_as_it_arrives(target: Target) -> None:
    with subprocess.Popen(
        [*CLI, "run", "--", "sh", "-c", "echo first; sleep 3; echo second"],
        env=_env(target),
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdout is not None
        started = time.monotonic()
        assert proc.stdout.readline() == b"first\n"
        first_at = time.monotonic() - started
        assert proc.stdout.readline() == b"second\n"
        # The first line came well before the turn's end, not all at once at the end.
        assert time.monotonic() - started - first_at > 2.0
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("command", [["sh", "-c", "id -u; ls /; echo fenced"]])
def test_run_local_starts_and_removes_an_embedded_target(
    tmp_path: Path, command: list[str]
) -> None:
    workspace = tmp_path / "project"
    workspace.mkdir()
    before = _local_dirs()
    result = paddock("run", "--local", "--", *command, cwd=workspace)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert lines[0] != "0"
    assert "fenced" in lines
    assert "root" not in lines
    assert _local_dirs() == before


def test_run_local_hands_no_blocked_signal_to_its_turn(tmp_path: Path) -> None:
    """A signal mask survives exec: a CLI started with SIGINT blocked (by a program that
    runs it) must not hand that to the turn of its embedded target, whose Ctrl-C it forwards."""
    workspace = tmp_path / "project"
    workspace.mkdir()
    result = subprocess.run(
        [*CLI, "run", "--local", "--", "grep", "SigBlk", "/proc/self/status"],
        env=_env(),
        capture_output=True,
        timeout=60,
        cwd=workspace,
        stdin=subprocess.DEVNULL,
        preexec_fn=_blocking_int,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [b"SigBlk:", b"0000000000000000"]


def _blocking_int() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _local_dirs() -> set[str]:
    """What an embedded target leaves in the temp dirs it may use (other processes' files aside)."""
    found = set()
    for parent in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(parent):
            found |= {f"{parent}/{n}" for n in os.listdir(parent) if n.startswith("paddock-local-")}
    return found


def paddock_with_stdin(
    *args: str, data: bytes, target: Target
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CLI, *args], env=_env(target), capture_output=True, timeout=60, input=data
    )


def test_run_forwards_piped_stdin(target: Target) -> None:
    data = b"".join(b"line %d\n" % i for i in range(20000))
    result = paddock_with_stdin(
        "run", "--", "sh", "-c", "wc -l; echo done", data=data, target=target
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [b"20000", b"done"]


def test_run_stdin_piped_to_a_command_that_reads_none_still_exits(target: Target) -> None:
    result = paddock_with_stdin("run", "--", "true", data=b"x" * 300_000, target=target)
    assert result.returncode == 0, result.stderr


def test_run_no_stdin_keeps_it_closed(target: Target) -> None:
    result = paddock_with_stdin("run", "--no-stdin", "--", "cat", data=b"ignored", target=target)
    assert (result.returncode, result.stdout) == (0, b"")


def test_logs_and_turns_show_an_earlier_turn(target: Target) -> None:
    first = paddock("run", "--json", "--", "sh", "-c", "echo from-the-past; exit 4", target=target)
    turn_id = json.loads(first.stdout.splitlines()[-1])["turn_id"]
    logs = paddock("logs", turn_id, target=target)
    assert (logs.returncode, logs.stdout) == (0, b"from-the-past\n")
    # paddock run delivered it all already: following goes on after it, with the status.
    followed = paddock("logs", "--follow", turn_id, target=target)
    assert (followed.returncode, followed.stdout) == (4, b"")
    assert b"--from-start shows it all" in followed.stderr
    replayed = paddock("logs", "--follow", "--from-start", turn_id, target=target)
    assert (replayed.returncode, replayed.stdout) == (4, b"from-the-past\n")
    table = paddock("turns", "--limit", "5", target=target)
    assert table.returncode == 0
    lines = table.stdout.decode().splitlines()
    assert lines[0].split() == ["TURN", "ROLE", "STATE", "EXIT", "CREATED", "WALL"]
    assert any(line.startswith(turn_id) and " exited " in line and " 4 " in line for line in lines)


def test_plan_prints_the_fence_and_launches_nothing(target: Target) -> None:
    marker = target.workspace / "plan-cli-marker"
    result = paddock("plan", "--read", "/usr/share", "--", "touch", str(marker), target=target)
    assert result.returncode == 0, result.stderr
    text = result.stdout.decode()
    assert "executable  /usr/bin/touch" in text
    assert "ro      /usr/share  [fs.read[0]]" in text
    assert not marker.exists()


def test_plan_of_a_refused_request_exits_126(target: Target) -> None:
    result = paddock("plan", "--read", "/etc/shadow", "--", "cat", target=target)
    assert result.returncode == 126
    assert b"forbidden-path" in result.stderr


def test_logs_of_an_unknown_turn_says_unknown_not_lost(target: Target) -> None:
    result = paddock("logs", "t-" + "0" * 32, target=target)
    assert result.returncode == 125
    assert result.stderr.decode().startswith("paddock: unknown turn: the target does not know")
    bogus = paddock("logs", "not-a-turn", target=target)
    assert bogus.returncode == 125
    assert b"unknown turn" in bogus.stderr and b"lost" not in bogus.stderr


def test_run_without_a_role_uses_the_tokens_only_role(target: Target) -> None:
    result = paddock("run", "--", "true", target=target, PADDOCK_ROLE="")
    assert result.returncode == 0, result.stderr


def test_run_net_refusal_says_drop_net(target: Target) -> None:
    result = paddock("run", "--net", "--", "true", target=target)
    assert result.returncode == 126
    text = result.stderr.decode()
    assert "refused (network-not-allowed, network)" in text
    assert "drop --net" in text
    assert 'network "none"' not in text


def test_run_write_to_a_missing_directory_says_how_to_fix_it(target: Target) -> None:
    missing = target.workspace / "not-made-yet"
    result = paddock("run", "--write", str(missing), "--", "true", target=target)
    assert result.returncode == 126
    text = result.stderr.decode()
    assert "create it on the target, or give --write an existing directory" in text
    assert str(missing) in text


def test_run_passes_env_names_and_env_files_like_docker(target: Target, tmp_path: Path) -> None:
    env_file = tmp_path / "turn.env"
    env_file.write_text("# for the turn\nFROM_FILE=file value\nPASSED_ON\n")
    result = paddock(
        "run", "--env-file", str(env_file), "-e", "ALSO", "-w", str(target.workspace), "--",
        "sh", "-c", 'echo "$FROM_FILE|$PASSED_ON|$ALSO|$(pwd)"',
        target=target, PASSED_ON="from the shell", ALSO="also",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == f"file value|from the shell|also|{target.workspace}\n"


def test_run_from_a_terminal_says_stdin_is_not_forwarded(target: Target) -> None:
    controller, terminal = pty.openpty()
    try:
        result = subprocess.run(
            [*CLI, "run", "--", "cat"],
            env=_env(target),
            capture_output=True,
            timeout=60,
            stdin=terminal,
        )
    finally:
        os.close(terminal)
        os.close(controller)
    assert result.returncode == 0, result.stderr
    assert result.stderr.decode().count("\n") == 1
    assert "stdin is a terminal, which is not forwarded" in result.stderr.decode()


def _into_a_closed_pipe(*args: str, target: Target) -> subprocess.CompletedProcess[bytes]:
    """Run paddock with its stdout a pipe nobody reads, as ``paddock ... | head`` ends up."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [*CLI, *args],
            env=_env(target),
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )
    finally:
        os.close(write_end)


def test_plan_json_into_a_closed_pipe_ends_quietly(target: Target) -> None:
    result = _into_a_closed_pipe("plan", "--json", "--", "true", target=target)
    assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, b"")


def test_run_into_a_closed_pipe_stops_the_turn_and_ends_quietly(target: Target) -> None:
    marker = "321.875"
    command = ["sh", "-c", f"echo first; exec sleep {marker}"]
    result = _into_a_closed_pipe("run", "--", *command, target=target)
    assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, b"")
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_run_term_kills_the_turn(target: Target) -> None:
    marker = "321.625"
    with sleeping_turn(target, marker) as proc:
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_kill_ends_a_running_turn(target: Target) -> None:
    marker = "321.375"
    with sleeping_turn(target, marker) as proc:
        listed = paddock("turns", "--json", "--limit", "20", target=target)
        running = [json.loads(line) for line in listed.stdout.splitlines()]
        (turn_id,) = [t["turn_id"] for t in running if t["state"] == "running"]
        killed = paddock("kill", turn_id, target=target)
        assert killed.returncode == 0, killed.stderr
        assert killed.stderr.decode() == f"paddock: sent KILL to turn {turn_id}\n"
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_health_json_is_accepted(target: Target) -> None:
    result = paddock("health", "--json", target=target)
    assert result.returncode in (0, 1), result.stderr
    assert json.loads(result.stdout)["backend"] == "bubblewrap"
