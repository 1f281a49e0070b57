"""Section ``soak``: does a target under churn stay up and lose nothing?

    .venv/bin/python bench/soak.py [--minutes M]       # the same as run.py --only soak

For M minutes (2 by default), on 127.0.0.1 only, against a target process
serving plain HTTP (loopback; this section is about durability, not TLS):

- ``ROLES`` roles, each with ``SUBMITTERS`` client threads. Each thread submits
  a turn printing ``LINES`` numbered lines over about two seconds, follows it to
  its end with ``TargetClient.follow()`` (which resumes after a dropped
  connection or a restart from the last event it delivered), and submits the
  next. One role's clients reach the target through a proxy that cuts every
  connection every ``DROP_S``;
- every ``KILL_S`` the target is SIGKILLed and started again on the same state
  root, at once (the state-root lock is free the moment the process is gone);
- once, a turn prints until the state disk (a ``TMPFS_MB`` MiB tmpfs, as root)
  is full; ``FULL_S`` later the bench frees ``BALLAST_MB`` MiB it had put there
  and the target has to notice by itself.

Then every turn submitted is read again from its first event, and the table
says how many turns were submitted, finished, ended by the full disk, lost
with a killed target (recorded as lost, 125), or vanished (never recorded;
must be 0); how many bytes of output the target acknowledged (spooled, as a
fresh read from event 1 returns them) against the bytes the followers were
delivered (must be equal, turn by turn, digest included); what ``ledger
verify`` says once the last target has stopped; and the peak RSS and open
descriptors over every target process of the run. Bounded in time and count:
at most ``MAX_TURNS_PER_SUBMITTER`` turns per thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_side.client import RetryPolicy, TargetClient
from agent_side.errors import (
    AgentError,
    ConnectionDropped,
    ServiceUnavailable,
    TargetUnreachable,
)
from agent_side.turns import output_bytes
from bench.common import (
    MIB,
    PYTHON,
    REPO,
    child_env,
    free_port,
    kib_field,
    proc_status,
    render_table,
    stop_process,
    tail,
    temp_dir,
)
from bench.proxy import CuttingProxy, cutting_proxy
from shared.wire import Limits, NoticeEvent, OutputEvent, TurnRequest
from target_side.errors import LedgerError
from target_side.service import ledger

ROLES = 4
SUBMITTERS = 2
LINES = 60
TICK_S = 0.03
KILL_S = 20.0
DROP_S = 4.0
TMPFS_MB = 32
BALLAST_MB = 8
FULL_S = 4.0
MAX_TURNS_PER_SUBMITTER = 1000
SAMPLE_S = 0.25
START_TIMEOUT_S = 30.0
FOLLOW = RetryPolicy(budget_s=90.0)
"""Long enough to ride out a restart (a few seconds on 2 loaded cores) many times over."""
WORKER = ["sh", "-c", f'i=0; while [ $i -lt {LINES} ]; do echo "line $i of $PADDOCK_TURN_ID"; '
          f"i=$((i+1)); sleep {TICK_S:g}; done"]  # fmt: skip
FILLER = ["sh", "-c", "yes 'the state disk is filling up with this line'"]


@dataclass
class Followed:
    """One turn as its submitter saw it."""

    turn_id: str
    role: str
    delivered: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    error: str | None = None
    disk_notice: bool = False

    def take(self, data: bytes) -> None:
        self.delivered += len(data)
        self.digest.update(data)


@dataclass
class Soak:
    """What every thread of the run shares."""

    url: str
    tokens: dict[str, str]
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: list[Followed] = field(default_factory=list)
    unavailable: int = 0
    unreachable: int = 0
    restarts: int = 0
    filling: bool = False
    recovered_s: float | None = None
    """From freeing the ballast to health without the ``disk`` cause."""

    def count(self, what: str) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)


@dataclass
class Server:
    """The target process of the moment, and the peaks over all of them."""

    config: Path
    log: Path
    url: str
    proc: subprocess.Popen[bytes] | None = None
    peak_rss_kib: int = 0
    peak_fds: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            proc = subprocess.Popen(
                [PYTHON, "-m", "target_side.tools.cli", "serve", "--config", str(self.config)],
                cwd=REPO,
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        with self.lock:
            self.proc = proc
        _wait_up(self.url, proc, self.log)

    def kill(self) -> None:
        with self.lock:
            proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=30.0)

    def sample(self) -> None:
        with self.lock:
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(OSError, KeyError, ValueError):
            status = proc_status(proc.pid)
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
            self.peak_rss_kib = max(self.peak_rss_kib, kib_field(status, "VmHWM"))
            self.peak_fds = max(self.peak_fds, fds)


def run(minutes: float) -> str:
    """Soak a target for ``minutes`` and return the section's table."""
    with temp_dir("paddock-soak-") as path, _state_disk(path / "state") as disk_note:
        tokens = {f"r{i}": secrets.token_urlsafe(24) for i in range(ROLES)}
        tokens["filler"] = secrets.token_urlsafe(24)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = _write_config(path, port, tokens)
        server = Server(config, path / "target.log", url)
        server.start()
        soak = Soak(url, tokens)
        started = time.monotonic()
        try:
            with cutting_proxy(port) as proxy:
                threads = _start_threads(soak, server, proxy, path, minutes, disk_note is None)
                soak.stop.wait(minutes * 60)
                soak.stop.set()
                for thread in threads:
                    thread.join(FOLLOW.budget_s + 30)
            elapsed = time.monotonic() - started
            acknowledged = _acknowledged(soak)
        finally:
            server.stop()
        verdict = _verify(path / "state")
    return _table(soak, server, acknowledged, verdict, elapsed, disk_note)


