"""Sessions over real bubblewrap and a real TLS target: one fence and one shell, many turns."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import (
    OTHER_TOKEN,
    Target,
    events,
    finished,
    make_settings,
    output,
    running_target,
    submit,
    wait_until,
)
from fastapi import FastAPI
from process_support import parent_pid
from test_durability import served

from shared.walk import canonical_path
from shared.wire import Session, Turn
from target_side.config import RoleLimits
from target_side.service import session_store
from target_side.service.app import create_app
from target_side.service.server import ServerThread


def start(client: httpx.Client, **request: object) -> Session:
    request.setdefault("role", "builder")
    response = client.post("/v1/sessions", json=request)
    assert response.status_code == 201, response.text
    return Session.model_validate(response.json())


def end(client: httpx.Client, session: Session) -> Session:
    response = client.delete(f"/v1/sessions/{session.session_id}")
    assert response.status_code == 200, response.text
    return Session.model_validate(response.json())


def in_session(
    client: httpx.Client, session: Session, command: str, **request: object
) -> tuple[Turn, list]:
    turn = submit(client, argv=["bash", "-c", command], session=session.session_id, **request)
    evs = events(client, turn.turn_id)
    return finished(client, turn.turn_id), evs


def script(
    client: httpx.Client, session: Session, body: str, **request: object
) -> tuple[Turn, list]:
    digest = hashlib.sha256(body.encode()).hexdigest()
    turn = submit(client, script=body, script_sha256=digest, session=session.session_id, **request)
    evs = events(client, turn.turn_id)
    return finished(client, turn.turn_id), evs


@pytest.fixture
def session(client: httpx.Client) -> Iterator[Session]:
    opened = start(client)
    assert opened.state == "open", opened.refusal and opened.refusal.detail
    yield opened
    client.delete(f"/v1/sessions/{opened.session_id}")


def _ancestors(pid: int) -> list[int]:
    """The processes above ``pid``, nearest first, short of the host's first."""
    found = []
    while (pid := parent_pid(pid)) > 1:
        found.append(pid)
    return found


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (and are not zombies)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z" and int(entry) != os.getpid():
            found.append(int(entry))
    return found


# --- state that lasts between turns --------------------------------------------------------------


def test_session_keeps_cwd_variables_functions_between_turns(
    client: httpx.Client, session: Session, target: Target
) -> None:
    sub = target.workspace / "session-cwd"
    sub.mkdir(exist_ok=True)
    os.chown(sub, *target.settings.role_ids("builder"))
    first, _ = script(
        client, session, f'cd {sub}\nexport GREETING=hello\nshout() {{ echo "$1!"; }}\n'
    )
    assert first.exit_code == 0
    second, evs = script(client, session, 'pwd; echo "$GREETING"; shout hey')
    assert second.exit_code == 0
    assert output(evs) == f"{sub}\nhello\nhey!\n"
    assert second.session_id == session.session_id
    assert first.turn_id != second.turn_id


def test_session_keeps_a_background_process(client: httpx.Client, session: Session) -> None:
    started, evs = script(client, session, "sleep 1000 & echo $! > /tmp/bg.pid; echo started")
    assert started.exit_code == 0, evs
    alive, evs = script(client, session, 'kill -0 "$(cat /tmp/bg.pid)" && jobs')
    assert alive.exit_code == 0, evs
    assert "sleep 1000" in output(evs)


def test_session_turn_keeps_stdout_stderr_and_status_apart(
    client: httpx.Client, session: Session
) -> None:
    turn, evs = script(
        client, session, "echo out; echo err >&2; exit_code() { return 3; }; exit_code"
    )
    assert turn.state == "exited"
    assert turn.exit_code == 3
    assert output(evs) == "out\n"
    assert output(evs, "stderr") == "err\n"
    kinds = [e.kind for e in evs]
    assert kinds[0] == "started" and kinds[-1] == "exit"


