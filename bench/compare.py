"""Two versions of paddock on this machine, measured in alternation: did a change make a turn
cheaper, or only this run luckier?

    .venv/bin/python bench/compare.py BASE [NEW] [--rounds N] [--turns N] [--pause-ms MS]
                                                 [--no-burst]

``BASE`` and ``NEW`` are git revisions; ``NEW`` defaults to the working tree as it
is. Each revision gets a checkout of its own (a detached git worktree, removed
afterwards) and a target process of its own, started once. Then the rounds
alternate between the two, so that the machine's drift, and the state of its
disk, fall on both alike. One round, on one side:

- 100 sequential ``true`` turns (``--turns``), each as the side's own
  ``TargetClient`` runs one (``submit_and_follow`` where it has it, else submit
  and follow): their p50, the target's CPU per turn (user + system, from
  ``/proc``), and the part of it spent on the event loop's thread, which every
  turn and every stream waits for; with ``--pause-ms``, each turn after a pause
  (an agent's think time: what a target does while it idles leaves the turn);
- 200 concurrent ``sleep 1`` turns, each from its own thread and connection: the
  wall from the first submission to the last exit (not with ``--no-burst``).

The side that goes first changes from round to round: whichever follows the
other's turns paid up to 2% more for it here. Printed: for each figure, each
side's median over the rounds, its range, NEW over BASE, and the median of
the rounds' own NEW over BASE (paired: each round's two sides ran in the same
moment). On a machine whose runs of the same code differ by a tenth, a
difference smaller than the ranges' overlap is not one. Where the machine
drifts within minutes, many short rounds put both sides in the same moments
more closely than a few long ones: one turn a round
(``--rounds 600 --turns 1 --no-burst``). Even so, two target processes of
the same code differ: against itself, the working tree measured 0.983x and
0.993x paired in two runs here, so a change of 2% or less needs runs that
agree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SEQUENTIAL = 100
BURST = 200
FIGURES = (
    ("true_p50_ms", "`true` turn p50 (ms)"),
    ("cpu_per_turn_ms", "target CPU per `true` turn (ms)"),
    ("loop_cpu_per_turn_ms", "  of it, the event loop's (ms)"),
    ("burst_s", f"{BURST} concurrent `sleep 1` (s)"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "base", nargs="?", help="the revision to compare against (a commit, a tag, HEAD~1)"
    )
    parser.add_argument("new", nargs="?", help="the revision to measure (default: working tree)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds on each side (default 6)")
    parser.add_argument(
        "--turns",
        type=int,
        default=SEQUENTIAL,
        help=f"sequential turns in a round (default {SEQUENTIAL})",
    )
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="a pause before each sequential turn, untimed (default 0: back to back)",
    )
    parser.add_argument("--no-burst", action="store_true", help="leave the burst out")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # a side's own process (internal)
    args = parser.parse_args()
    if args.side:
        return _serve_rounds(Path(args.side))
    if args.base is None:
        parser.error("name the revision to compare against, e.g. HEAD~1")
    if args.rounds < 1 or args.turns < 1 or args.pause_ms < 0:
        parser.error("--rounds and --turns must be at least 1, --pause-ms at least 0")
    order = json.dumps(
        {"turns": args.turns, "burst": not args.no_burst, "pause_s": args.pause_ms / 1000}
    )
    with _checkout(args.base) as base, _checkout(args.new) as new:
        results = _alternate({"base": base, "new": new}, args.rounds, order)
    print(_report(args.base, args.new or "working tree", results))
    return 0


@contextlib.contextmanager
def _checkout(revision: str | None) -> Iterator[Path]:
    """A detached worktree of ``revision``, removed afterwards; the working tree for None."""
    if revision is None:
        yield ROOT
        return
    place = Path(tempfile.mkdtemp(prefix="paddock-compare-"))
    made = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(place), revision],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        place.rmdir()
        sys.exit(f"compare: cannot check out {revision!r}: {made.stderr.strip()}")
    try:
        yield place
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(place)],
            capture_output=True,
            check=False,
        )


def _alternate(
    sides: dict[str, Path], rounds: int, order: str
) -> dict[str, list[dict[str, float]]]:
    """Each side's process started, then one round on each in turn, ``rounds`` times; each
    round as ``order`` (JSON: sequential turns, and whether to burst) says."""
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, place in sides.items():
            procs[name] = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--side", str(place)],
                cwd=place,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            _expect(procs[name], name, "ready")
        results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for number in range(1, rounds + 1):
            turn = list(procs.items())
            for name, proc in turn if number % 2 else reversed(turn):
                assert proc.stdin is not None
                proc.stdin.write(f"{order}\n")
                proc.stdin.flush()
                results[name].append(json.loads(_expect(proc, name, "")))
            if number % max(1, rounds // 10) == 0 or number == rounds:
                print(f"round {number} of {rounds} done", file=sys.stderr)
        return results
    finally:
        for proc in procs.values():
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            proc.wait()


def _expect(proc: subprocess.Popen[str], name: str, start: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(start) or not line.strip():
        sys.exit(f"compare: the {name} side stopped (it said {line!r}); see its output above")
    return line


def _report(base: str, new: str, results: dict[str, list[dict[str, float]]]) -> str:
    rounds = len(results["base"])
    title = f"{new} against {base}: medians of {rounds} alternated rounds (min-max)"
    rows = [title, "-" * len(title)]
    for key, label in FIGURES:
        old = [r[key] for r in results["base"] if key in r]
        now = [r[key] for r in results["new"] if key in r]
        if not old or not now:
            continue
        ratio = statistics.median(now) / statistics.median(old)
        paired = statistics.median(n / o for n, o in zip(now, old, strict=True) if o)
        rows.append(
            f"{label:34s} base {_spread(old)}   new {_spread(now)}   "
            f"new/base {ratio:.3f}x, paired {paired:.3f}x"
        )
    return "\n".join(rows)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


# --- one side: its own target, measured on request ------------------------------------------


def _serve_rounds(place: Path) -> int:
    """Run in ``place``'s checkout: a target process, then one round per line on stdin."""
    sys.path.insert(0, str(place))
    from bench.targets import ROLE, target_process  # that revision's own
    from shared.wire import TurnRequest

    with target_process() as target:
        client = target.client()
        client.health()
        for _ in range(10):  # warm: imports, the curated /etc, the first connections
            _run(client, TurnRequest(role=ROLE, argv=["true"]))
        print("ready", flush=True)
        for line in sys.stdin:
            order = json.loads(line)
            request = TurnRequest(role=ROLE, argv=["true"])
            figures = _sequential(
                target.pid, client, request, order["turns"], order.get("pause_s", 0.0)
            )
            if order["burst"]:
                figures["burst_s"] = _burst(target, TurnRequest(role=ROLE, argv=["sleep", "1"]))
            print(json.dumps(figures), flush=True)
    return 0


