"""Section ``latency``: how long a turn running ``true`` takes, end to end, against baselines.

Every target, sshd and connection is set up first; then the rows are timed in
interleaved rounds (one run of each row per round), so a change in the
machine's load during the section touches every row alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent_side.api import Target
from agent_side.client import TargetClient
from bench.common import (
    PYTHON,
    REPO,
    STDERR_SHOWN,
    Samples,
    TurnFailed,
    child_env,
    ms,
    mux_pids,
    ratio,
    render_table,
    run_quiet,
    turn_end,
    wait_for_mux,
    warm_mux,
    with_failures,
)
from bench.sshd import LocalSsh, control_master, local_sshd, port_forward, ssh_missing
from bench.targets import ROLE, TargetInfo, embedded_target, target_process
from shared.wire import Event, ExitEvent, OutputEvent, Turn, TurnRequest

BARE_BWRAP = [
    "bwrap",
    "--unshare-all",
    "--unshare-user",
    "--disable-userns",
    "--uid",
    "65534",
    "--gid",
    "65534",
    "--cap-drop",
    "ALL",
    "--die-with-parent",
    "--new-session",
    "--ro-bind",
    "/usr",
    "/usr",
    "--symlink",
    "usr/bin",
    "/bin",
    "--symlink",
    "usr/lib",
    "/lib",
    "--symlink",
    "usr/lib64",
    "/lib64",
    "--proc",
    "/proc",
    "--dev",
    "/dev",
    "--",
    "/usr/bin/true",
]
"""bubblewrap with the process flags of paddock's fence, and only /usr mounted."""

SPAWN = "spawn /usr/bin/true"
BWRAP = "bwrap, fence flags, true"
API_HTTPS = "Target.https .run(true)"
API_PLAIN = "Target.https .run(true), plain HTTP"
TUNNEL_TLS = "Target.ssh .run(true), HTTPS inside"
TUNNEL_PLAIN = "Target.ssh .run(true), plain HTTP"
TUNNEL_HEALTH = "GET /v1/health via Target.ssh"
FORWARDED = "Target.https .run(true) via ssh -L"
TUNNEL_CONNECT = "Target.ssh connect + health + close"
SSH_FRESH = "ssh 127.0.0.1 true, new connection"
SSH_SHARED = "ssh 127.0.0.1 true, ControlMaster"
CLI_COLD = "paddock run -- true, CLI --no-mux"
CLI_STARTING = "paddock run -- true, CLI starting the mux"
CLI_WARM = "paddock run -- true, CLI via warm mux"
CLI_SSH = "paddock run --ssh -- true, CLI --no-mux"
CLI_SSH_WARM = "paddock run --ssh -- true, CLI via warm mux"
CLI_ROWS = (CLI_COLD, CLI_STARTING, CLI_WARM, CLI_SSH, CLI_SSH_WARM)
"""Table 1d: issue 12's whole-process CLI rows, against the process baselines."""
ISSUE_5_ROWS = (
    API_HTTPS,
    API_PLAIN,
    TUNNEL_TLS,
    TUNNEL_PLAIN,
    FORWARDED,
    TUNNEL_HEALTH,
    TUNNEL_CONNECT,
    SSH_FRESH,
    SSH_SHARED,
    CLI_SSH,
    CLI_SSH_WARM,
)
"""Table 1c: issue 5's comparison, the turn over the tunnel against HTTPS and plain ssh."""
TRUE_REQUEST = TurnRequest(role=ROLE, argv=["true"])
WARMUP = 2
ONE_BY_ONE = 4
"""Table 1e's rounds, per round of table 1: three short rows, so many more rounds."""


