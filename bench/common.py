"""Helpers shared by every benchmark section: timing, statistics, tables, processes."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.wire import Event, RefusedEvent

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MIB = 1 << 20


@dataclass(frozen=True)
class Samples:
    """Durations (seconds) of repeated runs of one thing."""

    values: tuple[float, ...]

    @property
    def p50(self) -> float:
        return percentile(self.values, 50)

    @property
    def p95(self) -> float:
        return percentile(self.values, 95)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)


class TurnFailed(RuntimeError):
    """A measured turn did not exit 0: a finding about the target, not a broken bench.

    Rows drop that sample, count it, and print how the turn ended under their table.
    """


STDERR_SHOWN = 300
"""How much of a failed turn's stderr its report keeps (the end of it)."""


def turn_end(turn_id: str, last: Event | None, stderr: str | bytes) -> str:
    """How a turn ended, in one line: its terminal event, and the end of its stderr."""
    if isinstance(last, RefusedEvent):
        ended = f"refused ({last.refusal.rule}: {last.refusal.detail})"
    elif last is None:
        ended = "ended with no event"
    else:
        ended = f"ended with {last.kind} {getattr(last, 'exit_code', '')}".rstrip()
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    text = text.strip()[-STDERR_SHOWN:]
    said = f"; its stderr: {text!r}" if text else ""
    return f"turn {turn_id} {ended}{said}"


def with_failures(table: str, failures: Sequence[str], shown: int = 5) -> str:
    """``table``, then the first ``shown`` of ``failures`` (turns that did not exit 0)."""
    if not failures:
        return table
    lines = [f"  {how}" for how in failures[:shown]]
    if len(failures) > shown:
        lines.append(f"  ... and {len(failures) - shown} more")
    return "\n".join([table, f"turns that did not exit 0 ({len(failures)}):", *lines])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolating linearly between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_quiet(argv: Sequence[str], env: dict[str, str] | None = None) -> None:
    """Run ``argv`` to completion with no output; fail loudly if it does not exit 0."""
    done = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"{argv[0]} exited {done.returncode}: {detail}")


def child_env(**extra: str) -> dict[str, str]:
    """A small, predictable environment for child processes (nothing PADDOCK_* inherited).

    ``XDG_RUNTIME_DIR`` is passed on when set, so that the multiplexers
    ``paddock run`` starts live in ``mux_runtime``'s directory.
    """
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO),
    }
    if "XDG_RUNTIME_DIR" in os.environ:
        env["XDG_RUNTIME_DIR"] = os.environ["XDG_RUNTIME_DIR"]
    env.update(extra)
    return env


