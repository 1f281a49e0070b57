"""Section ``resume``: how long a dropped event stream takes to deliver again.

One producer turn prints a line every ``TICK_S`` for the whole section. Each
row follows it and, once the stream is live, stops reading for ``LAG_S`` (so
an event waits), drops the connection, then times from the drop to the first
event that came over a new connection; or times a fresh ``events(after=N)``
request to its first event, N one behind the newest. Rows run one after
another (not interleaved), so the followed stream has caught up when it is
cut and no old backlog is counted as resume time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import cast

from agent_side.api import Target
from agent_side.client import RetryPolicy, TargetClient
from agent_side.errors import AgentError
from bench.common import Samples, ms, ratio, render_table
from bench.proxy import CuttingProxy, cutting_proxy
from bench.sshd import local_sshd, ssh_missing
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import Event, Limits, TurnRequest

TICK_S = 0.02
PRODUCER = ["sh", "-c", f"while :; do echo tick; sleep {TICK_S:g}; done"]
PRODUCER_WALL_S = 300.0
"""The producer's own limit: it dies on the target even if the bench is killed outright."""
LEAD_EVENTS = 3
"""Events delivered over a connection before it is dropped (the first one is warm-up)."""
LIVE_S = 0.015
"""An event this young is the newest one: the stream has caught up and may be cut."""
MAX_LEAD_EVENTS = 200
"""Cut anyway after this many, should the machine be too loaded for any event to look live."""
LAG_S = 2 * TICK_S
"""The follower stops reading this long before the drop, so an event already waits when it
resumes: the resume is timed, not the producer's next tick."""
FLOOR = "events(after=N), new TLS connection"


@dataclass
class Row:
    name: str
    note: str
    values: list[float] = field(default_factory=list)


@dataclass
class Cursor:
    """The newest seq any row has delivered: where a fresh request resumes from."""

    seq: int = 0


def run(samples: int) -> str:
    """Measure every row ``samples`` times (after one warm-up) and return the section's table."""
    with target_process() as target, _producer(target) as turn_id:
        cursor = Cursor()
        port = int(target.url.rsplit(":", 1)[1])
        with cutting_proxy(port) as proxy:
            rows = [
                _cut_row(
                    "follow(): proxy cuts, default retry",
                    target,
                    proxy,
                    turn_id,
                    cursor,
                    samples,
                    RetryPolicy(),
                    f"waits {RetryPolicy().first_delay_s:g} s, then reconnects",
                ),
                _cut_row(
                    "follow(): proxy cuts, 1 ms first retry",
                    target,
                    proxy,
                    turn_id,
                    cursor,
                    samples,
                    RetryPolicy(first_delay_s=0.001),
                    "reconnect cost alone",
                ),
            ]
        rows.append(_fresh_row(FLOOR, target.client, turn_id, cursor, samples, "TCP + TLS"))
        rows.extend(_ssh_rows(target, turn_id, cursor, samples))
    return _table(rows, samples)


@contextlib.contextmanager
def _producer(target: TargetInfo) -> Iterator[str]:
    """A turn printing ``tick`` every ``TICK_S``; killed (and waited for) on leaving."""
    request = TurnRequest(role=ROLE, argv=PRODUCER, limits=Limits(wall_s=PRODUCER_WALL_S))
    with target.client() as client:
        turn = client.submit(request)
        try:
            yield turn.turn_id
        finally:
            with contextlib.suppress(AgentError):
                client.signal(turn.turn_id, "KILL")
                deadline = time.monotonic() + 10
                while not client.turn(turn.turn_id).finished and time.monotonic() < deadline:
                    time.sleep(0.05)


def _cut_row(
    name: str,
    target: TargetInfo,
    proxy: CuttingProxy,
    turn_id: str,
    cursor: Cursor,
    samples: int,
    retry: RetryPolicy,
    note: str,
) -> Row:
    """``follow()`` through the proxy; each sample: ``proxy.cut()`` to the next event over a
    new connection (events still buffered from the cut one are not it)."""
    client = TargetClient(
        f"https://127.0.0.1:{proxy.port}", target.token, cacert=target.cacert, retry=retry
    )
    with client:
        values = _through_drops(
            client.follow(turn_id, after=cursor.seq),
            proxy.cut,
            lambda: proxy.accepted,
            cursor,
            samples + 1,
        )
    return Row(name, note, values[1:])


