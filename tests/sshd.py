"""A real OpenSSH ``sshd`` on 127.0.0.1, with its own host key and authorized keys, in a temp dir.

Used by the SSH tests and the SSH benchmark. Nothing here touches the machine's
own ``/etc/ssh``: the server reads only the files written into ``root``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")
CLIENT_PASSPHRASE = "correct horse battery staple"
START_TIMEOUT_S = 10.0


def keygen(path: Path, *, passphrase: str = "", comment: str = "paddock-test") -> Path:
    """A fresh ed25519 key pair at ``path`` and ``path.pub``; returns ``path``."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Sshd:
    """One sshd listening on 127.0.0.1:``port``; ``start()``/``stop()`` or a ``with`` block."""

    root: Path
    port: int = 0
    settings: tuple[str, ...] = ()
    """More sshd_config lines (e.g. ``SetEnv TMPDIR=...``)."""
    host_key: Path = field(init=False)
    client_key: Path = field(init=False)
    locked_key: Path = field(init=False)
    """A client key protected by ``CLIENT_PASSPHRASE``; authorized like ``client_key``."""
    log: Path = field(init=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.host_key = keygen(self.root / "host_ed25519")
        self.client_key = keygen(self.root / "client_ed25519")
        self.locked_key = keygen(self.root / "locked_ed25519", passphrase=CLIENT_PASSPHRASE)
        authorized = self.root / "authorized_keys"
        keys = (Path(f"{key}.pub").read_bytes() for key in (self.client_key, self.locked_key))
        authorized.write_bytes(b"".join(keys))
        authorized.chmod(0o600)
        self.log = self.root / "sshd.log"

    @property
    def user(self) -> str:
        return pwd.getpwuid(os.getuid()).pw_name

    @property
    def destination(self) -> str:
        return f"{self.user}@127.0.0.1:{self.port}"

    @property
    def host_public_key(self) -> str:
        """``TYPE BASE64`` of the host key, as a known_hosts line carries it."""
        kind, blob, *_ = Path(f"{self.host_key}.pub").read_text().split()
        return f"{kind} {blob}"

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_public_key}\n"

    def write_known_hosts(self, path: Path) -> Path:
        path.write_text(self.known_hosts_line())
        return path

    def config_text(self) -> str:
        return "\n".join(
            [
                f"ListenAddress 127.0.0.1:{self.port}",
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                f"PidFile {self.root / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "AllowTcpForwarding yes",
                "AllowAgentForwarding no",
                "X11Forwarding no",
                "PrintMotd no",
                "LogLevel VERBOSE",
                "Subsystem sftp internal-sftp",  # in-process: no sftp-server binary needed
                *self.settings,
                "",
            ]
        )

    def start(self) -> Sshd:
        # sshd refuses to start without its privilege-separation directory.
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        for _ in range(3):  # another process may grab the free port before sshd binds it
            self.port = self.port or free_port()
            config = self.root / "sshd_config"
            config.write_text(self.config_text())
            with open(self.log, "ab") as log:
                self._proc = subprocess.Popen(
                    [SSHD, "-D", "-e", "-f", str(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            if self._wait_listening():
                return self
            self.stop()
            self.port = 0
        raise RuntimeError(f"sshd did not start; its log:\n{self.log.read_text()}")

    def _wait_listening(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as probe:
                    if probe.recv(4) == b"SSH-":
                        return True
            except OSError:
                time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self._proc is None:
            return
        self.kill_sessions()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def session_pids(self) -> list[int]:
        """Every process the listener forked: one group per SSH connection."""
        if self._proc is None:
            return []
        return _descendants(self._proc.pid)

    def kill_sessions(self) -> int:
        """SIGKILL every connection's sshd processes, as a crash or a dropped link would."""
        pids = self.session_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def accepted_logins(self) -> int:
        """How many public-key logins the server accepted so far (one per SSH connection)."""
        return self.log.read_text(errors="replace").count("Accepted publickey for ")

    def __enter__(self) -> Sshd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name in parentheses may hold spaces; the ppid follows the last ')'.
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found