@dataclass
class Row:
    """One line of the table: what is timed, and its timings once measured."""

    name: str
    action: Callable[[], object] | None
    note: str = ""
    slow: bool = False
    prepare: Callable[[], object] | None = None
    """Run before each attempt, untimed (stopping the multiplexer for a cold start)."""
    settle: Callable[[], object] | None = None
    """Run after each attempt, untimed (waiting for the multiplexer it started)."""
    values: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """How each turn that did not exit 0 ended; its sample is dropped."""

    def attempt(self) -> float | None:
        """Run the action once: its duration, or None (and a failure noted) if the turn failed."""
        if self.action is None:
            return None
        if self.prepare is not None:
            self.prepare()
        started = time.perf_counter()
        try:
            self.action()
        except TurnFailed as exc:
            self.failures.append(f"{self.name}: {exc}")
            return None
        took = time.perf_counter() - started
        if self.settle is not None:
            self.settle()
        return took


@dataclass
class Split:
    """Where one paddock turn's time went, seen from the client and from the target."""

    submit: list[float] = field(default_factory=list)
    follow: list[float] = field(default_factory=list)
    turn_ids: list[str] = field(default_factory=list)
    to_started: list[float] = field(default_factory=list)
    to_ended: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)

    def add_server_view(self, turn: Turn) -> None:
        if turn.started_at is not None:
            self.to_started.append((turn.started_at - turn.created_at).total_seconds())
        if turn.started_at is not None and turn.ended_at is not None:
            self.to_ended.append((turn.ended_at - turn.started_at).total_seconds())
        if turn.usage is not None:
            self.wall.append(turn.usage.wall_s)


def run(runs: int, slow_runs: int) -> str:
    """Measure every row and return the section's tables.

    Rows that start an interpreter or an SSH connection each time (``slow``)
    run in every k-th round only, about ``slow_runs`` times in all.
    """
    splits: dict[str, Split] = {}
    with contextlib.ExitStack() as stack:
        embedded = stack.enter_context(embedded_target())
        separate = stack.enter_context(target_process())
        embedded_client = stack.enter_context(embedded.client())
        separate_client = stack.enter_context(separate.client())
        rows = [
            *_baseline_rows(),
            _client_row("paddock client, embedded target", embedded_client, splits),
            _client_row("paddock client, target process", separate_client, splits),
            _events_to_end_row(stack.enter_context(separate.client())),
            *_http_floor_rows(separate, stack.enter_context(separate.client())),
            _api_row(API_HTTPS, stack.enter_context(separate.https()), "one request, streamed"),
            _cli_row(CLI_COLD, separate, ["--no-mux"], "in-process: imports, TLS, turn"),
            _cli_row(
                CLI_STARTING,
                separate,
                [],
                "mux stopped before each",
                prepare=lambda: _stop_mux(separate),
                settle=lambda: _warm_again(separate),
            ),
            _cli_row(CLI_WARM, separate, [], "mux started beforehand", slow=False, warm=True),
            *_ssh_rows(stack, separate),
        ]
        _measure(rows, runs, max(1, round(runs / slow_runs)))
        one_by_one = [
            *_bare_rows(),
            _api_row(API_HTTPS, stack.enter_context(separate.https()), "nothing else between"),
        ]
        _measure(one_by_one, ONE_BY_ONE * runs, 1)
        for name, client in (
            ("paddock client, embedded target", embedded_client),
            ("paddock client, target process", separate_client),
        ):
            split = splits[name]
            for turn_id in split.turn_ids[-runs:]:
                split.add_server_view(client.turn(turn_id))
    failures = [how for row in (*rows, *one_by_one) for how in row.failures]
    tables = [with_failures(_main_table(rows), failures), _split_table(splits, runs)]
    if _p50_of(rows, TUNNEL_PLAIN) is not None:
        tables.append(_tunnel_table(rows))
    tables.append(_cli_table(rows))
    tables.append(_one_by_one_table(one_by_one))
    return "\n\n".join(tables)


def _measure(rows: list[Row], runs: int, stride: int) -> None:
    for row in rows:
        for _ in range(1 if row.slow else WARMUP):
            row.attempt()
    for round_no in range(runs):
        for row in rows:
            if row.slow and round_no % stride:
                continue
            took = row.attempt()
            if took is not None:
                row.values.append(took)


def _bare_rows() -> list[Row]:
    return [
        Row(SPAWN, lambda: run_quiet(["/usr/bin/true"])),
        Row(BWRAP, lambda: run_quiet(BARE_BWRAP)),
    ]