@contextlib.contextmanager
def _state_disk(state: Path) -> Iterator[str | None]:
    """A small tmpfs as the state root (None), or why the disk part is skipped."""
    state.mkdir(mode=0o700)
    if os.getuid() != 0:
        yield "skipped: mounting a tmpfs needs root"
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m,mode=0700", "tmpfs", str(state)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        yield f"skipped: cannot mount a tmpfs ({mounted.stderr.strip()})"
        return
    try:
        (state / "ballast").write_bytes(b"\0" * (BALLAST_MB * MIB))
        yield None
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def _write_config(path: Path, port: int, tokens: dict[str, str]) -> Path:
    workspace = path / "ws"
    workspace.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    text = (
        f'[server]\nlisten = "127.0.0.1:{port}"\nstate_root = "{path / "state"}"\n'
        "heartbeat_s = 2.0\nstop_grace_s = 2.0\n"
    )
    for role, token in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        text += f'[roles.{role}]\ntoken_sha256 = "{digest}"\nworkspaces = ["{workspace}"]\n'
        output_mb = 4096 if role == "filler" else 16
        text += f"[roles.{role}.limits]\nwall_s = 120\noutput_mb = {output_mb}\n"
    config = path / "target.toml"
    config.write_text(text)
    os.chmod(config, 0o600)
    return config


def _start_threads(
    soak: Soak, server: Server, proxy: CuttingProxy, path: Path, minutes: float, fill: bool
) -> list[threading.Thread]:
    proxied = f"http://127.0.0.1:{proxy.port}"
    jobs: list[tuple[object, tuple[object, ...]]] = [
        (_submitter, (soak, role, proxied if role == "r0" else soak.url))
        for role in soak.tokens
        if role != "filler"
        for _ in range(SUBMITTERS)
    ]
    jobs += [(_killer, (soak, server)), (_cutter, (soak, proxy)), (_sampler, (soak, server))]
    if fill:
        jobs.append((_filler, (soak, path / "state", minutes * 60 / 3)))
    threads = [threading.Thread(target=job, args=args, daemon=True) for job, args in jobs]  # type: ignore[arg-type]
    for thread in threads:
        thread.start()
    return threads