def test_session_argv_turn_runs_quoted_as_one_command(
    client: httpx.Client, session: Session
) -> None:
    turn = submit(client, argv=["printf", "%s|", "a b", "$HOME", "'q'"], session=session.session_id)
    evs = events(client, turn.turn_id)
    assert output(evs) == "a b|$HOME|'q'|"


def test_session_turn_reads_its_stdin(client: httpx.Client, session: Session) -> None:
    turn = submit(client, argv=["cat"], session=session.session_id, stdin="open")
    response = client.post(
        f"/v1/turns/{turn.turn_id}/stdin", content=b"fed in\n", params={"eof": 1}
    )
    assert response.status_code == 202, response.text
    evs = events(client, turn.turn_id)
    assert output(evs) == "fed in\n"
    assert finished(client, turn.turn_id).exit_code == 0


def test_session_turn_without_stdin_reads_nothing(client: httpx.Client, session: Session) -> None:
    turn, evs = script(client, session, "cat; echo done")
    assert output(evs) == "done\n"
    response = client.post(f"/v1/turns/{turn.turn_id}/stdin", content=b"x")
    assert response.status_code == 409


def test_session_sets_its_ids_in_the_environment(client: httpx.Client, session: Session) -> None:
    turn, evs = script(client, session, 'echo "$PADDOCK_SESSION_ID $PADDOCK_TURN_ID"')
    assert output(evs) == f"{session.session_id} {turn.turn_id}\n"


# --- limits, signals, one at a time --------------------------------------------------------------


def test_session_timed_out_turn_leaves_the_session_usable(
    client: httpx.Client, session: Session
) -> None:
    script(client, session, "export KEPT=yes")
    slow, evs = script(client, session, "sleep 100; echo not-reached", limits={"wall_s": 1})
    assert slow.exit_code == 124
    assert "not-reached" not in output(evs)
    assert any(e.kind == "notice" and "wall-time" in e.message for e in evs)
    after, evs = script(client, session, 'echo "$KEPT"')
    assert after.exit_code == 0
    assert output(evs) == "yes\n"


def test_session_timed_out_builtin_loop_leaves_the_session_usable(
    client: httpx.Client, session: Session
) -> None:
    looping, _ = script(client, session, "while :; do :; done", limits={"wall_s": 1})
    assert looping.exit_code == 124
    _after, evs = script(client, session, "echo alive")
    assert output(evs) == "alive\n"


def test_session_shell_that_ignores_int_is_ended_and_says_so(client: httpx.Client) -> None:
    opened = start(client)
    stuck, _evs = script(client, opened, "trap '' INT; while :; do :; done", limits={"wall_s": 1})
    assert stuck.exit_code == 124
    assert wait_until(
        lambda: client.get(f"/v1/sessions/{opened.session_id}").json()["state"] == "closed"
    )
    closed = Session.model_validate(client.get(f"/v1/sessions/{opened.session_id}").json())
    assert closed.ended is not None and "did not come back" in closed.ended


def test_session_runs_one_turn_at_a_time(client: httpx.Client, session: Session) -> None:
    first = submit(client, argv=["sleep", "30"], session=session.session_id)
    response = client.post(
        "/v1/turns", json={"role": "builder", "argv": ["true"], "session": session.session_id}
    )
    assert response.status_code == 409, response.text
    problem = response.json()
    assert problem["title"] == "Session busy"
    assert problem["turn_id"] == first.turn_id
    assert first.turn_id in problem["detail"]
    assert (
        client.post(f"/v1/turns/{first.turn_id}/signal", json={"signal": "KILL"}).status_code == 202
    )
    assert finished(client, first.turn_id).exit_code == 137
    _again, evs = script(client, session, "echo next")
    assert output(evs) == "next\n"


def test_session_turn_retried_with_its_key_is_the_same_turn(
    client: httpx.Client, session: Session
) -> None:
    body = {"role": "builder", "argv": ["sleep", "2"], "session": session.session_id}
    headers = {"Idempotency-Key": "session-retry-1"}
    first = client.post("/v1/turns", json=body, headers=headers)
    again = client.post("/v1/turns", json=body, headers=headers)
    assert first.status_code == again.status_code == 201
    assert first.json()["turn_id"] == again.json()["turn_id"]