def _baseline_rows() -> list[Row]:
    return [
        *_bare_rows(),
        Row("python -c pass", lambda: run_quiet([PYTHON, "-c", "pass"])),
        Row(
            "python -c 'import agent_side.cli'",
            lambda: run_quiet([PYTHON, "-c", "import agent_side.cli"], child_env()),
            "the CLI's imports",
            slow=True,
        ),
    ]


def _client_row(name: str, client: TargetClient, splits: dict[str, Split]) -> Row:
    split = splits.setdefault(name, Split())
    client.health()

    def one_turn() -> None:
        started = time.perf_counter()
        turn = client.submit(TRUE_REQUEST)
        submitted = time.perf_counter()
        _follow_to_exit(client, turn.turn_id)
        split.submit.append(submitted - started)
        split.follow.append(time.perf_counter() - submitted)
        split.turn_ids.append(turn.turn_id)

    return Row(name, one_turn, "submit + follow() to exit")


def _events_to_end_row(client: TargetClient) -> Row:
    client.health()

    def one_turn() -> None:
        turn = client.submit(TRUE_REQUEST)
        events = list(client.events(turn.turn_id))
        last = events[-1] if events else None
        if not isinstance(last, ExitEvent) or last.exit_code != 0:
            raise TurnFailed(turn_end(turn.turn_id, last, _stderr_of(events)))

    return Row("paddock client, events() to end", one_turn, "stream drained, connection kept")


def _http_floor_rows(target: TargetInfo, client: TargetClient) -> list[Row]:
    def fresh_client() -> None:
        with target.client() as fresh:
            fresh.health()

    return [
        Row("GET /v1/health, kept connection", client.health, "HTTP floor, no turn"),
        Row("GET /v1/health, new TLS connection", fresh_client, "HTTP floor + TLS handshake"),
    ]


def _cli_row(
    name: str,
    target: TargetInfo,
    options: list[str],
    note: str,
    *,
    slow: bool = True,
    prepare: Callable[[], object] | None = None,
    settle: Callable[[], object] | None = None,
    warm: bool = False,
) -> Row:
    """``python -m agent_side.cli run OPTIONS -- true`` as a whole process, stdin /dev/null.

    ``warm``: its multiplexer is started, and waited for, before the row is measured.
    """
    argv = [PYTHON, "-m", "agent_side.cli", "run", *options, "--", "true"]
    env = target.cli_env()
    if warm:
        warm_mux(env, options)

    def one() -> None:
        done = subprocess.run(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, check=False
        )
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[-STDERR_SHOWN:]
            raise TurnFailed(f"paddock run exited {done.returncode}; its stderr: {said!r}")

    return Row(name, one, note, slow=slow, prepare=prepare, settle=settle)


def _warm_again(target: TargetInfo) -> None:
    """After a run that started the multiplexer: wait for it and open the target through it."""
    env = target.cli_env()
    wait_for_mux(env)
    argv = [PYTHON, "-m", "agent_side.cli", "run", "--", "true"]
    subprocess.run(argv, cwd=REPO, env=env, capture_output=True, check=True)


def _stop_mux(target: TargetInfo) -> None:
    """``paddock mux stop`` for the target (not the others), and wait until its daemon has gone."""
    argv = [PYTHON, "-m", "agent_side.cli", "mux", "stop", "--json", "--target", target.url]
    done = subprocess.run(argv, cwd=REPO, env=target.cli_env(), capture_output=True, check=False)
    stopped = {json.loads(line)["pid"] for line in done.stdout.splitlines()}
    runtime = Path(os.environ["XDG_RUNTIME_DIR"])
    deadline = time.monotonic() + 10
    while stopped & set(mux_pids(runtime)) and time.monotonic() < deadline:
        time.sleep(0.01)


