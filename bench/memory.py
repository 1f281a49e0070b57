"""Section ``memory``: the target process's RSS idle, with concurrent turns, and after."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace

from bench.common import (
    STDERR_SHOWN,
    kib_field,
    proc_status,
    render_table,
    turn_end,
    with_failures,
)
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import Event, ExitEvent, OutputEvent, TurnRequest

LEVELS = (1, 20, 50, 200)
SETTLE_S = 0.5
SUBMIT_TIMEOUT_S = 60.0
SUBMIT_ALLOWANCE_S = 0.1
"""Turns of a level sleep at least this long per turn of the level: on 2 cores, 200
submissions take about 11 s, and every turn must still be running when sampled."""


@dataclass(frozen=True)
class Sample:
    label: str
    running: int
    rss_kib: int
    hwm_kib: int
    threads: int
    fds: int
    submit_s: float | None = None
    per_turn_kib: float | None = None
    failed: int = 0


@dataclass
class _Tracker:
    """What the client threads of one level report back."""

    expected: int
    submitted: int = 0
    exited: int = 0
    failed: list[str] = field(default_factory=list)
    """How each turn that ended otherwise than exit 0 ended: a finding, not a bench error."""
    errors: list[BaseException] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def note(self, attr: str) -> None:
        with self.changed:
            setattr(self, attr, getattr(self, attr) + 1)
            self.changed.notify_all()

    def turn_failed(self, how: str) -> None:
        with self.changed:
            self.failed.append(how)
            self.changed.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.changed:
            self.errors.append(exc)
            self.changed.notify_all()

    def wait_submitted(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait_for(
                lambda: self.submitted + len(self.errors) >= self.expected, timeout
            )
        if self.errors:
            raise RuntimeError(f"a turn failed: {self.errors[0]!r}") from self.errors[0]
        if self.submitted < self.expected:
            raise RuntimeError(f"only {self.submitted} of {self.expected} turns were submitted")


def run(sleep_s: float, sequential: int) -> str:
    """Start a target process, load it level by level, and return the section's table.

    Then ``sequential`` ``true`` turns twice over: first each event stream read
    to its end, then followed with ``follow()``, which stops at the exit event.
    """
    failures: list[str] = []
    with target_process() as target:
        idle = _sample("idle (started, no turn yet)", target.pid, 0)
        samples = [idle]
        for level in LEVELS:
            level_s = max(sleep_s, level * SUBMIT_ALLOWANCE_S)
            loaded = _level(target, level, level_s, failures)
            growth = loaded.rss_kib - idle.rss_kib
            samples.append(replace(loaded, per_turn_kib=growth / max(loaded.running, 1)))
            samples.append(_sample(f"  after those {level} ended", target.pid, 0))
        time.sleep(1.0)
        samples.append(_sample("after all turns ended (+1 s)", target.pid, 0))
        for label, drain in (("events() read to end", True), ("follow() to exit event", False)):
            before = samples[-1].rss_kib
            _sequential(target, sequential, drain)
            after = _sample(f"+{sequential} `true` turns, {label}", target.pid, 0)
            samples.append(replace(after, per_turn_kib=(after.rss_kib - before) / sequential))
    return _table(samples, sleep_s, failures)


def _sequential(target: TargetInfo, count: int, drain: bool) -> None:
    """``count`` turns one after another on one client, each stream drained or followed."""
    request = TurnRequest(role=ROLE, argv=["true"])
    with target.client() as client:
        for _ in range(count):
            turn = client.submit(request)
            events = client.events(turn.turn_id) if drain else client.follow(turn.turn_id)
            last = None
            for event in events:
                last = event
            if not isinstance(last, ExitEvent) or last.exit_code != 0:
                raise RuntimeError(f"turn {turn.turn_id} ended with {last}")


def _level(target: TargetInfo, count: int, sleep_s: float, failures: list[str]) -> Sample:
    """``count`` turns at once; a turn that does not exit 0 is counted and its end kept in
    ``failures`` (the target's finding, printed under the table), not raised."""
    tracker = _Tracker(count)
    request = TurnRequest(role=ROLE, argv=["sleep", f"{sleep_s:g}"])
    threads = [
        threading.Thread(target=_one_turn, args=(target, request, tracker), daemon=True)
        for _ in range(count)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    tracker.wait_submitted(SUBMIT_TIMEOUT_S)
    submit_s = time.perf_counter() - started
    time.sleep(SETTLE_S)
    with tracker.changed:
        running = tracker.submitted - tracker.exited - len(tracker.failed)
    sample = _sample(f"{count} concurrent `sleep {sleep_s:g}` turns", target.pid, running)
    for thread in threads:
        thread.join(sleep_s + SUBMIT_TIMEOUT_S)
    if tracker.errors:
        raise RuntimeError(f"a turn failed: {tracker.errors[0]!r}") from tracker.errors[0]
    failures.extend(f"{count} concurrent: {how}" for how in tracker.failed)
    return replace(sample, submit_s=submit_s, failed=len(tracker.failed))


def _one_turn(target: TargetInfo, request: TurnRequest, tracker: _Tracker) -> None:
    """One agent: its own client and connection, submit, then follow the stream to exit."""
    try:
        with target.client() as client:
            turn = client.submit(request)
            tracker.note("submitted")
            last: Event | None = None
            stderr = ""
            for event in client.follow(turn.turn_id):
                last = event
                if isinstance(event, OutputEvent) and event.kind == "stderr":
                    stderr = (stderr + (event.data or ""))[-STDERR_SHOWN:]
            if isinstance(last, ExitEvent) and last.exit_code == 0:
                tracker.note("exited")
            else:
                tracker.turn_failed(turn_end(turn.turn_id, last, stderr))
    except BaseException as exc:  # reported by the main thread
        tracker.fail(exc)


def _sample(label: str, pid: int, running: int) -> Sample:
    status = proc_status(pid)
    return Sample(
        label=label,
        running=running,
        rss_kib=kib_field(status, "VmRSS"),
        hwm_kib=kib_field(status, "VmHWM"),
        threads=int(status["Threads"]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
    )


def _table(samples: list[Sample], sleep_s: float, failures: list[str]) -> str:
    idle = samples[0].rss_kib
    rows = []
    for s in samples:
        delta = s.rss_kib - idle
        per_turn = "" if s.per_turn_kib is None else f"{s.per_turn_kib:.0f}"
        rows.append(
            [
                s.label,
                str(s.running),
                f"{s.rss_kib / 1024:.1f}",
                f"{delta / 1024:+.1f}",
                per_turn,
                f"{s.hwm_kib / 1024:.1f}",
                str(s.threads),
                str(s.fds),
                "" if s.submit_s is None else f"{s.submit_s:.2f}",
                str(s.failed) if s.submit_s is not None else "",
            ]
        )
    title = (
        "3. Target process memory (VmRSS of `python -m target_side.tools.cli serve`; each turn\n"
        "   submitted by its own client thread and followed to exit; sampled "
        f"{SETTLE_S:g} s after\n   the last submit answered; turns run `sleep {sleep_s:g}` "
        f"({SUBMIT_ALLOWANCE_S:g} s per turn of the level if\n"
        "   longer, so that all still run). KiB/turn: growth over idle per running turn,\n"
        "   or for the +N rows, growth over the row above / N; 'failed': turns that did\n"
        "   not exit 0)"
    )
    headers = [
        "state",
        "running",
        "RSS MiB",
        "vs idle",
        "KiB/turn",
        "peak MiB",
        "threads",
        "fds",
        "submit s",
        "failed",
    ]
    return with_failures(render_table(title, headers, rows), failures)
