"""Where a burst's turns wait: each turn's steps on the target's clock, 200 at once.

    .venv/bin/python bench/stages.py [--turns 200] [--rounds 2]

The concurrency section's burst (``sleep 1`` turns, each from its own warmed
agent), against a target run under ``bench.stage_probe``, which stamps each
turn's steps: made (its record), planning and planned (spool, plan and
cgroups, on a planning thread), its cgroups made, handed over (its
bubblewrap handed to the thread that starts it at once, where the planning
thread may do that), launching (the event loop took the planned turn up),
started (its process followed from the loop), launched (its launch line
written, ``started`` queued), ending and ended (its end recorded). A step
that does not happen to a turn (handed over, under a lease or through the
launcher) is left out of its spans. Printed per round: when each
step happened across the turns (from the first turn made), and how long
each turn spent between two steps. A step whose time grows with the burst is
where the turns queue.

    .venv/bin/python bench/stages.py --sequential 300

One turn at a time instead (``true``, from one warmed client, each followed
by one bare bubblewrap with the fence's flags, table 1's baseline): where a
lone turn's time goes, from the client asking (``asked``) to the client
holding its exit event (``answered``), on the same clock as the target's
steps. A second table follows the turn's critical path alone: up to
bubblewrap's start (``spawning``, on the thread that starts it), its
``Popen`` (``spawned``), its run until the thread reaps it (``reaped``), and
the way from there to the client; its spans add up to the whole turn.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import render_table, run_quiet
from bench.concurrency import Load, _turns
from bench.latency import BARE_BWRAP
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import ExitEvent, TurnRequest

STEPS = (
    "made",
    "planning",
    "cgroups",
    "cgroups made",
    "handed over",
    "planned",
    "launching",
    "started",
    "launched",
    "ending",
    "ended",
)
LONE_STEPS = ("asked", *STEPS, "answered")
"""A lone turn's steps: the client's two around the target's."""
CRITICAL_PATH = ("asked", "made", "spawning", "spawned", "reaped", "ending", "ended", "answered")
"""A lone turn's steps one after another: each span waits for the one before."""
WARM_TURNS = 50
SETTLE_S = 0.5
"""Between a burst's end and the stamps being asked for: the last ends are recorded by then."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--sequential", type=int, metavar="N", help="N turns one at a time, not a burst"
    )
    parser.add_argument(
        "--idle-ms", type=float, default=0.0, help="with --sequential: the pause before each turn"
    )
    args = parser.parse_args()
    if args.sequential:
        _lone_turns(args.sequential, args.idle_ms / 1000)
        return
    load = Load(args.turns, ("sleep", "1"))
    with tempfile.TemporaryDirectory(prefix="paddock-stages-") as scratch:
        stamps = Path(scratch) / "stamps.json"
        probe = {"PADDOCK_STAGE_FILE": str(stamps)}
        with target_process(module="bench.stage_probe", env=probe) as target:
            failures: list[str] = []
            _turns(target, load, failures)  # warm: threads, nursery, caches
            for number in range(1, args.rounds + 1):
                _collect(target.pid, stamps)  # forget the warm-up's
                wall, _ = _turns(target, load, failures)
                print(_report(number, wall, _collect(target.pid, stamps)[0]))
            for failure in failures[:5]:
                print(f"failed: {failure}")


def _lone_turns(count: int, idle_s: float) -> None:
    """``count`` turns of ``true`` one after another, each step of each stamped; ``idle_s``
    before each (an agent's turns come seconds apart, and an idle machine is slow to wake)."""
    with tempfile.TemporaryDirectory(prefix="paddock-stages-") as scratch:
        stamps = Path(scratch) / "stamps.json"
        probe = {"PADDOCK_STAGE_FILE": str(stamps)}
        with target_process(module="bench.stage_probe", env=probe) as target:
            _lone(target, WARM_TURNS, 0.0)
            _collect(target.pid, stamps)  # forget the warm-up's
            asked, bare = _lone(target, count, idle_s)
            found, processes = _collect(target.pid, stamps)
    for turn_id, (sent, held) in asked.items():
        found.get(turn_id, {}).update(asked=sent, answered=held)
    rows = [row for row in found.values() if {"asked", "answered"} <= row.keys()]
    _place(processes, rows)
    paused = f", {1000 * idle_s:g} ms idle before each" if idle_s else ""
    print(_spans(f"{len(rows)} turns one at a time{paused}; between steps (ms, per turn)", rows))
    print(_spans("the same turns' critical path (ms, per turn)", rows, CRITICAL_PATH))
    total = statistics.median(1000 * (row["answered"] - row["asked"]) for row in rows)
    base = 1000 * statistics.median(bare)
    print(
        f"asked -> answered p50 {total:.2f} ms; bare bubblewrap p50 {base:.2f} ms "
        f"(same run): {total / base:.2f}x"
    )


def _place(processes: list[tuple[str, float]], rows: list[dict[str, float]]) -> None:
    """Each bubblewrap step into the turn it happened in (turns one at a time: the one whose
    record was made before it and whose end was recorded after it), its first of each."""
    for step, at in processes:
        for row in rows:
            if row["made"] <= at <= row["ended"]:
                row.setdefault(step, at)
                break


def _lone(
    target: TargetInfo, count: int, idle_s: float
) -> tuple[dict[str, tuple[float, float]], list[float]]:
    """Each turn's (asked, answered) on the monotonic clock, and each bare run's seconds (the
    bare run idle as long before it as the turn)."""
    request = TurnRequest(role=ROLE, argv=["true"])
    asked: dict[str, tuple[float, float]] = {}
    bare: list[float] = []
    with target.client() as client:
        for _ in range(count):
            ids: list[str] = []
            time.sleep(idle_s)
            sent = time.monotonic()
            events = list(client.submit_and_follow(request, uuid.uuid4().hex, ids.append))
            held = time.monotonic()
            last = events[-1] if events else None
            if not (isinstance(last, ExitEvent) and last.exit_code == 0):
                raise SystemExit(f"stages: turn {ids} ended with {last!r}")
            asked[ids[0]] = (sent, held)
            time.sleep(idle_s)
            started = time.monotonic()
            run_quiet(BARE_BWRAP)
            bare.append(time.monotonic() - started)
    return asked, bare


def _spans(title: str, rows: list[dict[str, float]], steps: tuple[str, ...] = LONE_STEPS) -> str:
    """How long the turns spent between each two steps both of which they went through."""
    spans = []
    for first, then in itertools.pairwise(steps):
        took = sorted(
            1000 * (row[then] - row[first]) for row in rows if {first, then} <= row.keys()
        )
        if took:
            spans.append([f"{first} -> {then}", *(f"{q:.2f}" for q in _quantiles(took))])
    return render_table(title, ["", "first", "p10", "p50", "p90", "last"], spans)


Steps = dict[str, dict[str, float]]
"""Each turn's steps, by turn id: when (``time.monotonic``) it went through each."""


def _collect(pid: int, stamps: Path) -> tuple[Steps, list[tuple[str, float]]]:
    """Each turn's steps, and bubblewrap's process steps (named by no turn), since the last
    collection."""
    time.sleep(SETTLE_S)
    stamps.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while not stamps.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    found = json.loads(stamps.read_text())
    return found["turns"], [(step, at) for step, at in found["processes"]]


def _report(number: int, wall: float, turns: dict[str, dict[str, float]]) -> str:
    rows = list(turns.values())
    if not rows:
        return f"round {number}: no turn recorded"
    zero = min(row["made"] for row in rows if "made" in row)
    when = []
    for step in STEPS:
        at = sorted(row[step] - zero for row in rows if step in row)
        if at:
            when.append([step, *(f"{q:.3f}" for q in _quantiles(at))])
    title = f"round {number}: {len(rows)} turns, wall {wall:.2f} s"
    header = ["", "first", "p10", "p50", "p90", "last"]
    return "\n".join(
        [
            render_table(f"{title}; when (s, from the first turn made)", header, when),
            _spans(f"{title}; between steps (ms, per turn)", rows, STEPS),
        ]
    )


def _quantiles(values: list[float]) -> tuple[float, ...]:
    last = len(values) - 1
    return tuple(values[round(q * last)] for q in (0, 0.1, 0.5, 0.9, 1))


if __name__ == "__main__":
    main()