def _submitter(soak: Soak, role: str, url: str) -> None:
    """Submit a turn, follow it to its end, again, until the run ends."""
    request = TurnRequest(role=role, argv=WORKER, limits=Limits(wall_s=60))
    with TargetClient(url, soak.tokens[role], retry=FOLLOW) as client:
        for _ in range(MAX_TURNS_PER_SUBMITTER):
            if soak.stop.is_set():
                return
            turn_id = _submit(soak, client, request)
            if turn_id is not None:
                _follow(soak, client, turn_id, role)


def _submit(soak: Soak, client: TargetClient, request: TurnRequest) -> str | None:
    """The id of the turn made, retrying (one key) through restarts; None if the run ended."""
    key = str(uuid.uuid4())
    while not soak.stop.is_set():
        try:
            return client.submit(request, idempotency_key=key).turn_id
        except ServiceUnavailable:
            soak.count("unavailable")  # disk full or stopping: nothing was made
        except (TargetUnreachable, ConnectionDropped):
            soak.count("unreachable")  # restarting; the same key finds the turn if it was made
        time.sleep(0.5)
    return None


def _follow(soak: Soak, client: TargetClient, turn_id: str, role: str) -> None:
    followed = Followed(turn_id, role)
    with soak.lock:
        soak.turns.append(followed)
    try:
        for event in client.follow(turn_id):
            if isinstance(event, OutputEvent):
                followed.take(output_bytes(event))
            elif isinstance(event, NoticeEvent) and "state disk refused" in event.message:
                followed.disk_notice = True
    except AgentError as exc:
        followed.error = f"{type(exc).__name__}: {exc}"


def _killer(soak: Soak, server: Server) -> None:
    """SIGKILL the target every ``KILL_S`` and start it again on the same state root."""
    while not soak.stop.wait(KILL_S):
        while soak.filling and not soak.stop.is_set():
            time.sleep(0.1)  # the fill is measured once, whole
        if soak.stop.is_set():
            return
        server.kill()
        server.start()
        soak.count("restarts")


def _cutter(soak: Soak, proxy: CuttingProxy) -> None:
    while not soak.stop.wait(DROP_S):
        proxy.cut()


def _sampler(soak: Soak, server: Server) -> None:
    while not soak.stop.wait(SAMPLE_S):
        server.sample()


def _filler(soak: Soak, state: Path, after_s: float) -> None:
    """Once: a turn that prints until the disk is full; then free the ballast."""
    if soak.stop.wait(after_s):
        return
    soak.filling = True
    try:
        with TargetClient(soak.url, soak.tokens["filler"], retry=FOLLOW) as client:
            turn_id = _submit(soak, client, TurnRequest(role="filler", argv=FILLER))
            if turn_id is None:
                return
            _follow(soak, client, turn_id, "filler")
            time.sleep(FULL_S)
            (state / "ballast").unlink()
            freed = time.monotonic()
            while time.monotonic() - freed < START_TIMEOUT_S:
                with contextlib.suppress(AgentError):
                    if all(c.cause != "disk" for c in client.health().causes):
                        soak.recovered_s = time.monotonic() - freed
                        break
                time.sleep(0.1)
    finally:
        soak.filling = False


@dataclass
class Acknowledged:
    """The target's side: every turn read again from event 1, once the run is over."""

    total: int = 0
    mismatched: list[str] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    vanished: int = 0