def _ssh_rows(stack: contextlib.ExitStack, target: TargetInfo) -> list[Row]:
    """OpenSSH's own rows, paddock's tunnel (Python API and CLI), and ``ssh -L`` forwarding.

    The tunnel rows reach the same target process as the HTTPS rows (TLS inside
    the channel) and a second one on plain HTTP, the listener a target reached
    only by SSH has.
    """
    missing = ssh_missing()
    if missing is not None:
        return [Row(f"ssh: skipped ({missing})", None)]
    ssh: LocalSsh = stack.enter_context(local_sshd())
    stack.enter_context(control_master(ssh))
    plain = stack.enter_context(target_process(tls=False))
    local_port = stack.enter_context(port_forward(ssh, int(plain.url.rsplit(":", 1)[1])))
    forwarded = replace(plain, url=f"http://127.0.0.1:{local_port}")
    tunnel_plain = stack.enter_context(plain.tunnel(ssh))
    via = ssh.paddock_options(target.url)
    tunnel = _cli_row(CLI_SSH, target, ["--no-mux", *via], "in-process paramiko connection")
    warm_tunnel = _cli_row(CLI_SSH_WARM, target, via, "mux's SSH connection", slow=False, warm=True)
    return [
        Row(SSH_FRESH, lambda: run_quiet(ssh.argv(["true"])), slow=True),
        Row(
            SSH_SHARED,
            lambda: run_quiet(ssh.argv(["true"], shared=True)),
            "master opened beforehand",
            slow=True,
        ),
        _api_row(API_PLAIN, stack.enter_context(plain.https()), "no TLS, no SSH"),
        _api_row(TUNNEL_TLS, stack.enter_context(target.tunnel(ssh)), "one SSH connection, reused"),
        _api_row(TUNNEL_PLAIN, tunnel_plain, "one SSH connection, reused"),
        _api_row(FORWARDED, stack.enter_context(forwarded.https()), "OpenSSH forwarding, plain"),
        Row(TUNNEL_HEALTH, tunnel_plain.health, "plain HTTP, kept channel"),
        Row(
            TUNNEL_CONNECT,
            lambda: _connect_once(plain, ssh),
            "handshake + auth each time",
            slow=True,
        ),
        tunnel,
        warm_tunnel,
    ]


def _api_row(name: str, target: Target, note: str) -> Row:
    """``Target.run(["true"])``: what agent code calls (an idempotent submit, then follow to
    the exit event, which carries the ended turn)."""
    target.health()

    def one_turn() -> None:
        seen: list[Event] = []
        result = target.run(["true"], on_event=seen.append)
        if result.exit_code != 0:
            last = seen[-1] if seen else None
            raise TurnFailed(turn_end(result.turn.turn_id, last, result.stderr))

    return Row(name, one_turn, note)


def _connect_once(target: TargetInfo, ssh: LocalSsh) -> None:
    with target.tunnel(ssh) as tunnel:
        tunnel.health()


def _follow_to_exit(client: TargetClient, turn_id: str) -> None:
    events = list(client.follow(turn_id))
    last = events[-1] if events else None
    if not isinstance(last, ExitEvent) or last.exit_code != 0:
        raise TurnFailed(turn_end(turn_id, last, _stderr_of(events)))


def _stderr_of(events: list[Event]) -> str:
    return "".join(
        e.data or "" for e in events if isinstance(e, OutputEvent) and e.kind == "stderr"
    )


def _main_table(rows: list[Row]) -> str:
    spawn = _p50_of(rows, SPAWN)
    bwrap = _p50_of(rows, BWRAP)
    out = []
    for row in rows:
        if not row.values:
            out.append([row.name, "", "", "", "", "", "", row.note])
            continue
        s = Samples(tuple(row.values))
        out.append(
            [
                row.name,
                str(len(s.values)),
                ms(s.p50),
                ms(s.p95),
                ms(s.mean),
                ratio(s.p50, bwrap),
                ratio(s.p50, spawn),
                row.note,
            ]
        )
    title = (
        "1. Turn latency, `true` (times in ms; rows interleaved round by round after warm-up;\n"
        "   'x bwrap' = row p50 / bare bwrap p50, 'x spawn' = row p50 / bare spawn p50)"
    )
    headers = ["row", "n", "p50", "p95", "mean", "x bwrap", "x spawn", "note"]
    return render_table(title, headers, out)


