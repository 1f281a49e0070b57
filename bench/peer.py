"""Section ``peer``: the same turns through SWE-ReX, when it is installed, in the same rounds.

SWE-ReX's server (``python -m swerex.server``, on 127.0.0.1 with a token) is
reached with its own client, ``RemoteRuntime``: ``execute`` starts a fresh
process per command, ``run_in_session`` types the command into one long-lived
bash. Neither fences the command; paddock's row does. Two loads: ``true``
(latency, against the bare baselines) and 10 MiB of text on stdout, read to
the end by each client (against a plain pipe).

Not installed, the section says how to add it and measures nothing:
``.venv/bin/pip install swe-rex aiohttp`` (SWE-ReX's client needs aiohttp, which it
does not pull in).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agent_side.api import Target
from bench.common import (
    MIB,
    PYTHON,
    TurnFailed,
    child_env,
    free_port,
    ms,
    percentile,
    ratio,
    render_table,
    run_quiet,
    stop_process,
    wait_for_port,
    with_failures,
)
from bench.latency import BARE_BWRAP
from bench.targets import target_process

OUTPUT_BYTES = 10 * MIB
OUTPUT_SCRIPT = (
    f"yes abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ | head -c {OUTPUT_BYTES}"
)
"""10 MiB of text in 64-byte lines (a session's terminal copes badly with one huge line)."""
WARMUP = 1
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Row:
    """One measured thing: its action (returns the output bytes it got) and its timings."""

    name: str
    action: Callable[[], int]
    note: str = ""
    expect_bytes: int | None = None
    at_least: bool = False
    """Output may exceed ``expect_bytes`` (a terminal session's text holds what it echoed)."""
    values: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def attempt(self) -> None:
        started = time.perf_counter()
        try:
            got = self.action()
        except TurnFailed as exc:
            self.failures.append(f"{self.name}: {exc}")
            return
        took = time.perf_counter() - started
        short = self.expect_bytes is not None and got < self.expect_bytes
        if short or (
            self.expect_bytes is not None and not self.at_least and got != self.expect_bytes
        ):
            self.failures.append(f"{self.name}: {got} bytes of output, not {self.expect_bytes}")
            return
        self.values.append(took)

    @property
    def p50(self) -> float | None:
        return percentile(self.values, 50) if self.values else None


def run(runs: int, output_runs: int) -> str:
    """Both loads through paddock and SWE-ReX, interleaved round by round."""
    if any(importlib.util.find_spec(name) is None for name in ("swerex", "aiohttp")):
        return (
            "Peer: SWE-ReX (with aiohttp, which its client needs) is not installed here, so its "
            "rows are left out (add them with `.venv/bin/pip install swe-rex aiohttp`)."
        )
    with target_process() as target, target.https() as paddock, swerex_server() as rex:
        latency = _latency_rows(paddock, rex)
        output = _output_rows(paddock, rex)
        _measure(latency, runs)
        _measure(output, output_runs)
    failures = [how for row in (*latency, *output) for how in row.failures]
    return with_failures(
        "\n\n".join((_latency_table(latency, runs), _output_table(output, output_runs))), failures
    )


class Rex:
    """A SWE-ReX server's ``RemoteRuntime`` with one bash session, driven from this thread."""

    def __init__(self, port: int, token: str) -> None:
        from swerex.runtime.remote import RemoteRuntime

        self._runner = asyncio.Runner()
        self._runtime: Any = RemoteRuntime(
            host="http://127.0.0.1", port=port, auth_token=token, timeout=REQUEST_TIMEOUT_S
        )

    def start(self) -> None:
        from swerex.runtime.abstract import CreateBashSessionRequest

        self._runner.run(self._runtime.wait_until_alive(timeout=60.0))
        self._runner.run(self._runtime.create_session(CreateBashSessionRequest()))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._runner.run(self._runtime.close())
        self._runner.close()

    def execute(self, script: str) -> int:
        """``script`` by ``sh -c`` in a process of its own; the bytes of stdout it returned."""
        from swerex.runtime.abstract import Command

        done = self._runner.run(
            self._runtime.execute(Command(command=["sh", "-c", script], timeout=REQUEST_TIMEOUT_S))
        )
        if done.exit_code != 0:
            raise TurnFailed(f"SWE-ReX execute exited {done.exit_code}: {done.stderr[-200:]!r}")
        return len(done.stdout.encode())

    def in_session(self, script: str) -> int:
        """``script`` typed into the bash session; the bytes of output it returned."""
        from swerex.runtime.abstract import BashAction

        seen = self._runner.run(
            self._runtime.run_in_session(BashAction(command=script, timeout=REQUEST_TIMEOUT_S))
        )
        if seen.exit_code != 0:
            raise TurnFailed(f"SWE-ReX run_in_session exited {seen.exit_code}")
        # The session strips the output's last newline; count it back, as the pipe has it.
        return len(seen.output.encode()) + 1 if seen.output else 0


@contextlib.contextmanager
def swerex_server() -> Iterator[Rex]:
    """SWE-ReX's server on 127.0.0.1 (a free port, a fresh token), and a client for it."""
    port, token = free_port(), secrets.token_hex(16)
    rex = Rex(port, token)  # first: a client that cannot be made leaves no server behind
    argv = [PYTHON, "-m", "swerex.server", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--auth-token", token],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc, timeout=60.0)
        rex.start()
        yield rex
    finally:
        rex.close()
        stop_process(proc)


def _paddock_run(paddock: Target, argv: list[str]) -> int:
    result = paddock.run(argv)
    if result.exit_code != 0:
        raise TurnFailed(f"paddock turn exited {result.exit_code}: {result.stderr[-200:]!r}")
    return len(result.stdout)


def _pipe_bytes() -> int:
    done = subprocess.run(["sh", "-c", OUTPUT_SCRIPT], capture_output=True, check=True)
    return len(done.stdout)


def _latency_rows(paddock: Target, rex: Rex) -> list[Row]:
    def bare(argv: list[str]) -> Callable[[], int]:
        def one() -> int:
            run_quiet(argv)
            return 0

        return one

    return [
        Row("spawn /usr/bin/true", bare(["/usr/bin/true"])),
        Row("bwrap, fence flags, true", bare(BARE_BWRAP)),
        Row("paddock Target.https .run(true)", lambda: _paddock_run(paddock, ["true"]), "fenced"),
        Row("SWE-ReX execute(true)", lambda: rex.execute("true"), "a process each, no fence"),
        Row("SWE-ReX run_in_session(true)", lambda: rex.in_session("true"), "one bash, no fence"),
    ]


def _output_rows(paddock: Target, rex: Rex) -> list[Row]:
    script = OUTPUT_SCRIPT
    return [
        Row("pipe: sh -c, read by subprocess", _pipe_bytes, "baseline", OUTPUT_BYTES),
        Row(
            "paddock Target.https .run(sh -c)",
            lambda: _paddock_run(paddock, ["sh", "-c", script]),
            "fenced, bytes as written",
            OUTPUT_BYTES,
        ),
        Row("SWE-ReX execute(sh -c)", lambda: rex.execute(script), "no fence", OUTPUT_BYTES),
        Row(
            "SWE-ReX run_in_session(...)",
            lambda: rex.in_session(script),
            "no fence; a terminal's text",
            OUTPUT_BYTES,
            at_least=True,
        ),
    ]


def _measure(rows: list[Row], runs: int) -> None:
    for row in rows:
        for _ in range(WARMUP):
            row.attempt()
        row.values.clear()
        row.failures.clear()
    for _ in range(runs):
        for row in rows:
            row.attempt()


def _latency_table(rows: list[Row], runs: int) -> str:
    bwrap = rows[1].p50
    lines = [
        [
            row.name,
            str(len(row.values)),
            ms(row.p50) if row.p50 is not None else "-",
            ratio(row.p50, bwrap) if row.p50 is not None else "-",
            row.note,
        ]
        for row in rows
    ]
    return render_table(
        f"P1. Peer: `true` through SWE-ReX and paddock (ms; {runs} interleaved rounds; "
        "'x bwrap' = row p50 / bare bwrap p50)",
        ["row", "n", "p50", "x bwrap", "note"],
        lines,
    )


def _output_table(rows: list[Row], runs: int) -> str:
    pipe = rows[0].p50
    lines = []
    for row in rows:
        p50 = row.p50
        rate = f"{OUTPUT_BYTES / MIB / p50:.1f}" if p50 else "-"
        lines.append(
            [
                row.name,
                str(len(row.values)),
                ms(p50) if p50 is not None else "-",
                rate,
                ratio(p50, pipe) if p50 is not None else "-",
                row.note,
            ]
        )
    return render_table(
        f"P2. Peer: {OUTPUT_BYTES // MIB} MiB of text on stdout, read to the end (ms; "
        f"{runs} interleaved rounds; 'x pipe' = row p50 / pipe p50)",
        ["row", "n", "p50", "MiB/s", "x pipe", "note"],
        lines,
    )
