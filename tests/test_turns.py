"""Turns end to end through a real target: TLS, uvicorn, bubblewrap, real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from conftest import Target, events, finished, output, processes_with, run, submit, wait_until

from target_side.fence.identity import LocalProcess

ADOPTION_DELAY_S = 2.0


def test_turn_streams_stdout_stderr_and_exit_status(client: httpx.Client) -> None:
    turn, evs = run(client, ["sh", "-c", "echo out; echo err >&2; printf 'no newline'; exit 3"])
    assert turn.state == "exited"
    assert turn.exit_code == 3
    assert output(evs) == "out\nno newline"
    assert output(evs, "stderr") == "err\n"
    assert evs[0].kind == "started"
    assert evs[-1].kind == "exit"
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1))


def test_turn_output_that_is_not_utf8_arrives_as_bytes(client: httpx.Client) -> None:
    import base64

    _, evs = run(client, ["printf", "\\377\\376ok"])
    raw = b"".join(
        base64.b64decode(e.data_b64) if e.data_b64 else e.data.encode()
        for e in evs
        if e.kind == "stdout"
    )
    assert raw == b"\xff\xfeok"


def test_turn_over_wall_time_is_killed_with_124(client: httpx.Client) -> None:
    started = time.monotonic()
    turn, evs = run(client, ["sleep", "30"], limits={"wall_s": 1})
    assert turn.exit_code == 124
    assert time.monotonic() - started < 15
    assert any(e.kind == "notice" and "wall-time" in e.message for e in evs)


def test_turn_program_not_on_fence_path_is_127(client: httpx.Client) -> None:
    turn, evs = run(client, ["no-such-program-anywhere"])
    assert turn.state == "refused"
    assert turn.exit_code == 127
    assert turn.refusal is not None and turn.refusal.rule == "not-found"
    assert [e.kind for e in evs] == ["refused"]


def test_turn_non_executable_file_is_126(client: httpx.Client, target: Target) -> None:
    script = target.workspace / "not-exec.sh"
    script.write_text("echo hi\n")
    script.chmod(0o644)
    turn, _ = run(client, [str(script)])
    assert turn.exit_code == 126
    assert turn.refusal is not None and turn.refusal.rule == "not-executable"


def test_turn_killed_by_signal_is_128_plus_n(client: httpx.Client) -> None:
    turn, _ = run(client, ["sh", "-c", "kill -KILL $$"])
    assert turn.exit_code == 137
    assert turn.signal == 9


def test_turn_signal_reaches_the_whole_turn(client: httpx.Client) -> None:
    marker = "317.25"
    turn = submit(client, argv=["sh", "-c", f"sleep {marker} & sleep {marker}; echo never"])
    assert wait_until(lambda: len(processes_with("sleep", marker)) == 2)
    response = client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "TERM"})
    assert response.status_code == 202
    done = finished(client, turn.turn_id)
    assert done.exit_code == 128 + 15
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_turn_leaves_no_background_process_behind(client: httpx.Client) -> None:
    marker = "318.75"
    turn, evs = run(client, ["sh", "-c", f"(sleep {marker} &) ; sleep {marker} & echo started"])
    assert turn.exit_code == 0
    assert output(evs) == "started\n"
    assert wait_until(lambda: not processes_with("sleep", marker))


def test_turn_bwrap_setup_failure_is_126_not_1(client: httpx.Client, target: Target) -> None:
    secret = target.workspace / "token.txt"
    secret.write_text("x")
    # A destination inside the read-only /usr cannot be created: bubblewrap fails before the
    # command, with its own exit status 1.
    turn, _ = run(client, ["true"], secrets=[f"{secret}:/usr/paddock-secret"])
    assert turn.exit_code == 126
    assert turn.state == "refused"
    assert turn.refusal is not None and "bubblewrap" in turn.refusal.detail


def test_turn_command_exit_1_stays_1(client: httpx.Client) -> None:
    turn, _ = run(client, ["false"])
    assert (turn.state, turn.exit_code, turn.refusal) == ("exited", 1, None)


def test_events_resume_after_seq_gives_exactly_the_missing_events(client: httpx.Client) -> None:
    turn, evs = run(client, ["sh", "-c", "for i in 1 2 3 4 5; do echo line$i; done; exit 0"])
    assert len(evs) >= 3
    for cut in range(len(evs)):
        resumed = events(client, turn.turn_id, after=evs[cut].seq)
        assert resumed == evs[cut + 1 :]


def test_events_last_event_id_header_works_like_after(client: httpx.Client) -> None:
    turn, evs = run(client, ["echo", "hello"])
    headers = {"Last-Event-ID": str(evs[0].seq)}
    with client.stream("GET", f"/v1/turns/{turn.turn_id}/events", headers=headers) as r:
        ids = [int(line[4:]) for line in r.iter_lines() if line.startswith("id: ")]
    assert ids == [e.seq for e in evs[1:]]


def test_events_stream_live_output_before_the_turn_ends(client: httpx.Client) -> None:
    turn = submit(client, argv=["sh", "-c", "echo first; sleep 2; echo second"])
    seen: list[tuple[float, str]] = []
    with client.stream("GET", f"/v1/turns/{turn.turn_id}/events") as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                seen.append((time.monotonic(), line[7:]))
    first = next(t for t, kind in seen if kind == "stdout")
    end = next(t for t, kind in seen if kind == "exit")
    assert end - first > 1.0


def test_events_heartbeat_and_wait_bound_silence(client: httpx.Client) -> None:
    turn = submit(client, argv=["sleep", "5"])
    with client.stream(
        "GET", f"/v1/turns/{turn.turn_id}/events", params={"after": 1, "wait": 1.5}
    ) as r:
        lines = list(r.iter_lines())
    assert ": ping" in lines
    assert not any(line.startswith("event: exit") for line in lines)
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    done = finished(client, turn.turn_id)
    assert done.exit_code == 137, done.refusal


def test_stdin_closed_by_default(client: httpx.Client) -> None:
    turn, evs = run(client, ["cat"])
    assert turn.exit_code == 0
    assert output(evs) == ""


def test_script_turn_runs_body_checked_by_digest(client: httpx.Client) -> None:
    import hashlib

    body = "echo from script; echo $((6 * 7))\n"
    digest = hashlib.sha256(body.encode()).hexdigest()
    turn = submit(client, script=body, script_sha256=digest)
    assert output(events(client, turn.turn_id)) == "from script\n42\n"
    bad = submit(client, script=body, script_sha256="0" * 64)
    assert bad.exit_code == 126
    assert bad.refusal is not None and bad.refusal.rule == "digest-mismatch"


def test_concurrent_turns_each_get_their_own_output(client: httpx.Client, target: Target) -> None:
    results: dict[int, str] = {}

    def one(i: int) -> None:
        with target.client() as c:
            _, evs = run(c, ["sh", "-c", f"for k in 1 2 3; do echo {i}-$k; done"])
            results[i] = output(evs)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}-1\n{i}-2\n{i}-3\n" for i in range(8)}


def test_scratch_is_removed_after_the_turn(client: httpx.Client, target: Target) -> None:
    turn, _ = run(client, ["sh", "-c", "echo data > /tmp/left-behind"])
    assert turn.exit_code == 0
    scratch = target.settings.state_root / "scratch" / turn.turn_id
    assert not scratch.exists()
    assert not os.path.exists("/tmp/left-behind")


def test_scratch_is_sized_memory_that_goes_with_the_turn(client: httpx.Client) -> None:
    fill = "head -c 3145728 /dev/zero > /tmp/big; echo $?; du -k /tmp/big; stat -f -c %T /tmp"
    turn, evs = run(client, ["sh", "-c", fill], limits={"scratch_mb": 2})
    status, size, fstype = output(evs).split("\n")[:3]
    assert (turn.exit_code, status, size.split()[0], fstype) == (0, "1", "2048", "tmpfs")
    # The next turn's /tmp is new, and nothing of this one was ever on the target's disk.
    again, evs = run(client, ["sh", "-c", "test -e /tmp/big; echo $?"])
    assert (again.exit_code, output(evs)) == (0, "1\n")


def test_scratch_above_the_roles_maximum_is_refused(client: httpx.Client) -> None:
    turn, _ = run(client, ["true"], limits={"scratch_mb": 1 << 20})
    assert turn.refusal is not None and turn.refusal.rule == "limit-exceeds-role"


def test_turn_signal_works_even_if_the_server_ignores_it(client: httpx.Client) -> None:
    """Ignored signals survive exec: a server started as a background job must not pass that on."""
    import signal

    marker = "319.25"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        turn = submit(client, argv=["sh", "-c", f"sleep {marker}"])
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
    finally:
        signal.signal(signal.SIGINT, previous)
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "INT"})
    done = finished(client, turn.turn_id)
    assert done.exit_code == 128 + signal.SIGINT


def test_turn_signal_posted_before_the_target_has_taken_its_fence_still_arrives(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fence born inside its cgroups runs its command at once, while the event loop may not
    have taken its pid namespace yet (a busy loop: seen once in CI, the turn then ran to its
    wall time). A signal posted then goes to the fence once it is taken, not nowhere."""
    adopt = LocalProcess.adopt

    async def late(self: LocalProcess, *args: Any) -> None:
        await asyncio.sleep(ADOPTION_DELAY_S)
        await adopt(self, *args)

    monkeypatch.setattr(LocalProcess, "adopt", late)
    marker = "319.75"
    asked = time.monotonic()
    turn = submit(client, argv=["sh", "-c", f"sleep {marker}"], limits={"wall_s": 10})
    assert wait_until(lambda: bool(processes_with("sleep", marker)))
    response = client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "INT"})
    assert response.status_code == 202
    assert time.monotonic() - asked < ADOPTION_DELAY_S, "posted too late to show anything"
    assert finished(client, turn.turn_id).exit_code == 128 + signal.SIGINT