def _acknowledged(soak: Soak) -> Acknowledged:
    found = Acknowledged()
    for followed in soak.turns:
        with TargetClient(soak.url, soak.tokens[followed.role], retry=FOLLOW) as client:
            try:
                digest, size = hashlib.sha256(), 0
                for event in client.events(followed.turn_id):
                    if isinstance(event, OutputEvent):
                        data = output_bytes(event)
                        digest.update(data)
                        size += len(data)
                turn = client.turn(followed.turn_id)
            except AgentError:
                found.vanished += 1
                continue
        found.total += size
        state = "disk" if followed.disk_notice else turn.state
        found.states[state] = found.states.get(state, 0) + 1
        if (size, digest.hexdigest()) != (followed.delivered, followed.digest.hexdigest()):
            found.mismatched.append(
                f"{followed.turn_id}: {size} acknowledged, {followed.delivered} delivered"
                + (f" ({followed.error})" if followed.error else "")
            )
    return found


def _verify(state: Path) -> str:
    try:
        verified = ledger.verify(state)
    except LedgerError as exc:
        return f"DAMAGED: {exc}"
    text = (state / ledger.LEDGER).read_text()
    recoveries = text.count('"kind":"recovery"')
    return f"ok, {verified.count} records ({recoveries} recovery)"


def _wait_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with TargetClient(url, None) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the target exited {proc.returncode}; its log:\n{tail(log)}")
            try:
                client.health()
                return
            except AgentError:
                time.sleep(0.05)
    raise RuntimeError(f"the target did not answer within {START_TIMEOUT_S:g} s:\n{tail(log)}")


def _table(
    soak: Soak,
    server: Server,
    found: Acknowledged,
    verdict: str,
    elapsed: float,
    disk_note: str | None,
) -> str:
    delivered = sum(t.delivered for t in soak.turns)
    equal = "equal" if delivered == found.total and not found.mismatched else "DIFFERENT"
    states = found.states
    rows = [
        ["turns submitted (201 received)", str(len(soak.turns))],
        ["  finished (exit or refused)", str(states.get("exited", 0) + states.get("refused", 0))],
        ["  ended by the full disk (125, notice)", str(states.get("disk", 0))],
        ["  lost with a killed target (125, recorded)", str(states.get("lost", 0))],
        ["  vanished (unknown after restarts)", str(found.vanished)],
        ["  still running at the end", str(states.get("running", 0))],
        ["submissions answered 503 (disk full, stopping)", str(soak.unavailable)],
        ["disk cause cleared after space was freed", _seconds(soak.recovered_s, disk_note)],
        ["submissions retried through a restart", str(soak.unreachable)],
        ["bytes acknowledged (spooled, read again)", f"{found.total:,}"],
        ["bytes delivered (followers)", f"{delivered:,}"],
        ["  acknowledged vs delivered", f"{equal} ({len(found.mismatched)} turns differ)"],
        ["ledger verify (after the last stop)", verdict],
        ["target restarts (SIGKILL)", str(soak.restarts)],
        ["peak RSS of a target process (VmHWM)", f"{server.peak_rss_kib / 1024:.1f} MiB"],
        ["peak open descriptors of a target process", str(server.peak_fds)],
    ]
    disk = disk_note or f"one turn filled a {TMPFS_MB} MiB tmpfs state root"
    title = (
        f"5. Soak ({elapsed / 60:.1f} min on 127.0.0.1, plain HTTP): {ROLES} roles x "
        f"{SUBMITTERS} clients,\n   SIGKILL + restart every {KILL_S:g} s, proxy cuts "
        f"every {DROP_S:g} s (role r0),\n   disk: {disk}"
    )
    table = render_table(title, ["what", "value"], rows)
    if found.mismatched:
        table += "\nturns whose bytes differ:\n" + "\n".join(f"  {m}" for m in found.mismatched[:5])
    errors = [f"  {t.turn_id}: {t.error}" for t in soak.turns if t.error][:5]
    if errors:
        table += "\nfollowers that gave up:\n" + "\n".join(errors)
    return table


def _seconds(value: float | None, disk_note: str | None) -> str:
    if disk_note is not None:
        return "-"
    return "never (within 30 s)" if value is None else f"{value:.1f} s"


if __name__ == "__main__":
    from bench.suite import main

    sys.exit(main([*sys.argv[1:], "--only", "soak"]))
