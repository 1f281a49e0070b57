"""``paddock run`` while its turn runs (agent_side.streaming), against a scripted target.

Output streaming, the JSON sink, refusals, Ctrl-C and TERM forwarding; the
same against a real target, as a user runs it, is in test_cli_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest
from scripted_server import (
    ERR_B64,
    EXIT,
    OUT,
    STARTED,
    TOKEN,
    TURN_ID,
    Handler,
    Scripted,
    Seen,
    frame,
    problem,
    reply_json,
    script_turn,
    start_stream,
    turn_json,
)

from agent_side import cli

pytestmark = pytest.mark.usefixtures("no_paddock_env")


def run_main(script: Scripted, monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setenv("PADDOCK_TARGET", script.url)
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    script.routes.setdefault(
        ("GET", "/v1/roles"), lambda h, s: reply_json(h, 200, {"roles": ["default"]})
    )
    return cli.main(["run", "--no-stdin", *argv])


def test_run_streams_output_bytes_and_exits_with_the_turn_status(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    notice = {"seq": 4, "kind": "notice", "message": "output truncated"}
    exit_ = {**EXIT, "seq": 5}
    err_text = {"seq": 3, "kind": "stderr", "data": "warning: x\n"}
    frames = b"".join(frame(e) for e in (STARTED, OUT, err_text, notice, exit_))
    script_turn(scripted, frames, turn_json(state="exited", exit_code=3))
    assert run_main(scripted, monkeypatch, "--cwd", "/w", "-e", "A=1", "--", "make") == 3
    out, err = capfd.readouterr()
    assert out == "hello\n"
    assert err == "warning: x\npaddock: notice: output truncated\n"
    posted = json.loads(scripted.paths("POST", "/v1/turns")[0].body)
    assert posted["argv"] == ["make"]
    assert posted["cwd"] == "/w"
    assert posted["env"] == {"A": "1"}
    assert scripted.paths("POST", "/v1/turns")[0].headers["Idempotency-Key"]


def test_run_without_a_role_runs_as_the_tokens_only_role(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    scripted.routes["GET", "/v1/roles"] = lambda h, s: reply_json(h, 200, {"roles": ["builder"]})
    frames = b"".join(frame(e) for e in (STARTED, {**EXIT, "seq": 2, "exit_code": 0}))
    script_turn(scripted, frames, turn_json(state="exited", exit_code=0))
    assert run_main(scripted, monkeypatch, "--", "true") == 0
    assert json.loads(scripted.paths("POST", "/v1/turns")[0].body)["role"] == "builder"


def test_run_without_a_role_for_a_token_with_several_names_them(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    roles = {"roles": ["builder", "tester"]}
    scripted.routes["GET", "/v1/roles"] = lambda h, s: reply_json(h, 200, roles)
    assert run_main(scripted, monkeypatch, "--", "true") == 125
    assert "holds 2 roles (builder, tester)" in capfd.readouterr().err
    assert scripted.paths("POST", "/v1/turns") == []


def test_run_writes_undecodable_stderr_bytes_as_they_are(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    frames = b"".join(frame(e) for e in (STARTED, ERR_B64, {**EXIT, "exit_code": 0}))
    script_turn(scripted, frames, turn_json(state="exited", exit_code=0))
    assert run_main(scripted, monkeypatch, "--", "true") == 0
    assert capfdbinary.readouterr().err == b"\xff\n"


def test_run_json_prints_events_then_the_turn(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    final = turn_json(state="exited", exit_code=3)
    script_turn(scripted, b"".join(frame(e) for e in (STARTED, OUT, EXIT)), final)
    assert run_main(scripted, monkeypatch, "--json", "--", "make") == 3
    lines = capfd.readouterr().out.splitlines()
    assert [json.loads(line).get("kind") for line in lines[:3]] == ["started", "stdout", "exit"]
    assert json.loads(lines[3])["turn_id"] == TURN_ID
    assert len(lines) == 4


def test_run_refused_prints_one_sentence_and_exits_126(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    refusal = {
        "rule": "outside-workspace",
        "subject": "cwd",
        "path": "/etc",
        "resolved": "/etc",
        "detail": "/etc is outside the role's workspaces (/srv/work); pick a cwd inside one.",
    }
    refused = {"seq": 1, "kind": "refused", "refusal": refusal, "exit_code": 126}
    final = turn_json(state="refused", exit_code=126, refusal=refusal)
    script_turn(scripted, frame(refused), final)
    assert run_main(scripted, monkeypatch, "--cwd", "/etc", "--", "ls") == 126
    out, err = capfd.readouterr()
    assert out == ""
    assert err == (
        "paddock: refused (outside-workspace, cwd): /etc is outside the role's workspaces "
        "(/srv/work); pick a cwd inside one (path /etc).\n"
    )


def test_run_auth_rejected_exits_125(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    scripted.routes["POST", "/v1/turns"] = problem(401, "unknown token")
    assert run_main(scripted, monkeypatch, "--role", "default", "--", "true") == 125
    err = capfd.readouterr().err
    assert err.startswith("paddock: auth rejected: the target rejected the token (401")
    assert TOKEN not in err


# -- signals ----------------------------------------------------------------------------


def _endless_turn(script: Scripted, released: threading.Event) -> threading.Event:
    """A turn that streams ``started`` and then nothing until ``released``; set once streaming."""
    streaming = threading.Event()

    def events(handler: Handler, seen: Seen) -> None:
        start_stream(handler)
        handler.wfile.write(frame(STARTED))
        handler.wfile.flush()
        streaming.set()
        released.wait(10)

    script.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 201, turn_json())
    script.routes["GET", f"/v1/turns/{TURN_ID}/events"] = events
    return streaming


def test_run_forwards_ctrl_c_as_int(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    streaming = threading.Event()
    signalled = threading.Event()

    def events(handler: Handler, seen: Seen) -> None:
        start_stream(handler)
        handler.wfile.write(frame(STARTED))
        handler.wfile.flush()
        streaming.set()
        signalled.wait(10)
        handler.wfile.write(frame({"seq": 2, "kind": "exit", "exit_code": 130, "signal": 2}))

    def signal_route(handler: Handler, seen: Seen) -> None:
        signalled.set()
        reply_json(handler, 202, turn_json())

    final = turn_json(state="exited", exit_code=130, signal=2)
    scripted.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 201, turn_json())
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(h, 200, final)
    scripted.routes["GET", f"/v1/turns/{TURN_ID}/events"] = events
    scripted.routes["POST", f"/v1/turns/{TURN_ID}/signal"] = signal_route

    def press_ctrl_c() -> None:
        if streaming.wait(10):
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    try:
        assert run_main(scripted, monkeypatch, "--", "sleep", "60") == 130
    finally:
        presser.join(10)
    sent = scripted.paths("POST", f"/v1/turns/{TURN_ID}/signal")
    assert [json.loads(s.body) for s in sent] == [{"signal": "INT"}]
    # Whatever handled SIGINT before the run (ignored, in a background job) does again.
    assert signal.getsignal(signal.SIGINT) is before


class Posted:
    """The signals the scripted target is sent, in order; a test can wait for the n-th."""

    def __init__(self, script: Scripted) -> None:
        self.names: list[str] = []
        self._changed = threading.Condition()
        script.routes["POST", f"/v1/turns/{TURN_ID}/signal"] = self._route

    def _route(self, handler: Handler, seen: Seen) -> None:
        with self._changed:
            self.names.append(json.loads(seen.body)["signal"])
            self._changed.notify_all()
        reply_json(handler, 202, turn_json())

    def wait_for(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self.names) >= count, timeout=10)


def _signalled_run(
    script: Scripted, monkeypatch: pytest.MonkeyPatch, signum: int, counts: tuple[int, ...]
) -> tuple[int, Posted]:
    """Run an endless turn; send ``signum`` each time the target got ``counts[i]`` signals."""
    released = threading.Event()
    streaming = _endless_turn(script, released)
    posted = Posted(script)

    def send() -> None:
        if not streaming.wait(10):
            return
        for count in counts:
            os.kill(os.getpid(), signum)
            posted.wait_for(count)
        os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return run_main(script, monkeypatch, "--", "sleep", "60"), posted
    finally:
        released.set()
        sender.join(10)


def test_run_third_ctrl_c_stops_waiting_and_exits_130(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    status, posted = _signalled_run(scripted, monkeypatch, signal.SIGINT, (1, 2))
    assert status == 128 + signal.SIGINT
    assert posted.names == ["INT", "KILL"]
    assert "paddock: interrupted; the turn may still be running" in capfd.readouterr().err


def test_run_term_kills_the_turn_and_a_second_stops_waiting(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    status, posted = _signalled_run(scripted, monkeypatch, signal.SIGTERM, (1,))
    assert status == 128 + signal.SIGTERM
    assert posted.names == ["KILL"]
    assert f"sent KILL to turn {TURN_ID}" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


def test_run_reads_and_posts_no_more_stdin_once_the_turn_has_ended(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stdin whose writer lives on past the turn is let go when ``paddock run`` returns.

    A helper left blocked on it would post, later, through a client already
    closed: the one request that outlived the pool held its connection open,
    and an embedded target (``--local``) then waited seconds to stop.
    """
    script_turn(
        scripted, frame(STARTED) + frame({**EXIT, "exit_code": 0}), turn_json(state="exited")
    )
    stdin_route = f"/v1/turns/{TURN_ID}/stdin"
    scripted.routes["POST", stdin_route] = lambda h, s: reply_json(h, 202, turn_json())
    read_end, write_end = os.pipe()
    stdin = os.fdopen(read_end, "rb")
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setenv("PADDOCK_TARGET", scripted.url)
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    scripted.routes["GET", "/v1/roles"] = lambda h, s: reply_json(h, 200, {"roles": ["default"]})
    try:
        assert cli.main(["run", "--", "cat"]) == 0
        feeders = [t for t in threading.enumerate() if t.name == "paddock-stdin"]
        assert not feeders, "the stdin helper outlived the run"
        assert scripted.paths("POST", stdin_route) == []
    finally:
        os.close(write_end)
        monkeypatch.undo()
        stdin.close()
