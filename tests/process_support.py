"""Targets as real processes (``paddock-target serve``), for tests of what a process does:
signals, restarts, a second server, a full disk, a flood of connections.

Plain HTTP on 127.0.0.1 (which the config allows on loopback only): these
tests are about the process, and the TLS path has tests of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from conftest import BUILDER_TOKEN, OTHER_TOKEN, sha, wait_until

from shared.wire import EVENTS, Event

REPO = Path(__file__).resolve().parent.parent
HEADERS = {"Authorization": f"Bearer {BUILDER_TOKEN}"}
OTHER_HEADERS = {"Authorization": f"Bearer {OTHER_TOKEN}"}


def proc_status(path: str) -> dict[str, list[str]]:
    """A ``/proc/.../status`` file as its fields, each split into words."""
    return proc_fields(Path(path).read_text())


ABSTRACT_CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "try:\n    s.connect(b'\\0' + sys.argv[1].encode()); print(s.recv(64).decode())\n"
    "except OSError as e:\n    print(e.errno)\n"
)
"""A turn's program: connect to the abstract unix socket named by its argument, print what
it says, or the error number."""


@contextlib.contextmanager
def abstract_listener() -> Iterator[str]:
    """An abstract unix socket of this process's that answers "host secret"; its name (without
    the leading NUL), for ``ABSTRACT_CONNECT``."""
    name = f"paddock-test-{os.urandom(6).hex()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(b"\0" + name.encode())
    listener.listen(1)

    def answer() -> None:
        with contextlib.suppress(OSError):
            peer, _ = listener.accept()
            peer.sendall(b"host secret")
            peer.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield name
    finally:
        listener.close()


def socket_opening(family: str, kind: str) -> str:
    """A script printing ``open``, or the errno that opening a socket of ``family`` met."""
    return (
        "import socket\n"
        f"try:\n    socket.socket(socket.{family}, socket.{kind}); print('open')\n"
        "except OSError as e:\n    print(e.errno)\n"
    )


def signal_set(status: str, name: str = "SigIgn") -> set[int]:
    """The signals a ``/proc/PID/status`` text lists under ``name`` (``SigIgn``: ignored,
    ``SigCgt``: caught by a handler)."""
    mask = int(proc_fields(status)[name][0], 16)
    return {signum for signum in range(1, 65) if mask & (1 << (signum - 1))}


def proc_fields(text: str) -> dict[str, list[str]]:
    """A ``/proc/.../status`` text as its fields, each split into words."""
    return {key: value.split() for key, value in (line.split(":", 1) for line in text.splitlines())}


def parent_pid(pid: int | str) -> int:
    """The parent of process ``pid``; -1 once it is gone."""
    try:
        return int(proc_status(f"/proc/{pid}/status")["PPid"][0])
    except (OSError, KeyError):
        return -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(
    root: Path,
    state: Path | None = None,
    server: dict[str, object] | None = None,
    builder_limits: dict[str, object] | None = None,
) -> tuple[Path, str]:
    """A config for a plain-HTTP target under ``root`` (roles builder and other); (path, url)."""
    (root / "ws").mkdir(exist_ok=True)
    os.chmod(root, 0o755)
    os.chmod(root / "ws", 0o777)
    port = free_port()
    keys = {"listen": f"127.0.0.1:{port}", "state_root": str(state or root / "state")}
    keys |= {"heartbeat_s": 1.0} | (server or {})
    limits = {"wall_s": 120} | (builder_limits or {})
    text = "[server]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items())
    for role, token in (("builder", BUILDER_TOKEN), ("other", OTHER_TOKEN)):
        text += f'[roles.{role}]\ntoken_sha256 = "{sha(token)}"\nworkspaces = ["{root / "ws"}"]\n'
        if role == "builder":
            text += "[roles.builder.limits]\n"
            text += "".join(f"{k} = {_toml(v)}\n" for k, v in limits.items())
    config = root / "target.toml"
    config.write_text(text)
    config.chmod(0o600)
    return config, f"http://127.0.0.1:{port}"


def _toml(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


@dataclass
class TargetProcess:
    """One ``serve`` process; its stderr goes to ``log``."""

    config: Path
    url: str
    log: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @classmethod
    def start(
        cls, config: Path, url: str, log: Path, wait: bool = True, preexec: object = None
    ) -> TargetProcess:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "target_side.tools.cli", "serve", "--config", str(config)],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=preexec,  # type: ignore[arg-type]
            )
        started = cls(config, url, log, proc)
        if wait and not wait_until(started.up, timeout=30):
            started.kill()
            raise AssertionError(f"the target did not come up; its log:\n{log.read_text()}")
        return started

    def client(self, headers: dict[str, str] = HEADERS, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def up(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_kib(self) -> int:
        """The process's resident memory (``VmRSS``), KiB."""
        return int(proc_status(f"/proc/{self.proc.pid}/status")["VmRSS"][0])


@contextlib.contextmanager
def target_process(config: Path, url: str, log: Path) -> Iterator[TargetProcess]:
    started = TargetProcess.start(config, url, log)
    try:
        yield started
    finally:
        started.kill()


def follow_into(client: httpx.Client, turn_id: str, seen: list[Event]) -> threading.Thread:
    """A thread appending the turn's events to ``seen`` as they arrive, to the stream's end."""

    def read() -> None:
        with client.stream("GET", f"/v1/turns/{turn_id}/events") as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(EVENTS.validate_json(line[len("data: ") :]))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def wait_for_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.05)
    return proc.poll()