def test_session_interrupt_reaches_the_command_not_the_shell(
    client: httpx.Client, session: Session
) -> None:
    script(client, session, "export STILL=here")
    turn = submit(client, argv=["sleep", "30"], session=session.session_id)
    wait_until(lambda: bool(host_processes_with("sleep\x0030")), timeout=10)
    assert (
        client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "INT"}).status_code == 202
    )
    ended = finished(client, turn.turn_id)
    assert ended.exit_code == 130
    assert ended.signal == 2
    _after, evs = script(client, session, 'echo "$STILL"')
    assert output(evs) == "here\n"


def test_session_turn_output_limit_truncates_and_kills_the_command(
    client: httpx.Client, session: Session
) -> None:
    turn, evs = script(
        client, session, "head -c 3000000 /dev/zero | tr '\\0' x; sleep 30", limits={"output_mb": 1}
    )
    assert turn.output_truncated
    assert len(output(evs)) <= 1 << 20
    assert turn.exit_code != 0


def test_session_turn_cannot_ask_for_more_than_its_session(client: httpx.Client) -> None:
    opened = start(client, limits={"wall_s": 5})
    try:
        turn, _evs = script(client, opened, "true", limits={"wall_s": 50})
        assert turn.state == "refused"
        assert turn.refusal is not None and turn.refusal.rule == "limit-exceeds-role"
        assert turn.refusal.subject == "limits.wall_s"
    finally:
        end(client, opened)


def test_session_script_turn_digest_is_checked(client: httpx.Client, session: Session) -> None:
    turn = submit(client, script="echo hi", script_sha256="0" * 64, session=session.session_id)
    ended = finished(client, turn.turn_id)
    assert ended.state == "refused"
    assert ended.refusal is not None and ended.refusal.rule == "digest-mismatch"


