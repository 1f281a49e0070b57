"""Section ``sessions``: a turn inside a session against a turn in a fresh fence, same run.

One target process; every row is timed in interleaved rounds (one run of each
row per round), so the machine's load touches every row alike. The session
rows run in one session opened beforehand (its shell already up); the fresh
rows build, launch and tear down a whole fence each time, as every turn
without a session does. A session's own start and end are a row of their own:
what a session costs once, against what it saves on every turn.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agent_side.client import TargetClient
from bench.common import Samples, TurnFailed, ms, ratio, render_table, turn_end, with_failures
from bench.targets import ROLE, target_process
from shared.wire import Event, ExitEvent, OutputEvent, SessionRequest, TurnRequest

WARMUP = 2
FRESH = "fresh fence: true"
IN_SESSION = "in a session: true"
FRESH_SHELL = "fresh fence: bash -c 'cd /tmp; echo $PWD'"
SESSION_SHELL = "in a session: cd /tmp; echo $PWD"
OPEN_CLOSE = "session start + end (shell up, then down)"
API_FRESH = "Target.run(['true'])"
API_SESSION = "TargetSession.run(['true'])"


@dataclass
class Row:
    """One line: what is timed, its baseline row, and its timings."""

    name: str
    action: Callable[[], object]
    baseline: str | None = None
    note: str = ""
    values: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def attempt(self) -> float | None:
        started = time.perf_counter()
        try:
            self.action()
        except TurnFailed as exc:
            self.failures.append(f"{self.name}: {exc}")
            return None
        return time.perf_counter() - started


def run(runs: int) -> str:
    """Measure every row ``runs`` times, interleaved, and return the section's table."""
    with contextlib.ExitStack() as stack:
        target = stack.enter_context(target_process())
        client = stack.enter_context(target.client())
        client.health()
        session = client.start_session(SessionRequest(role=ROLE))
        if session.state != "open":
            raise RuntimeError(f"the bench's session did not open: {session.refusal}")
        stack.callback(client.end_session, session.session_id)
        api = stack.enter_context(target.https())
        api_session = stack.enter_context(api.session())
        rows = [
            Row(FRESH, _turn(client, TurnRequest(role=ROLE, argv=["true"])), None, "submit+follow"),
            Row(
                IN_SESSION,
                _turn(client, TurnRequest(role=ROLE, argv=["true"], session=session.session_id)),
                FRESH,
                "submit + follow",
            ),
            Row(
                FRESH_SHELL,
                _turn(
                    client,
                    TurnRequest(role=ROLE, argv=["bash", "-c", "cd /tmp; echo $PWD"]),
                ),
                None,
                "a shell of its own",
            ),
            Row(
                SESSION_SHELL,
                _turn(client, _script("cd /tmp; echo $PWD", session.session_id)),
                FRESH_SHELL,
                "the session's shell",
            ),
            Row(API_FRESH, _api(lambda: api.run(["true"])), None, "one request, streamed"),
            Row(API_SESSION, _api(lambda: api_session.run(["true"])), API_FRESH, "the same"),
            Row(OPEN_CLOSE, lambda: _open_close(client), FRESH, "once per session"),
        ]
        _measure(rows, runs)
    failures = [how for row in rows for how in row.failures]
    return with_failures(_table(rows), failures)


def _measure(rows: list[Row], runs: int) -> None:
    for row in rows:
        for _ in range(WARMUP):
            row.attempt()
    for _ in range(runs):
        for row in rows:
            took = row.attempt()
            if took is not None:
                row.values.append(took)


def _turn(client: TargetClient, request: TurnRequest) -> Callable[[], None]:
    def one() -> None:
        turn = client.submit(request)
        events = list(client.follow(turn.turn_id))
        last = events[-1] if events else None
        if not isinstance(last, ExitEvent) or last.exit_code != 0:
            raise TurnFailed(turn_end(turn.turn_id, last, _stderr_of(events)))

    return one


def _script(body: str, session_id: str) -> TurnRequest:
    digest = hashlib.sha256(body.encode()).hexdigest()
    return TurnRequest(role=ROLE, script=body, script_sha256=digest, session=session_id)


def _api(call: Callable[[], object]) -> Callable[[], None]:
    def one() -> None:
        result = call()
        if getattr(result, "exit_code", 1) != 0:
            raise TurnFailed(f"exited {getattr(result, 'exit_code', None)}")

    return one


def _open_close(client: TargetClient) -> None:
    session = client.start_session(SessionRequest(role=ROLE))
    if session.state != "open":
        raise TurnFailed(f"session {session.session_id} {session.state}: {session.refusal}")
    client.end_session(session.session_id)


def _stderr_of(events: list[Event]) -> str:
    return "".join(
        e.data or "" for e in events if isinstance(e, OutputEvent) and e.kind == "stderr"
    )


def _table(rows: list[Row]) -> str:
    p50s = {row.name: Samples(tuple(row.values)).p50 for row in rows if row.values}
    p95s = {row.name: Samples(tuple(row.values)).p95 for row in rows if row.values}
    out = []
    for row in rows:
        if not row.values:
            out.append([row.name, "0", "", "", "", "", row.note])
            continue
        s = Samples(tuple(row.values))
        base = row.baseline
        out.append(
            [
                row.name,
                str(len(s.values)),
                ms(s.p50),
                ms(s.p95),
                ratio(s.p50, p50s.get(base)) if base else "-",
                ratio(s.p95, p95s.get(base)) if base else "-",
                row.note,
            ]
        )
    return render_table(
        "Table 6: a turn inside a session vs a turn in a fresh fence (same target, same run)",
        ["row", "n", "p50", "p95", "p50 vs", "p95 vs", "note"],
        out,
    )