def _through_drops(
    events: Iterator[Event],
    drop: Callable[[], None],
    connections: Callable[[], int],
    cursor: Cursor,
    count: int,
) -> list[float]:
    """Seconds from each ``drop()`` to the first event delivered after ``connections()`` grew."""
    values: list[float] = []
    lead = 0
    dropped_at: float | None = None
    before = 0
    try:
        for event in events:
            cursor.seq = max(cursor.seq, event.seq)
            if dropped_at is not None:
                if connections() > before:
                    values.append(time.perf_counter() - dropped_at)
                    dropped_at, lead = None, 0
                    if len(values) >= count:
                        break
                continue
            lead += 1
            if lead >= LEAD_EVENTS and (_live(event) or lead >= MAX_LEAD_EVENTS):
                time.sleep(LAG_S)
                before = connections()
                drop()
                dropped_at = time.perf_counter()
    finally:
        close = getattr(events, "close", None)  # a generator: closing it closes its stream
        if close is not None:
            close()
    if len(values) < count:
        raise RuntimeError(f"the followed turn ended after {len(values)} of {count} resumes")
    return values


def _live(event: Event) -> bool:
    return (datetime.now(UTC) - event.at).total_seconds() < LIVE_S


def _fresh_row(
    name: str,
    open_client: Callable[[], contextlib.AbstractContextManager[TargetClient]],
    turn_id: str,
    cursor: Cursor,
    samples: int,
    note: str,
) -> Row:
    """A new client each time (made before the clock starts), ``events(after=N)`` to its first
    event; N is the newest seq seen, so the first event is the next tick."""
    values = []
    for _ in range(samples + 1):
        with open_client() as client:
            values.append(_first_event(client, turn_id, cursor))
    return Row(name, note, values[1:])


def _first_event(client: TargetClient, turn_id: str, cursor: Cursor) -> float:
    # One tick back: an event is already spooled, so no tick interval is timed.
    after = max(cursor.seq - 1, 0)
    started = time.perf_counter()
    # A generator, so it can be closed early.
    events = cast(Generator[Event, None, None], client.events(turn_id, after=after))
    try:
        event = next(events)
    finally:
        events.close()  # an unfinished stream costs its connection: the next one is new
    took = time.perf_counter() - started
    cursor.seq = max(cursor.seq, event.seq)
    return took


def _ssh_rows(target: TargetInfo, turn_id: str, cursor: Cursor, samples: int) -> list[Row]:
    """Through ``Target.ssh`` (HTTPS inside the channel): a killed SSH connection, a new channel."""
    missing = ssh_missing()
    if missing is not None:
        return [Row(f"ssh: skipped ({missing})", "")]
    with local_sshd() as ssh:
        with target.tunnel(ssh) as tunnel:
            connection = tunnel.ssh_connection
            if connection is None:
                raise RuntimeError("Target.ssh has no SSH connection")
            values = _through_drops(
                tunnel.client.follow(turn_id, after=cursor.seq),
                connection.drop,
                lambda: connection.connects,
                cursor,
                samples + 1,
            )
        dropped = Row(
            "Target.ssh follow(): SSH connection dropped",
            "new SSH handshake + auth + TLS",
            values[1:],
        )
        with target.tunnel(ssh) as tunnel:
            channel = _fresh_row(
                "events(after=N) via Target.ssh, new channel",
                _reusing(tunnel),
                turn_id,
                cursor,
                samples,
                "kept SSH connection, TLS inside",
            )
    return [dropped, channel]


def _reusing(tunnel: Target) -> Callable[[], contextlib.AbstractContextManager[TargetClient]]:
    """The tunnel's one client, lent out per sample and not closed after it."""
    return lambda: contextlib.nullcontext(tunnel.client)


def _table(rows: list[Row], samples: int) -> str:
    floor = next((Samples(tuple(r.values)).p50 for r in rows if r.name == FLOOR and r.values), None)
    out = []
    for row in rows:
        if not row.values:
            out.append([row.name, "", "", "", "", "", row.note])
            continue
        s = Samples(tuple(row.values))
        out.append(
            [
                row.name,
                str(len(s.values)),
                ms(s.p50),
                ms(s.p95),
                ms(s.mean),
                ratio(s.p50, floor),
                row.note,
            ]
        )
    title = (
        f"4. Resume latency (ms; a turn printing a line every {TICK_S * 1000:g} ms; {samples} "
        "samples per row\n   after one warm-up; drop rows: from the drop to the first event "
        "over a new\n   connection, an event already waiting; 'x fresh' = row p50 / p50 of "
        "the new TLS\n   connection row)"
    )
    return render_table(title, ["row", "n", "p50", "p95", "mean", "x fresh", "note"], out)