# --- no widening per turn ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cwd", "/tmp"),
        ("env", {"A": "1"}),
        ("fs", {"read": ["/etc"]}),
        ("secrets", ["/etc/hostname"]),
        ("network", "host"),
        ("limits", {"memory_mb": 10}),
        ("limits", {"pids": 10}),
    ],
)
def test_session_turn_may_not_set_fence_fields(
    client: httpx.Client, session: Session, field: str, value: object
) -> None:
    body = {"role": "builder", "argv": ["true"], "session": session.session_id, field: value}
    response = client.post("/v1/turns", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert field in detail
    assert "session's fence" in detail


def test_session_turn_of_unknown_or_other_roles_session_is_404(
    client: httpx.Client, session: Session, target: Target
) -> None:
    body = {"role": "builder", "argv": ["true"], "session": "s-" + "0" * 32}
    assert client.post("/v1/turns", json=body).status_code == 404
    with target.client(OTHER_TOKEN) as other:
        theirs = {"role": "other", "argv": ["true"], "session": session.session_id}
        response = other.post("/v1/turns", json=theirs)
        assert response.status_code == 404, response.text
        assert other.get(f"/v1/sessions/{session.session_id}").status_code == 404
        assert other.delete(f"/v1/sessions/{session.session_id}").status_code == 404


def test_session_refused_as_a_turn_would_be(client: httpx.Client, target: Target) -> None:
    refused = start(client, cwd="/etc")
    assert refused.state == "refused"
    assert refused.refusal is not None
    turn = submit(client, argv=["true"], cwd="/etc")
    assert finished(client, turn.turn_id).refusal == refused.refusal
    response = client.post(
        "/v1/turns", json={"role": "builder", "argv": ["true"], "session": refused.session_id}
    )
    assert response.status_code == 409
    assert response.json()["title"] == "Session has ended"


def test_session_without_python3_in_the_fence_is_refused_saying_so(
    tmp_path: Path, ca: trustme.CA
) -> None:
    from conftest import make_settings

    from target_side.config import FenceConfig

    settings = make_settings(tmp_path / "no-python", ca)
    bin_dir = tmp_path / "fence-bin"
    bin_dir.mkdir()
    bin_dir.chmod(0o755)
    for program in ("bash", "true"):
        (bin_dir / program).write_bytes(Path(f"/usr/bin/{program}").read_bytes())
        (bin_dir / program).chmod(0o755)
    settings = settings.model_copy(update={"fence": FenceConfig(path=str(bin_dir))})
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with ServerThread(settings) as server:
        target = Target(
            server.url, str(ca_file), settings, Path(settings.roles["builder"].workspaces[0])
        )
        with target.client() as c:
            refused = start(c)
            assert finished(c, submit(c, argv=["true"]).turn_id).exit_code == 0
    assert refused.state == "refused"
    assert refused.refusal is not None
    assert refused.refusal.rule == "backend-unavailable"
    assert refused.refusal.subject == "session"
    assert "python3" in refused.refusal.detail


def test_session_network_not_allowed_like_a_turn(client: httpx.Client) -> None:
    refused = start(client, network="host")
    assert refused.state == "refused"
    assert refused.refusal is not None and refused.refusal.rule == "network-not-allowed"


# --- who it runs as, and what it may touch -------------------------------------------------------


def test_session_shell_runs_as_the_roles_uid(
    client: httpx.Client, session: Session, target: Target
) -> None:
    uid, gid = target.settings.role_ids("builder")
    _, evs = script(client, session, "id -u; id -g; cat /proc/self/status | grep CapEff")
    lines = output(evs).splitlines()
    assert lines[:2] == [str(uid), str(gid)]
    assert lines[2].split()[1] == "0000000000000000"


def test_session_shell_processes_are_the_roles_on_the_host(
    client: httpx.Client, session: Session, target: Target
) -> None:
    uid, _ = target.settings.role_ids("builder")
    # The whole argument, ended: another test's "sleep 313.5" (another uid) must not match.
    turn = submit(client, argv=["sleep", "31.7"], session=session.session_id)
    assert wait_until(lambda: bool(host_processes_with("sleep\x0031.7\x00")))
    sleeps = host_processes_with("sleep\x0031.7\x00")
    for pid in sleeps:
        assert os.stat(f"/proc/{pid}").st_uid == uid
    # This session's host is above its shell's sleep: other tests' sessions run meanwhile.
    hosts = set(host_processes_with("session-host.py"))
    host = [pid for pid in _ancestors(sleeps[0]) if pid in hosts]
    assert host, "the session host runs on the host as a process"
    assert all(os.stat(f"/proc/{pid}").st_uid == uid for pid in host)
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    finished(client, turn.turn_id)


FORK_UNTIL_REFUSED = """
import os, sys, time
made = 0
while made < int(sys.argv[1]):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    made += 1
print(made)
"""


def test_session_cgroup_bounds_all_its_turns_together(client: httpx.Client) -> None:
    opened = start(client, limits={"pids": 40})
    try:
        first = submit(
            client, argv=["python3", "-c", FORK_UNTIL_REFUSED, "25"], session=opened.session_id
        )
        assert output(events(client, first.turn_id)) == "25\n"
        # The first turn's 25 processes still count: the second turn gets what is left.
        second = submit(
            client, argv=["python3", "-c", FORK_UNTIL_REFUSED, "40"], session=opened.session_id
        )
        made = int(output(events(client, second.turn_id)))
        assert 0 < made < 40 - 25
    finally:
        end(client, opened)


def test_session_cannot_write_outside_its_fence(client: httpx.Client, session: Session) -> None:
    _turn, evs = script(client, session, "touch /etc/x 2>&1; touch /usr/x 2>&1; echo $?")
    assert output(evs).strip().endswith("1")


def test_session_audits_protected_names_after_each_turn(
    client: httpx.Client, session: Session, target: Target
) -> None:
    repo = target.workspace / "session-repo"
    repo.mkdir(exist_ok=True)
    (repo / ".git").mkdir(exist_ok=True)
    (repo / ".git" / "hooks").mkdir(exist_ok=True)
    os.chown(repo, *target.settings.role_ids("builder"))
    restarted = start(client, cwd=str(target.workspace))
    try:
        _turn, evs = script(client, restarted, f"echo planted > {target.workspace}/.envrc")
        notices = [e.message for e in evs if e.kind == "notice"]
        assert any(".envrc" in n and "quarantined" in n for n in notices), evs
        assert not (target.workspace / ".envrc").exists()
    finally:
        end(client, restarted)
        for leftover in target.workspace.glob(".envrc*"):
            leftover.unlink()


def test_session_audits_protected_names_when_it_ends(client: httpx.Client, target: Target) -> None:
    opened = start(client, cwd=str(target.workspace))
    # A background process plants it after the turn's own audit has run.
    script(client, opened, f"(sleep 1; echo late > {target.workspace}/.envrc) &")
    time.sleep(2)
    ended = end(client, opened)
    assert ended.state == "closed"
    assert not (target.workspace / ".envrc").exists()
    quarantined = list(target.workspace.glob(".envrc.paddock-quarantined-*"))
    assert quarantined
    for leftover in quarantined:
        leftover.unlink()


# --- the end of a session ------------------------------------------------------------------------


def ancestors(pid: int) -> list[int]:
    """``pid``'s parents up to (not including) this process, which serves the target."""
    chain = []
    while pid not in (0, 1, os.getpid()):
        chain.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError):
            break
    return chain


