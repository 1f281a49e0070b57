"""Section ``throughput``: bytes per second of a turn's stdout, against a pipe and ssh."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent_side.cli import output_bytes
from bench.common import MIB, PYTHON, REPO, ratio, render_table
from bench.sshd import local_sshd, ssh_missing
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import ExitEvent, OutputEvent, TurnRequest

READ_CHUNK = 64 * 1024
PRINTABLE_LINE = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"

NUL_DIVISOR = 50
"""The /dev/zero turn moves N / NUL_DIVISOR bytes: at its rate N would take minutes."""
RANDOM_DIVISOR = 4


@dataclass
class Row:
    name: str
    size: int
    seconds: float | None
    note: str = ""

    @property
    def rate(self) -> float | None:
        return None if self.seconds is None else self.size / MIB / self.seconds


def run(size: int) -> str:
    """Measure every row and return the section's table."""
    zero = ["head", "-c", str(size), "/dev/zero"]
    pipe = _best(3, lambda: _read_all(zero, size))
    rows = [Row("pipe: head /dev/zero, read by python", size, pipe)]
    with target_process() as target:
        paddock = _paddock_rows(target, size)
        ssh = _ssh_rows(target, size)
    return _table([*rows, *ssh[:1], *paddock, *ssh[1:]], size)


def _paddock_rows(target: TargetInfo, size: int) -> list[Row]:
    nul = size // NUL_DIVISOR
    rnd = size // RANDOM_DIVISOR
    printable = f"yes {PRINTABLE_LINE} | head -c {size}"
    return [
        Row(
            "paddock client: head /dev/zero", nul,
            _turn(target, ["head", "-c", str(nul), "/dev/zero"], nul),
            f"NUL -> JSON \\u0000; N/{NUL_DIVISOR}",
        ),
        Row(
            "paddock client: yes | head (text)", size,
            _turn(target, ["sh", "-c", printable], size), "printable UTF-8",
        ),
        Row(
            "paddock client: head /dev/urandom", rnd,
            _turn(target, ["head", "-c", str(rnd), "/dev/urandom"], rnd),
            f"not UTF-8 -> base64; N/{RANDOM_DIVISOR}",
        ),
        Row(
            "paddock run CLI: yes | head", rnd,
            _cli(target, ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {rnd}"], rnd),
            f"CLI stdout read by a pipe; N/{RANDOM_DIVISOR}",
        ),
    ]


def _ssh_rows(target: TargetInfo, size: int) -> list[Row]:
    missing = ssh_missing()
    if missing is not None:
        return [Row("ssh", size, None, f"ssh: skipped ({missing})")]
    quarter = size // RANDOM_DIVISOR
    text = ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {quarter}"]
    with local_sshd() as ssh:
        argv = ssh.argv(["head", "-c", str(size), "/dev/zero"])
        plain = _read_all(argv, size)
        tunnel = _cli(target, text, quarter, ssh.paddock_options(target.url))
    return [
        Row("ssh 127.0.0.1 head /dev/zero", size, plain, "new connection each run"),
        Row(
            "paddock run --ssh CLI: yes | head", quarter, tunnel,
            f"through one paramiko connection; N/{RANDOM_DIVISOR}",
        ),
    ]


def _read_all(
    argv: Sequence[str], size: int, env: dict[str, str] | None = None, cwd: Path | None = None
) -> float:
    """Seconds to start ``argv`` and read all ``size`` bytes of its stdout through a pipe."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, cwd=cwd
    )
    got = 0
    while proc.stdout is not None and (chunk := proc.stdout.read(READ_CHUNK)):
        got += len(chunk)
    status = proc.wait()
    seconds = time.perf_counter() - started
    _check(argv[0], status, got, size)
    return seconds


def _turn(target: TargetInfo, argv: list[str], size: int) -> float:
    """Seconds from submitting the turn to its exit event, reading every output event."""
    with target.client() as client:
        client.health()
        started = time.perf_counter()
        turn = client.submit(TurnRequest(role=ROLE, argv=argv))
        got, status = 0, None
        for event in client.follow(turn.turn_id):
            if isinstance(event, OutputEvent) and event.kind == "stdout":
                got += len(output_bytes(event))
            elif isinstance(event, ExitEvent):
                status = event.exit_code
        seconds = time.perf_counter() - started
    _check(f"turn {turn.turn_id}", status, got, size)
    return seconds


def _cli(target: TargetInfo, argv: list[str], size: int, options: Sequence[str] = ()) -> float:
    cli = [PYTHON, "-m", "agent_side.cli", "run", *options, "--", *argv]
    return _read_all(cli, size, env=target.cli_env(), cwd=REPO)


def _check(what: str, status: int | None, got: int, size: int) -> None:
    if status != 0 or got != size:
        raise RuntimeError(f"{what}: exit {status}, {got} bytes of {size}")


def _best(times: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(times))


def _table(rows: list[Row], size: int) -> str:
    base = rows[0].rate
    out = []
    for row in rows:
        if row.rate is None:
            out.append([row.note, "", "", "", "", ""])
            continue
        out.append([
            row.name, f"{row.size / MIB:g}", f"{row.seconds:.2f}", f"{row.rate:.1f}",
            ratio(row.rate, base), row.note,
        ])
    title = (
        f"2. Stream throughput (N = {size / MIB:g} MiB; 'x pipe' = row MiB/s / pipe MiB/s;\n"
        "   pipe: best of 3 runs; others: one run; paddock rows: submit to exit event,\n"
        "   against a separate target process)"
    )
    return render_table(title, ["row", "MiB", "s", "MiB/s", "x pipe", "note"], out)
