"""Section ``latency``: how long a turn running ``true`` takes, end to end, against baselines."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from agent_side.client import TargetClient
from bench.common import (
    PYTHON,
    REPO,
    Samples,
    child_env,
    ms,
    ratio,
    render_table,
    run_quiet,
    time_runs,
)
from bench.sshd import control_master, local_sshd, ssh_missing
from bench.targets import ROLE, TargetInfo, embedded_target, target_process
from shared.wire import TERMINAL_KINDS, Turn, TurnRequest

BARE_BWRAP = [
    "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
    "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL",
    "--die-with-parent", "--new-session",
    "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64",
    "--proc", "/proc", "--dev", "/dev",
    "--", "/usr/bin/true",
]
"""bubblewrap with the process flags of paddock's fence, and only /usr mounted."""

TRUE_REQUEST = TurnRequest(role=ROLE, argv=["true"])


@dataclass
class Row:
    name: str
    samples: Samples | None
    note: str = ""


@dataclass
class Split:
    """Where one paddock turn's time went, seen from the client and from the target."""

    submit: list[float] = field(default_factory=list)
    follow: list[float] = field(default_factory=list)
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


def run(runs: int) -> str:
    """Measure every row and return the section's tables."""
    rows: list[Row] = [
        Row("spawn /usr/bin/true", time_runs(lambda: run_quiet(["/usr/bin/true"]), runs)),
        Row("bwrap, fence flags, true", time_runs(lambda: run_quiet(BARE_BWRAP), runs)),
        Row("python -c pass", time_runs(lambda: run_quiet([PYTHON, "-c", "pass"]), runs)),
        Row(
            "python -c 'import agent_side.cli'",
            time_runs(
                lambda: run_quiet([PYTHON, "-c", "import agent_side.cli"], child_env()), runs
            ),
        ),
    ]
    rows += _ssh_rows(runs)
    splits: dict[str, Split] = {}
    with embedded_target() as target:
        rows.append(_client_row("paddock client, embedded target", target, runs, splits))
    with target_process() as target:
        rows.append(_client_row("paddock client, target process", target, runs, splits))
        rows.append(_events_to_end_row(target, runs))
        rows += _http_floor_rows(target, runs)
        rows.append(_cli_row(target, runs))
    return "\n\n".join([_main_table(rows), _split_table(splits)])


def _ssh_rows(runs: int) -> list[Row]:
    missing = ssh_missing()
    if missing is not None:
        return [Row("ssh", None, f"ssh: skipped ({missing})")]
    with local_sshd() as ssh:
        fresh = time_runs(lambda: run_quiet(ssh.argv(["true"])), runs)
        with control_master(ssh):
            shared = time_runs(lambda: run_quiet(ssh.argv(["true"], shared=True)), runs)
    return [
        Row("ssh 127.0.0.1 true, new connection", fresh),
        Row("ssh 127.0.0.1 true, ControlMaster", shared),
    ]


def _client_row(name: str, target: TargetInfo, runs: int, splits: dict[str, Split]) -> Row:
    split = Split()
    turn_ids: list[str] = []
    with target.client() as client:
        client.health()

        def one_turn() -> None:
            started = time.perf_counter()
            turn = client.submit(TRUE_REQUEST)
            submitted = time.perf_counter()
            _follow_to_exit(client, turn.turn_id)
            split.submit.append(submitted - started)
            split.follow.append(time.perf_counter() - submitted)
            turn_ids.append(turn.turn_id)

        samples = time_runs(one_turn, runs)
        for turn_id in turn_ids[-runs:]:
            split.add_server_view(client.turn(turn_id))
    split.submit, split.follow = split.submit[-runs:], split.follow[-runs:]
    splits[name] = split
    return Row(name, samples, "submit + follow to exit")


def _events_to_end_row(target: TargetInfo, runs: int) -> Row:
    with target.client() as client:
        client.health()

        def one_turn() -> None:
            turn = client.submit(TRUE_REQUEST)
            kinds = [event.kind for event in client.events(turn.turn_id)]
            if not TERMINAL_KINDS.intersection(kinds):
                raise RuntimeError(f"turn {turn.turn_id} stream ended without exit: {kinds}")

        samples = time_runs(one_turn, runs)
    return Row("paddock client, events() read to end", samples, "stream drained: keeps connection")


def _http_floor_rows(target: TargetInfo, runs: int) -> list[Row]:
    with target.client() as client:
        kept = time_runs(client.health, runs)

    def fresh_client() -> None:
        with target.client() as client:
            client.health()

    fresh = time_runs(fresh_client, runs)
    return [
        Row("GET /v1/health, kept connection", kept, "HTTP floor, no turn"),
        Row("GET /v1/health, new TLS connection", fresh, "HTTP floor + TLS handshake"),
    ]


def _cli_row(target: TargetInfo, runs: int) -> Row:
    argv = [PYTHON, "-m", "agent_side.cli", "run", "--", "true"]
    env = target.cli_env()

    def one() -> None:
        done = subprocess.run(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"paddock run exited {done.returncode}: {done.stderr.decode()}")

    return Row("paddock run -- true (CLI process)", time_runs(one, runs), "incl. interpreter start")


def _follow_to_exit(client: TargetClient, turn_id: str) -> None:
    last = None
    for event in client.follow(turn_id):
        last = event
    if last is None or last.kind != "exit" or getattr(last, "exit_code", None) != 0:
        raise RuntimeError(f"turn {turn_id} did not exit 0: {last}")


def _main_table(rows: list[Row]) -> str:
    spawn = _p50_of(rows, "spawn /usr/bin/true")
    bwrap = _p50_of(rows, "bwrap, fence flags, true")
    out = []
    for row in rows:
        if row.samples is None:
            out.append([row.note, "", "", "", "", "", ""])
            continue
        s = row.samples
        out.append([
            row.name, ms(s.p50), ms(s.p95), ms(s.mean),
            ratio(s.p50, bwrap), ratio(s.p50, spawn), row.note,
        ])
    runs = max((len(r.samples.values) for r in rows if r.samples), default=0)
    title = (
        f"1. Turn latency, `true` ({runs} runs per row after 2 warm-up runs; times in ms;\n"
        "   'x bwrap' = row p50 / bare bwrap p50, 'x spawn' = row p50 / bare spawn p50)"
    )
    headers = ["row", "p50", "p95", "mean", "x bwrap", "x spawn", "note"]
    return render_table(title, headers, out)


def _split_table(splits: dict[str, Split]) -> str:
    rows = []
    for name, split in splits.items():
        for label, values in (
            ("client: POST /v1/turns answered", split.submit),
            ("client: follow() until exit event", split.follow),
            ("target: created -> started", split.to_started),
            ("target: started -> ended", split.to_ended),
            ("target: bwrap process lifetime", split.wall),
        ):
            if values:
                s = Samples(tuple(values))
                rows.append([f"{name}: {label}", ms(s.p50), ms(s.p95), ms(s.mean)])
    title = "1b. Where a paddock turn's time goes (ms)"
    return render_table(title, ["part", "p50", "p95", "mean"], rows)


def _p50_of(rows: list[Row], name: str) -> float | None:
    for row in rows:
        if row.name == name and row.samples is not None:
            return row.samples.p50
    return None

