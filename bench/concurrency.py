"""Section ``concurrency``: many turns at once, against the same processes started bare.

Two loads, each run a few rounds: 50 turns of ``true`` at once (how many turns
a second the target gets through) and 200 turns of ``sleep 1`` at once (how
long until the last has ended: the target's own cost is what the wall time
adds to one second). Each turn has its agent: a thread with its own client
and connection, opened and warmed before the clock starts, which runs its turn
as every agent does (``drive``: one request, submission and stream, where the
target answers so) to the exit event. The baselines start the same commands
bare, all at once, in the same run: as processes, and in bubblewrap with the
fence's flags, each round in a process that reaps every process they leave
(``bench.bare_burst``), so that a bare sandbox's CPU is counted as a fence's is.

A second table says where the CPU went while the turns ran: how busy the
machine was, and the CPU time of the target process, of its fences (bubblewrap
and the commands, counted as the target reaps them) and of the agents (this
process). A load whose machine is busy throughout is bound by the CPU time of
all three, not by any one of them. The bare bubblewrap rounds get a row of their
own: the core-seconds the load costs the machine before any target is involved,
which bounds how fast the paddock rounds can be on these cores.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from agent_side.turns import drive
from bench import bare_burst
from bench.common import CpuSnapshot, Samples, ratio, render_table, with_failures
from bench.latency import BARE_BWRAP
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import ExitEvent, TurnRequest

LOADS = ((50, ("true",)), (200, ("sleep", "1")))
"""(turns at once, the command): issue 12's two rows."""
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Load:
    count: int
    argv: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.count} concurrent `{' '.join(self.argv)}`"


def run(rounds: int) -> str:
    """Every load, ``rounds`` times over, bare and through a target process."""
    failures: list[str] = []
    rows: list[list[str]] = []
    cpu_rows: list[list[str]] = []
    with target_process() as target:
        for count, argv in LOADS:
            load = Load(count, argv)
            bare = _walls(
                [bare_burst.measure(load.count, _usr_bin(load.argv)) for _ in range(rounds)]
            )
            in_bwrap = [bare_burst.measure(load.count, _in_bwrap(load.argv)) for _ in range(rounds)]
            spent = [_turns(target, load, failures) for _ in range(rounds)]
            rows += _rows(load, bare, _walls(in_bwrap), _walls(spent))
            cpu_rows.append(_bwrap_cpu_row(load, [cpu for _, cpu in in_bwrap]))
            cpu_rows.append(_cpu_row(load, [cpu for _, cpu in spent]))
    tables = f"{_table(rows, rounds)}\n\n{_cpu_table(cpu_rows, rounds)}"
    return with_failures(tables, failures)


def _usr_bin(argv: Sequence[str]) -> list[str]:
    return [f"/usr/bin/{argv[0]}", *argv[1:]]


def _in_bwrap(argv: Sequence[str]) -> list[str]:
    return [*BARE_BWRAP[:-1], *_usr_bin(argv)]


def _walls(rounds: list[tuple[float, CpuSnapshot]]) -> Samples:
    return Samples(tuple(wall for wall, _ in rounds))


def _turns(target: TargetInfo, load: Load, failures: list[str]) -> tuple[float, CpuSnapshot]:
    """Seconds from ``load.count`` warmed agents submitting at once until the last turn ended,
    and the CPU time spent meanwhile."""
    request = TurnRequest(role=ROLE, argv=list(load.argv))
    ready = threading.Barrier(load.count + 1)
    ended: list[str | None] = []
    lock = threading.Lock()

    def agent() -> None:
        outcome: str | None = None
        try:
            with target.client() as client:
                client.health()  # connected and through TLS before the clock starts
                ready.wait(START_TIMEOUT_S)
                finished = drive(client, request, lambda event: None)
                last = finished.terminal
                if not (isinstance(last, ExitEvent) and last.exit_code == 0):
                    outcome = f"{load.label}: turn {finished.turn.turn_id} ended with {last!r}"
        except BaseException as exc:  # reported below, with the others
            outcome = f"{load.label}: {exc!r}"
            ready.abort()
        with lock:
            ended.append(outcome)

    threads = [threading.Thread(target=agent, daemon=True) for _ in range(load.count)]
    for thread in threads:
        thread.start()
    ready.wait(START_TIMEOUT_S)
    started = time.perf_counter()
    before = CpuSnapshot.take(target.pid)  # the agents connected, their clock running
    for thread in threads:
        thread.join()
    took = time.perf_counter() - started
    spent = before.until(CpuSnapshot.take(target.pid))
    failures.extend(outcome for outcome in ended if outcome is not None)
    return took, spent


def _rows(load: Load, bare: Samples, fenced: Samples, turns: Samples) -> list[list[str]]:
    base = fenced.p50
    return [
        [
            f"{load.label}, {label}",
            f"{samples.p50:.2f}",
            f"{max(samples.values):.2f}",
            f"{load.count / samples.p50:.0f}",
            ratio(samples.p50, base),
        ]
        for label, samples in (
            ("processes", bare),
            ("bwrap, fence flags", fenced),
            ("paddock turns", turns),
        )
    ]


def _cpu_row(load: Load, spent: list[CpuSnapshot]) -> list[str]:
    own = statistics.median(s.own for s in spent)
    return [
        f"{load.label}, paddock turns",
        *_machine(spent),
        f"{own:.2f}",
        f"{statistics.median(s.children for s in spent):.2f}",
        f"{statistics.median(s.here for s in spent):.2f}",
        f"{1000 * own / load.count:.1f}",
    ]


def _bwrap_cpu_row(load: Load, spent: list[CpuSnapshot]) -> list[str]:
    """The bare bubblewrap rounds: the load's own cost, no target, no agents."""
    fences = statistics.median(s.children for s in spent)
    return [f"{load.label}, bwrap alone", *_machine(spent), "-", f"{fences:.2f}", "-", "-"]


def _machine(spent: list[CpuSnapshot]) -> list[str]:
    """How busy the machine was (of all its cores), and for how many core-seconds."""
    return [
        f"{100 * statistics.median(s.busy / s.total for s in spent if s.total):.0f}%",
        f"{statistics.median(s.busy for s in spent):.2f}",
    ]


def _cpu_table(rows: list[list[str]], rounds: int) -> str:
    title = (
        f"8b. Where the CPU went in those rounds (p50 of {rounds}; seconds, from /proc, from\n"
        "   the start to the last exit: the machine busy, of all its cores, and its busy\n"
        "   core-seconds; the target process; its fences, bubblewrap and the commands, as\n"
        "   reaped; the agents, this process. bwrap alone: the same commands in bare\n"
        "   bubblewrap, every sandbox reaped, what the load costs the machine before any\n"
        "   target is involved)"
    )
    headers = ["load", "busy", "core s", "target s", "fences s", "agents s", "target ms/turn"]
    return render_table(title, headers, rows)


def _table(rows: list[list[str]], rounds: int) -> str:
    title = (
        f"8. Concurrent turns (a target process; {rounds} rounds each; every turn its own agent\n"
        "   thread and connection, warmed first; wall from the submissions to the last exit;\n"
        "   baselines: the same commands started bare, all at once, in this run)"
    )
    headers = ["load", "wall p50 s", "max s", "per s", "vs bwrap"]
    return render_table(title, headers, rows)