def test_session_end_leaves_nothing_running(client: httpx.Client) -> None:
    opened = start(client)
    marker = f"9{int(time.time() * 1000) % 100000}"
    script(client, opened, f"sleep {marker} & sleep {marker} & disown; echo ok")
    assert wait_until(lambda: len(host_processes_with(f"sleep\x00{marker}")) == 2)
    # Everything from the sleeps up to bubblewrap: the shell, the host, the fence's init.
    everything = {p for pid in host_processes_with(f"sleep\x00{marker}") for p in ancestors(pid)}
    assert len(everything) >= 5
    ended = end(client, opened)
    assert ended.state == "closed"
    assert ended.ended is not None and "on request" in ended.ended
    assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in everything))
    response = client.post(
        "/v1/turns", json={"role": "builder", "argv": ["true"], "session": opened.session_id}
    )
    assert response.status_code == 409


def test_session_end_kills_a_running_turn(client: httpx.Client) -> None:
    opened = start(client)
    turn = submit(client, argv=["sleep", "60"], session=opened.session_id)
    end(client, opened)
    ended = finished(client, turn.turn_id)
    assert ended.exit_code == 137
    evs = events(client, turn.turn_id)
    assert any(e.kind == "notice" and "ended on request" in e.message for e in evs)


def test_session_exit_ends_the_session(client: httpx.Client) -> None:
    opened = start(client)
    turn, _ = script(client, opened, "exit 7")
    assert turn.exit_code == 7
    assert wait_until(
        lambda: client.get(f"/v1/sessions/{opened.session_id}").json()["state"] == "closed"
    )
    closed = Session.model_validate(client.get(f"/v1/sessions/{opened.session_id}").json())
    assert closed.exit_code == 7
    assert closed.ended is not None and "status 7" in closed.ended


def test_session_lists_and_counts_its_turns(client: httpx.Client, session: Session) -> None:
    script(client, session, "true")
    script(client, session, "true")
    listed = client.get("/v1/sessions").json()
    mine = next(s for s in listed if s["session_id"] == session.session_id)
    assert mine["turns"] == 2
    assert mine["state"] == "open"
    assert mine["limits"]["session_idle_s"] > 0
    assert client.get("/v1/turns").status_code == 200  # the ledger's session records are skipped