@contextlib.contextmanager
def mux_runtime() -> Iterator[Path]:
    """A private ``XDG_RUNTIME_DIR`` for the run: its multiplexers are stopped on leaving."""
    saved = os.environ.get("XDG_RUNTIME_DIR")
    with temp_dir("paddock-bench-run-") as runtime:
        runtime.chmod(0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
        try:
            yield runtime
        finally:
            stop_muxes(runtime)
            if saved is None:
                os.environ.pop("XDG_RUNTIME_DIR", None)
            else:
                os.environ["XDG_RUNTIME_DIR"] = saved


def warm_mux(env: dict[str, str], options: Sequence[str] = ()) -> None:
    """Start the multiplexer for the target ``env`` and ``options`` name, and wait until it serves.

    The first ``paddock run`` runs in-process and starts it; the daemon then
    loads, and answers ``paddock mux status`` once it is ready.
    """
    run = [PYTHON, "-m", "agent_side.cli", "run", *options, "--", "true"]
    subprocess.run(run, env=env, capture_output=True, check=True)
    wait_for_mux(env, options)
    # One more run, through it: the daemon opens the target (TLS, SSH) now.
    subprocess.run(run, env=env, capture_output=True, check=True)


def wait_for_mux(env: dict[str, str], options: Sequence[str] = ()) -> None:
    """Wait until the multiplexer for the target ``env`` and ``options`` name answers."""
    # Asked about this target only: another one's multiplexer may be up already.
    which = list(options) if "--ssh" in options else ["--target", env["PADDOCK_TARGET"]]
    status = [PYTHON, "-m", "agent_side.cli", "mux", "status", "--json", *which]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = subprocess.run(status, env=env, capture_output=True, check=False)
        if b'"t": "status"' in answer.stdout:
            return
        time.sleep(0.05)
    raise RuntimeError("the multiplexer did not come up within 30 s")


def mux_pids(runtime: Path) -> list[int]:
    """Pids of the live ``paddock mux serve`` processes whose sockets are under ``runtime``."""
    wanted = f"{runtime}/paddock-mux".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if b"serve" in cmdline and wanted in cmdline and state != "Z":
            found.append(int(entry))
    return found


def stop_muxes(runtime: Path, timeout: float = 10.0) -> None:
    """SIGTERM the multiplexers under ``runtime``; wait for them (SIGKILL after ``timeout``)."""
    for pid in mux_pids(runtime):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while mux_pids(runtime) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in mux_pids(runtime):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port`` (or ``proc`` dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout:g} s")


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it is still there after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    """A private temporary directory, removed afterwards whatever happens."""
    import tempfile

    path = Path(os.path.realpath(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ratio(value: float, base: float | None) -> str:
    if not base:
        return "-"
    r = value / base
    return f"{r:.2f}x" if r < 10 else f"{r:.0f}x"


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        right = [c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)]
        parts = [first.ljust(widths[0]), *right]
        return "  ".join(parts).rstrip()

    rule = "-" * len(line(["-" * w for w in widths]))
    out = [title, rule, line(headers), rule, *(line(r) for r in rows), rule]
    return "\n".join(out)


def tool_version(argv: Sequence[str]) -> str:
    """The first line a tool prints about its version, or why there is none."""
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        return "not installed"
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0] if text else f"exit {done.returncode}"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith("model name"):
                return row.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def fsync_cost(writes: int = 20) -> str:
    """p50 of fsync after a small append in a temporary directory: what durable records cost."""
    values = []
    with temp_dir("paddock-bench-fsync-") as path:
        fd = os.open(path / "probe", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        try:
            for _ in range(writes):
                os.write(fd, b"x" * 256 + b"\n")
                started = time.perf_counter()
                os.fsync(fd)
                values.append(time.perf_counter() - started)
        finally:
            os.close(fd)
    return f"p50 {ms(percentile(values, 50))} ms after a 257-byte append (temp dir)"


def new_file_cost(turns: int = 100) -> str:
    """p50 of making a file in one directory, as every turn's spool is made, where the
    benchmarks' state roots go (the temp dir), and what file system that is.

    Next to fsync, the cost that moves most between machines and days: on ext4 without a
    journal the kernel skips every inode freed in the last minutes when it picks a new one,
    so the same code measures slower on a disk that has just deleted much.
    """
    values = []
    with temp_dir("paddock-bench-files-") as path:
        for index in range(turns):
            started = time.perf_counter()
            spool = path / f"{index}.frames"
            os.close(os.open(spool, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
            values.append(time.perf_counter() - started)
        where = file_system(path)
    return f"p50 {ms(percentile(values, 50))} ms for a new file ({where})"


def file_system(path: Path) -> str:
    """The type and device of the mount holding ``path`` (ext4's journal said when absent)."""
    best: tuple[int, str, str] = (-1, "unknown", "")
    with contextlib.suppress(OSError):
        for row in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = row.split()
            point, after = fields[4], fields[fields.index("-") + 1 :]
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) > best[0]:
                best = (len(point), after[0], after[1])
    _, kind, device = best
    if kind == "ext4" and not _has_journal(device):
        return f"ext4 without a journal, {device}"
    return f"{kind}, {device}" if device not in ("", kind) else kind


def _has_journal(device: str) -> bool:
    # A journaled ext4 has its journal thread's entry, named after the device.
    name = Path(device).name
    with contextlib.suppress(OSError):
        return any(entry.name.startswith(f"{name}-") for entry in Path("/proc/fs/jbd2").iterdir())
    return False


def machine_facts() -> list[tuple[str, str]]:
    usable = len(os.sched_getaffinity(0))
    return [
        ("cores", f"{usable} usable of {os.cpu_count()} ({cpu_model()})"),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("bwrap", tool_version(["bwrap", "--version"])),
        ("ssh", tool_version(["ssh", "-V"])),
        ("python", f"{platform.python_version()} ({PYTHON})"),
        ("user", f"uid {os.getuid()}"),
        ("fsync", fsync_cost()),
        ("files", new_file_cost()),
    ]


def proc_status(pid: int) -> dict[str, str]:
    """``/proc/PID/status`` as a dict of its fields."""
    fields = {}
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = row.partition(":")
        fields[key] = value.strip()
    return fields


def kib_field(status: dict[str, str], name: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (VmRSS, VmHWM), in KiB."""
    return int(status[name].split()[0])


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU time so far, in seconds: the machine's busy and all, a process's own and its reaped
    children's (a target's fences: bubblewrap and what ran in it), and this process's."""

    busy: float
    total: float
    own: float
    children: float
    here: float

    @classmethod
    def take(cls, pid: int) -> CpuSnapshot:
        tick = os.sysconf("SC_CLK_TCK")
        # /proc/stat's first line: user nice system idle iowait irq softirq steal ...
        jiffies = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        idle = jiffies[3] + jiffies[4]
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        times = os.times()
        return cls(
            busy=(sum(jiffies) - idle) / tick,
            total=sum(jiffies) / tick,
            own=(int(fields[11]) + int(fields[12])) / tick,
            children=(int(fields[13]) + int(fields[14])) / tick,
            here=times.user + times.system,
        )

    def until(self, later: CpuSnapshot) -> CpuSnapshot:
        """What was spent between this snapshot and ``later``."""
        return CpuSnapshot(
            busy=later.busy - self.busy,
            total=later.total - self.total,
            own=later.own - self.own,
            children=later.children - self.children,
            here=later.here - self.here,
        )
