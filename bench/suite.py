"""The benchmark suite's command line: pick sections, size them, print machine facts and tables."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from bench import (
    concurrency,
    files,
    latency,
    memory,
    peer,
    protect_scan,
    resume,
    sessions,
    soak,
    throughput,
)
from bench.common import MIB, machine_facts, mux_runtime


@dataclass(frozen=True)
class Sizes:
    """How much work each section does."""

    runs: int
    slow_runs: int
    stream_bytes: int
    sleep_s: float
    sequential: int
    resumes: int
    label: str = ""
    soak_minutes: float = 2.0


DEFAULT = Sizes(
    runs=40, slow_runs=12, stream_bytes=200 * MIB, sleep_s=5.0, sequential=100, resumes=20
)
QUICK = Sizes(
    runs=10,
    slow_runs=3,
    stream_bytes=50 * MIB,
    sleep_s=3.0,
    sequential=30,
    resumes=8,
    label="--quick",
)
FULL_STREAM_BYTES = 1024 * MIB
"""``--full``: issue 4's 1 GB of output (1 GiB) for the throughput rows that move N."""

SECTIONS: dict[str, Callable[[Sizes], str]] = {
    "latency": lambda sizes: latency.run(sizes.runs, sizes.slow_runs),
    "throughput": lambda sizes: throughput.run(
        sizes.stream_bytes, f", {sizes.label}" if sizes.label else ""
    ),
    "memory": lambda sizes: memory.run(sizes.sleep_s, sizes.sequential),
    "resume": lambda sizes: resume.run(sizes.resumes),
    "scan": lambda sizes: protect_scan.run(sizes.slow_runs),
    "files": lambda sizes: files.run(sizes.slow_runs),
    "sessions": lambda sizes: sessions.run(sizes.runs),
    "concurrency": lambda sizes: concurrency.run(sizes.slow_runs),
    "peer": lambda sizes: peer.run(sizes.runs, max(3, sizes.slow_runs // 4)),
    "soak": lambda sizes: soak.run(sizes.soak_minutes),
}
ON_REQUEST = frozenset({"soak"})
"""Sections run only when named with ``--only``: they take minutes (and root, to be whole)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run.py", description="paddock benchmarks, with same-run baselines."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer runs ({QUICK.runs}/{QUICK.slow_runs}), "
        f"{QUICK.stream_bytes // MIB} MiB streams, `sleep {QUICK.sleep_s:g}` turns",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"{FULL_STREAM_BYTES // MIB} MiB streams (1 GB of output, as issue 4 asks); "
        "adds about two minutes",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SECTIONS),
        metavar="NAME",
        help=f"run only this section (repeatable): {', '.join(SECTIONS)} "
        f"({', '.join(sorted(ON_REQUEST))} only when named)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT.soak_minutes,
        help=f"how long the soak runs (default {DEFAULT.soak_minutes:g})",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = replace(_sizes(args.quick, args.full), soak_minutes=args.minutes)
    named = args.only or []
    chosen = [n for n in SECTIONS if n in named or (not named and n not in ON_REQUEST)]
    _print_facts(sizes)
    began = time.monotonic()
    with mux_runtime():
        failed = _run_sections(chosen, sizes)
    print(f"\ntotal {time.monotonic() - began:.0f} s; load after: {_load()}")
    return 1 if failed else 0


def _run_sections(chosen: list[str], sizes: Sizes) -> int:
    failed = 0
    for name in chosen:
        started = time.monotonic()
        try:
            table = SECTIONS[name](sizes)
        except Exception as exc:  # one broken section must not hide the others
            failed += 1
            table = f"{name}: FAILED: {type(exc).__name__}: {exc}"
        print(f"\n{table}\n({name}: {time.monotonic() - started:.1f} s)", flush=True)
    return failed


def _sizes(quick: bool, full: bool) -> Sizes:
    sizes = QUICK if quick else DEFAULT
    if full:
        label = " ".join(filter(None, (sizes.label, "--full")))
        sizes = replace(sizes, stream_bytes=FULL_STREAM_BYTES, label=label)
    return sizes


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _print_facts(sizes: Sizes) -> None:
    print("paddock benchmarks" + (f" ({sizes.label})" if sizes.label else ""))
    for key, value in machine_facts():
        print(f"  {key:<7} {value}")
    print(f"  {'load':<7} {_load()} (1/5/15 min, before the run)")
    print(
        f"  {'sizes':<7} {sizes.runs} runs per latency row ({sizes.slow_runs} for slow rows), "
        f"{sizes.stream_bytes // MIB} MiB streams, `sleep {sizes.sleep_s:g}` turns, "
        f"{sizes.sequential} sequential turns, {sizes.resumes} resumes per row"
    )
    sys.stdout.flush()