def test_session_and_its_turns_are_in_the_ledger_without_env_values(
    client: httpx.Client, target: Target
) -> None:
    from target_side.service.ledger import Ledger

    opened = start(client, env={"SESSION_SECRET": "hunter2-in-session"})
    turn, _ = script(client, opened, 'echo "$SESSION_SECRET" > /dev/null')
    end(client, opened)
    records = list(Ledger(target.settings.state_root).records())
    mine = [r for r in records if r.get("session", {}).get("session_id") == opened.session_id]
    assert [r["kind"] for r in mine] == ["session-start", "session-end"]
    assert "SESSION_SECRET" in mine[0]["env_names"]
    launch = [r for r in records if r["kind"] == "launch" and r["turn"]["turn_id"] == turn.turn_id]
    assert launch[0]["session_id"] == opened.session_id
    assert launch[0]["turn"]["session_id"] == opened.session_id
    assert "hunter2-in-session" not in (target.settings.state_root / "ledger.jsonl").read_text()


# --- limits of a session's life, and a restart ---------------------------------------------------


@pytest.fixture
def short_lived(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("short-sessions")
    limits = RoleLimits(wall_s=60, session_s=30, session_idle_s=2)
    yield from running_target(root, ca, limits=limits)


def test_session_idle_limit_ends_it(short_lived: Target) -> None:
    with short_lived.client() as c:
        opened = start(c)
        script(c, opened, "true")
        assert wait_until(
            lambda: c.get(f"/v1/sessions/{opened.session_id}").json()["state"] == "closed",
            timeout=15,
        )
        closed = Session.model_validate(c.get(f"/v1/sessions/{opened.session_id}").json())
        assert closed.ended is not None and "idle" in closed.ended


def test_session_idle_limit_waits_for_a_running_turn(short_lived: Target) -> None:
    with short_lived.client() as c:
        opened = start(c)
        turn, _ = script(c, opened, "sleep 3; echo done")
        assert turn.exit_code == 0


def test_session_time_limit_ends_it(short_lived: Target) -> None:
    with short_lived.client() as c:
        opened = start(c, limits={"session_s": 2})
        assert opened.state == "open", opened.refusal
        turn = submit(c, argv=["sleep", "20"], session=opened.session_id)
        ended = finished(c, turn.turn_id)
        assert ended.exit_code == 124
        closed = Session.model_validate(c.get(f"/v1/sessions/{opened.session_id}").json())
        assert closed.state == "closed"
        assert closed.ended is not None and "session_s" in closed.ended


def test_session_limits_above_the_roles_are_refused(short_lived: Target) -> None:
    with short_lived.client() as c:
        refused = start(c, limits={"session_idle_s": 100})
        assert refused.state == "refused"
        assert refused.refusal is not None
        assert refused.refusal.subject == "limits.session_idle_s"


def test_session_open_when_the_target_stops_is_closed(tmp_path: Path, ca: trustme.CA) -> None:
    targets = running_target(tmp_path / "stopping", ca)
    first = next(targets)
    with first.client() as c:
        opened = start(c)
        turn = submit(c, argv=["sleep", "60"], session=opened.session_id)
    with pytest.raises(StopIteration):
        next(targets)  # a graceful stop: the session is ended and recorded, not lost
    with ServerThread(first.settings) as server:
        again = Target(server.url, first.cacert, first.settings, first.workspace)
        with again.client() as c:
            closed = Session.model_validate(c.get(f"/v1/sessions/{opened.session_id}").json())
            assert c.get(f"/v1/turns/{turn.turn_id}").json()["state"] == "exited"
    assert closed.state == "closed"
    assert closed.ended is not None and "target stopped" in closed.ended


def test_session_open_when_the_target_is_killed_is_lost(tmp_path: Path) -> None:
    from process_support import TargetProcess, write_config

    config, url = write_config(tmp_path)
    marker = "4444.25"
    server = TargetProcess.start(config, url, tmp_path / "target.log")
    try:
        with server.client() as c:
            opened = Session.model_validate(c.post("/v1/sessions", json={"role": "builder"}).json())
            assert opened.state == "open"
            turn_body = {"role": "builder", "argv": ["sleep", marker], "session": opened.session_id}
            key = {"Idempotency-Key": "asked-before-the-crash"}
            turn = c.post("/v1/turns", json=turn_body, headers=key).json()
            assert wait_until(lambda: bool(host_processes_with(f"sleep\x00{marker}")))
            server.proc.kill()  # no stop, no record of the end: a crash
            server.proc.wait()
            # The fence dies with its server, and everything in it with the fence.
            assert wait_until(lambda: not host_processes_with(f"sleep\x00{marker}"))
    finally:
        server.kill()
    server = TargetProcess.start(config, url, tmp_path / "target.log")
    try:
        with server.client() as c:
            lost = Session.model_validate(c.get(f"/v1/sessions/{opened.session_id}").json())
            again = c.get(f"/v1/turns/{turn['turn_id']}").json()
            # Its launch line kept the key: a retry finds the turn, not a dead session.
            retried = c.post("/v1/turns", json=turn_body, headers=key)
            refused = c.post(
                "/v1/turns",
                json={"role": "builder", "argv": ["true"], "session": opened.session_id},
            )
    finally:
        server.terminate()
    assert lost.state == "lost"
    assert lost.ended is not None and "restarted" in lost.ended
    assert again["state"] == "lost"
    assert (retried.status_code, retried.json()["turn_id"]) == (201, turn["turn_id"])
    assert refused.status_code == 409


# --- caps ----------------------------------------------------------------------------------------


def test_open_sessions_count_against_the_roles_turn_cap(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA
) -> None:
    root = tmp_path_factory.mktemp("session-caps")
    for t in running_target(root, ca, limits=RoleLimits(wall_s=60, turns=1)):
        with t.client() as c:
            opened = start(c)
            response = c.post("/v1/sessions", json={"role": "builder"})
            assert response.status_code == 429
            # Its own turns run: the session already holds the fence they run in.
            _turn, evs = script(c, opened, "echo inside")
            assert output(evs) == "inside\n"
            end(c, opened)
            again = start(c)
            assert again.state == "open"
            end(c, again)


def test_concurrent_turns_race_for_one_session(target: Target, session: Session) -> None:
    statuses: list[int] = []

    def post() -> None:
        with target.client() as c:
            body = {"role": "builder", "argv": ["sleep", "2"], "session": session.session_id}
            statuses.append(c.post("/v1/turns", json=body).status_code)

    threads = [threading.Thread(target=post) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [201, 409, 409, 409]


def test_a_sessions_record_on_disk_is_its_last_state(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writes of one session's record land in the order they were made.

    The write after a turn (the session still open) is held on its thread while
    the session ends; the end's write must not be overtaken by it, or a restart
    finds a session that ended cleanly ``open``, and calls it lost.
    """
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    write = session_store.write_atomic
    held, release = threading.Event(), threading.Event()

    def first_write_held(path: Path, data: bytes) -> None:
        if not held.is_set():
            held.set()
            release.wait(10)
        write(path, data)

    async def scenario(app: FastAPI) -> str:
        async with served(app) as c:
            opened = (await c.post("/v1/sessions", json={"role": "builder"})).json()
            sid = opened["session_id"]
            monkeypatch.setattr(session_store, "write_atomic", first_write_held)
            request = {"role": "builder", "argv": ["true"], "session": sid}
            turn = (await c.post("/v1/turns", json=request)).json()
            await c.get(f"/v1/turns/{turn['turn_id']}/events")
            assert await asyncio.to_thread(held.wait, 10)  # the write after the turn, held
            ending = asyncio.ensure_future(c.delete(f"/v1/sessions/{sid}"))
            await asyncio.wait([ending], timeout=1.0)
            release.set()
            await ending
            return sid

    sid = asyncio.run(scenario(create_app(settings)))
    monkeypatch.setattr(session_store, "write_atomic", write)

    async def after_restart(app: FastAPI) -> dict[str, object]:
        async with served(app) as c:
            return (await c.get(f"/v1/sessions/{sid}")).json()

    again = asyncio.run(after_restart(create_app(settings)))
    assert again["state"] == "closed", again