def _one_by_one_table(rows: list[Row]) -> str:
    """Table 1e: the turn against its baselines with nothing else in the round."""
    bwrap = _p50_of(rows, BWRAP)
    out = []
    for row in rows:
        if row.values:
            p50 = Samples(tuple(row.values)).p50
            out.append([row.name, str(len(row.values)), ms(p50), ratio(p50, bwrap), row.note])
    title = (
        "1e. The `true` turn one by one: bare spawn, bare bwrap and one Target.https turn\n"
        "    per round, nothing else between (ms; table 1 runs a dozen other rows between\n"
        "    two turns; 'x bwrap' = row p50 / bare bwrap p50 of these rounds)"
    )
    return render_table(title, ["row", "n", "p50", "x bwrap", "note"], out)


def _split_table(splits: dict[str, Split], runs: int) -> str:
    rows = []
    for name, split in splits.items():
        for label, values in (
            ("client: POST /v1/turns answered", split.submit[-runs:]),
            ("client: follow() to exit event", split.follow[-runs:]),
            ("target: created -> started", split.to_started),
            ("target: started -> ended", split.to_ended),
            ("target: bwrap process lifetime", split.wall),
        ):
            if values:
                s = Samples(tuple(values))
                rows.append(
                    [
                        f"{name.removeprefix('paddock client, ')}: {label}",
                        ms(s.p50),
                        ms(s.p95),
                        ms(s.mean),
                    ]
                )
    title = (
        "1b. Where a paddock client turn's time goes (ms; 'target:' rows are from the\n"
        "    Turn's created_at/started_at/ended_at and usage.wall_s)"
    )
    return render_table(title, ["part", "p50", "p95", "mean"], rows)


def _tunnel_table(rows: list[Row]) -> str:
    """Issue 5's comparison on its own: every row against ``Target.https`` in the same run."""
    https = _p50_of(rows, API_HTTPS)
    plain = _p50_of(rows, API_PLAIN)
    out = []
    for row in rows:
        if row.name in ISSUE_5_ROWS and row.values:
            s = Samples(tuple(row.values))
            out.append(
                [
                    row.name,
                    str(len(s.values)),
                    ms(s.p50),
                    ms(s.p95),
                    ratio(s.p50, https),
                    ratio(s.p50, plain),
                ]
            )
    title = (
        "1c. A turn over SSH (issue 5): paddock's tunnel vs HTTPS vs OpenSSH (ms, from table 1;\n"
        "    'x https' = row p50 / Target.https p50; 'x plain' = row p50 / p50 of Target.https\n"
        "    to the plain-HTTP listener that the plain tunnel and ssh -L rows reach)"
    )
    return render_table(title, ["row", "n", "p50", "p95", "x https", "x plain"], out)


def _cli_table(rows: list[Row]) -> str:
    """Issue 12's CLI rows: min/median/max, each median over the process baselines' medians."""
    bases = [_p50_of(rows, name) for name in (SPAWN, BWRAP, SSH_FRESH, SSH_SHARED)]
    out = []
    for row in rows:
        if row.name in CLI_ROWS and row.values:
            s = Samples(tuple(row.values))
            ratios = [ratio(s.p50, base) for base in bases]
            out.append([row.name, str(len(s.values)), ms(min(s.values)), ms(s.p50),
                        ms(max(s.values)), *ratios])  # fmt: skip
    title = (
        "1d. paddock run as a whole process (issue 12; ms, from table 1; the median over the\n"
        "    medians of bare spawn, bare bwrap, ssh true on a new connection, and over a\n"
        "    ControlMaster; stdin /dev/null, so each run also closes the turn's stdin)"
    )
    headers = ["row", "n", "min", "median", "max", "x spawn", "x bwrap", "x ssh", "x ssh CM"]
    return render_table(title, headers, out)


def _p50_of(rows: list[Row], name: str) -> float | None:
    for row in rows:
        if row.name == name and row.values:
            return Samples(tuple(row.values)).p50
    return None
