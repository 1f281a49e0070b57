"""Copies of one command started at once, bare, every process they leave reaped: a baseline.

bubblewrap exits as soon as its sandbox's first process reports the command's
status, and that process is then handed to the nearest child subreaper, or to
init. A bench process that only waits for its bubblewraps never reaps those
first processes, so the CPU they spent (the sandbox's mounts and the command
itself) never reaches its children's times, while a target, a subreaper,
counts its sandboxes' in full. So the bare rounds run here, in a process of
their own that takes in every orphan and reaps it before it reports, and a
bare bubblewrap's CPU is counted as a turn's fence's is.

Run as ``python -m bench.bare_burst COUNT ARGV...``; prints one JSON object:
the wall time from the first start to the last exit, and the CPU time spent
meanwhile (the machine's busy and total core-seconds, this process's reaped
children's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from bench.common import REPO, CpuSnapshot
from target_side.fence import orphans


def burst(count: int, argv: Sequence[str]) -> tuple[float, CpuSnapshot]:
    """Seconds from starting ``count`` copies of ``argv`` until every process they left has
    been reaped, and the CPU time spent meanwhile. Must run as a child subreaper."""
    before = CpuSnapshot.take(os.getpid())
    started = time.perf_counter()
    procs = [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(count)
    ]
    codes = [proc.wait() for proc in procs]
    _reap_orphans()
    took = time.perf_counter() - started
    spent = before.until(CpuSnapshot.take(os.getpid()))
    if any(codes):
        raise RuntimeError(f"{list(argv)} failed bare: exit statuses {sorted(set(codes))}")
    return took, spent


def _reap_orphans() -> None:
    # Every Popen above has been waited for, so what is left are the orphans handed over.
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def measure(count: int, argv: Sequence[str]) -> tuple[float, CpuSnapshot]:
    """``burst`` in a process of its own (the caller stays no subreaper)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.bare_burst", str(count), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        said = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise RuntimeError(f"{count} bare copies of {list(argv)}: {said[-1]}")
    said = json.loads(done.stdout)
    return said["wall"], CpuSnapshot(**said["cpu"])


def main(args: Sequence[str]) -> int:
    if not orphans.become_subreaper():
        print("cannot become a child subreaper: the sandboxes would go uncounted", file=sys.stderr)
        return 1
    took, spent = burst(int(args[0]), args[1:])
    print(json.dumps({"wall": took, "cpu": dataclasses.asdict(spent)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