# The side's own modules, imported from its checkout, so this file does not import them (nor
# reuse `concurrency`'s burst, whose shape an older revision need not share): typed loosely.
def _run(client: Any, request: Any) -> None:
    """One turn to its end, as the side's own client runs one (in one request where it can);
    one that did not exit 0 is not a sample: the side stops, saying so."""
    turn_ids: list[str] = []
    if hasattr(client, "submit_and_follow"):
        events = client.submit_and_follow(request, uuid.uuid4().hex, turn_ids.append)
    else:
        turn_ids.append(client.submit(request).turn_id)
        events = client.follow(turn_ids[0])
    last = None
    for event in events:
        last = event
    if getattr(last, "kind", None) != "exit" or getattr(last, "exit_code", None) != 0:
        raise SystemExit(f"compare: turn {turn_ids} ended with {last!r}; nothing timed")


def _sequential(
    pid: int, client: Any, request: Any, turns: int, pause_s: float
) -> dict[str, float]:
    times = []
    used, used_loop = _cpu_s(pid), _loop_cpu_s(pid)
    for _ in range(turns):
        if pause_s:
            time.sleep(pause_s)
        started = time.perf_counter()
        _run(client, request)
        times.append(time.perf_counter() - started)
    return {
        "true_p50_ms": statistics.median(times) * 1000,
        "cpu_per_turn_ms": (_cpu_s(pid) - used) / turns * 1000,
        "loop_cpu_per_turn_ms": (_loop_cpu_s(pid) - used_loop) / turns * 1000,
    }


def _burst(target: Any, request: Any) -> float:
    clients = [target.client() for _ in range(BURST)]
    failures: list[BaseException] = []

    def one(client: Any) -> None:
        try:
            _run(client, request)
        except BaseException as exc:
            failures.append(exc)

    try:
        for client in clients:
            client.health()
        threads = [threading.Thread(target=one, args=(c,)) for c in clients]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    finally:
        for client in clients:
            client.close()
    if failures:
        # A burst with a failed turn measures something else: no figure at all.
        raise SystemExit(f"{len(failures)} of {BURST} turns failed, the first: {failures[0]!r}")
    return wall


def _cpu_s(pid: int) -> float:
    """CPU of every thread ``pid`` has or had, in seconds, to the nanosecond: its process
    CPU clock (``clock_getcpuclockid``'s, which Python does not wrap: the kernel's encoding
    of a process's scheduler clock). ``/proc``'s ``stat`` counts in ticks of 10 ms, which
    made the figure jump by half a millisecond a turn."""
    return time.clock_gettime(((~pid) << 3) | 2)


def _loop_cpu_s(pid: int) -> float:
    """CPU of ``pid``'s main thread, the event loop's, in seconds: from ``schedstat``, in
    nanoseconds (``stat`` counts in ticks of 10 ms, too coarse for a few turns)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


if __name__ == "__main__":
    sys.exit(main())
