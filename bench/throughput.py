"""Section ``throughput``: bytes per second of a turn's stdout, against a pipe and ssh.

The paddock rows read a turn's output through ``TargetClient.follow`` directly
over HTTPS, and through ``Target.ssh`` (paddock's tunnel, Python API, one
reused SSH connection) to a plain-HTTP listener and to the HTTPS one.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent_side.client import TargetClient
from agent_side.ssh import WINDOW_SIZE, Destination, SshConnection, SshOptions, resolve
from agent_side.tunnel import SshTransport
from agent_side.turns import output_bytes
from bench.common import (
    MIB,
    PYTHON,
    REPO,
    STDERR_SHOWN,
    TurnFailed,
    ratio,
    render_table,
    turn_end,
    warm_mux,
)
from bench.sshd import LocalSsh, control_master, local_sshd, ssh_missing
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import ExitEvent, OutputEvent, TurnRequest

READ_CHUNK = 64 * 1024
PRINTABLE_LINE = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
NOT_UTF8_LINE = "".join(f"\\{byte:03o}" for byte in range(0x80, 0x100))
"""Bytes 0x80..0xFF as printf escapes: no run of them is UTF-8, and ``yes`` repeats them as
cheaply as the text line (``/dev/urandom`` costs the kernel more than the stream itself)."""

BEST_OF = 3
"""Runs of each headline row (pipe, ssh, paddock's client rows but urandom): the best counts."""

RANDOM_DIVISOR = 4
"""The CLI and SSH-window rows move N / RANDOM_DIVISOR bytes (they are many, and slower)."""
WINDOWS = tuple(sorted({2 * MIB, WINDOW_SIZE, 16 * MIB}))
"""SSH channel windows tried (N/RANDOM_DIVISOR each); agent_side's default among them."""


SSH_ROW = "ssh 127.0.0.1 head /dev/zero"
WARM_SSH_ROW = "ssh via ControlMaster: yes | head"


@dataclass
class Row:
    name: str
    size: int
    seconds: float | None
    note: str = ""

    @property
    def rate(self) -> float | None:
        return None if self.seconds is None else self.size / MIB / self.seconds


def run(size: int, label: str = "") -> str:
    """Measure every row and return the section's table; ``label`` names the size in the title."""
    zero = ["head", "-c", str(size), "/dev/zero"]
    urandom = ["head", "-c", str(size), "/dev/urandom"]
    pipe = _best(BEST_OF, lambda: _read_all(zero, size))
    rows = [
        Row("pipe: head /dev/zero, read by python", size, pipe),
        Row(
            "pipe: head /dev/urandom, read by python",
            size,
            _best(BEST_OF, lambda: _read_all(urandom, size)),
            "the kernel's random generator alone: the urandom row's ceiling",
        ),
    ]
    with target_process() as target:
        paddock = _paddock_rows(target, size)
        ssh = _ssh_rows(target, size)
        disk = _disk_row(Path(target.workspace).parent, 2 * size)
    return _table([*rows, *ssh[:1], *paddock, *ssh[1:], disk], size, label)


def _paddock_rows(target: TargetInfo, size: int) -> list[Row]:
    rnd = size // RANDOM_DIVISOR
    printable = f"yes {PRINTABLE_LINE} | head -c {size}"
    not_utf8 = f"yes \"$(printf '{NOT_UTF8_LINE}')\" | head -c {size}"
    return [
        Row(
            "paddock client: head /dev/zero",
            size,
            _best(BEST_OF, lambda: _turn(target, ["head", "-c", str(size), "/dev/zero"], size)),
            "NUL bytes: frames carry them as they are",
        ),
        Row(
            "paddock client: yes | head (text)",
            size,
            _best(BEST_OF, lambda: _turn(target, ["sh", "-c", printable], size)),
            "printable UTF-8, HTTPS",
        ),
        Row(
            "paddock client: yes 0x80..0xFF | head",
            size,
            _best(BEST_OF, lambda: _turn(target, ["sh", "-c", not_utf8], size)),
            "not UTF-8, made as cheaply as the text: frames carry the bytes as they are",
        ),
        Row(
            "paddock client: head /dev/urandom",
            size,
            _turn(target, ["head", "-c", str(size), "/dev/urandom"], size),
            "not UTF-8, bounded by the generator (pipe row above)",
        ),
        Row(
            "paddock run CLI --no-mux: yes | head",
            rnd,
            _cli(target, ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {rnd}"], rnd, ["--no-mux"]),
            f"CLI stdout read by a pipe; N/{RANDOM_DIVISOR}",
        ),
        Row(
            "paddock run CLI via mux: yes | head",
            rnd,
            _cli(target, ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {rnd}"], rnd, warm=True),
            f"through the warm multiplexer; N/{RANDOM_DIVISOR}",
        ),
    ]


def _ssh_rows(target: TargetInfo, size: int) -> list[Row]:
    missing = ssh_missing()
    if missing is not None:
        return [Row("ssh", size, None, f"ssh: skipped ({missing})")]
    quarter = size // RANDOM_DIVISOR
    text = ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {quarter}"]
    zero = ["head", "-c", str(size), "/dev/zero"]
    printable = ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {size}"]
    with local_sshd() as ssh, target_process(tls=False) as plain:
        plain_ssh = _best(BEST_OF, lambda: _read_all(ssh.argv(zero), size))
        with control_master(ssh):
            warm_zero = _best(BEST_OF, lambda: _read_all(ssh.argv(zero, shared=True), size))
            warm_text = _best(BEST_OF, lambda: _read_all(ssh.argv(printable, shared=True), size))
        through_plain = _tunnel_turn(plain, ssh, size)
        through_tls = _tunnel_turn(target, ssh, size)
        via = ssh.paddock_options(target.url)
        cli = _cli(target, text, quarter, ["--no-mux", *via])
        cli_mux = _cli(target, text, quarter, via, warm=True)
        windows = [
            Row(
                f"tunnel, {window // MIB} MiB window: yes | head",
                quarter,
                _window_turn(plain, ssh, window, quarter),
                f"SshOptions(window_size=...), plain; N/{RANDOM_DIVISOR}",
            )
            for window in WINDOWS
        ]
    return [
        Row(SSH_ROW, size, plain_ssh, "new connection; OpenSSH's own rate"),
        Row(
            "ssh via ControlMaster: head /dev/zero",
            size,
            warm_zero,
            "a kept connection, as the paddock client rows' (connected before the clock)",
        ),
        Row(WARM_SSH_ROW, size, warm_text, "the text row's bytes, made the same way"),
        Row(
            "Target.ssh tunnel: yes | head, plain",
            size,
            through_plain,
            "Python API, plain-HTTP listener",
        ),
        Row(
            "Target.ssh tunnel: yes | head, HTTPS",
            size,
            through_tls,
            "Python API, TLS inside the channel",
        ),
        *windows,
        Row(
            "paddock run --ssh CLI --no-mux: yes | head",
            quarter,
            cli,
            f"through one paramiko connection; N/{RANDOM_DIVISOR}",
        ),
        Row(
            "paddock run --ssh CLI via mux: yes | head",
            quarter,
            cli_mux,
            f"the multiplexer's SSH connection; N/{RANDOM_DIVISOR}",
        ),
    ]


def _tunnel_turn(target: TargetInfo, ssh: LocalSsh, size: int) -> float:
    """``_turn`` for ``size`` bytes of text over ``Target.ssh``; the SSH connection made first."""
    argv = ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {size}"]
    with target.tunnel(ssh) as tunnel:
        return _follow_turn(tunnel.client, argv, size)


def _window_turn(target: TargetInfo, ssh: LocalSsh, window: int, size: int) -> float:
    """``_follow_turn`` through a tunnel built by hand from agent_side's parts, so that the
    channel window (which ``Target.ssh`` does not take) can be chosen."""
    options = SshOptions(
        identity_files=(str(ssh.key),),
        known_hosts=(str(ssh.known_hosts),),
        ssh_config=None,
        use_agent=False,
        window_size=window,
    )
    connection = SshConnection(resolve(Destination.parse(ssh.destination), options), options)
    connection.connect()
    argv = ["sh", "-c", f"yes {PRINTABLE_LINE} | head -c {size}"]
    try:
        with TargetClient(target.url, target.token, transport=SshTransport(connection)) as client:
            return _follow_turn(client, argv, size)
    finally:
        connection.close()


def _disk_row(directory: Path, size: int) -> Row:
    """The state disk's own rate, measured last: ``size`` bytes written and synced beside the
    target's state root, where the paddock rows' spools went (ssh stores nothing)."""
    path = directory / "disk-probe"
    block = b"\0" * READ_CHUNK
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // len(block)):
            os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return Row(
        "state disk: written and synced, after the rest",
        size,
        time.perf_counter() - started,
        "paddock rows store every byte here (ssh rows: none)",
    )


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
    """``_follow_turn`` on a new client of ``target`` (HTTPS, its own connection pool)."""
    with target.client() as client:
        return _follow_turn(client, argv, size)


def _follow_turn(client: TargetClient, argv: list[str], size: int) -> float:
    """Seconds from submitting the turn to its exit event, reading every output event."""
    client.health()  # the connection is up before the clock starts
    started = time.perf_counter()
    turn = client.submit(TurnRequest(role=ROLE, argv=argv))
    got, last, stderr = 0, None, ""
    for event in client.follow(turn.turn_id):
        last = event
        if isinstance(event, OutputEvent) and event.kind == "stdout":
            got += len(output_bytes(event))
        elif isinstance(event, OutputEvent):
            stderr = (stderr + (event.data or ""))[-STDERR_SHOWN:]
    seconds = time.perf_counter() - started
    if not isinstance(last, ExitEvent) or last.exit_code != 0:
        raise TurnFailed(turn_end(turn.turn_id, last, stderr))
    _check(f"turn {turn.turn_id}", last.exit_code, got, size)
    return seconds


def _cli(
    target: TargetInfo,
    argv: list[str],
    size: int,
    options: Sequence[str] = (),
    *,
    warm: bool = False,
) -> float:
    """``paddock run``'s stdout rate; ``warm``: a multiplexer started (and waited for) first."""
    env = target.cli_env()
    if warm:
        warm_mux(env, options)
    cli = [PYTHON, "-m", "agent_side.cli", "run", *options, "--", *argv]
    return _read_all(cli, size, env=env, cwd=REPO)


def _check(what: str, status: int | None, got: int, size: int) -> None:
    if status != 0 or got != size:
        raise RuntimeError(f"{what}: exit {status}, {got} bytes of {size}")


def _best(times: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(times))


def _table(rows: list[Row], size: int, label: str) -> str:
    base = rows[0].rate
    ssh = next((row.rate for row in rows if row.name == SSH_ROW), None)
    warm = next((row.rate for row in rows if row.name == WARM_SSH_ROW), None)
    out = []
    for row in rows:
        if row.rate is None:
            out.append([row.note, "", "", "", "", "", "", ""])
            continue
        out.append(
            [
                row.name,
                f"{row.size / MIB:g}",
                f"{row.seconds:.2f}",
                f"{row.rate:.1f}",
                ratio(row.rate, base),
                ratio(row.rate, ssh),
                ratio(row.rate, warm),
                row.note,
            ]
        )
    title = (
        f"2. Stream throughput (N = {size / MIB:g} MiB{label}; 'x pipe', 'x ssh', 'x warm' =\n"
        "   row MiB/s over the pipe's, over ssh's on a new connection, over ssh's text on a\n"
        f"   kept one; pipe, ssh and the paddock client rows but urandom: best of {BEST_OF} runs,\n"
        "   others one run; paddock rows: submit to exit event, against separate target processes)"
    )
    headers = ["row", "MiB", "s", "MiB/s", "x pipe", "x ssh", "x warm", "note"]
    return render_table(title, headers, out)
