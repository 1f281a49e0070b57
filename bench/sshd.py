"""A private OpenSSH server on 127.0.0.1, for comparing paddock with plain ssh.

Everything lives in one temporary directory: host key, client key,
authorized_keys, known_hosts, sshd_config, pid file, log and control socket.
The server runs in the foreground (``sshd -D``) as our child and is stopped
on leaving, as is the ControlMaster connection if one was opened.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port, run_quiet, stop_process, tail, temp_dir, wait_for_port

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
PRIVSEP_DIR = Path("/run/sshd")
"""sshd (as root) refuses to start, or to serve a connection, without this directory."""


def ssh_missing() -> str | None:
    """Why the ssh rows cannot run here, or None if they can."""
    for tool, package in ((SSHD, "sshd"), (SSH, "ssh client"), (SSH_KEYGEN, "ssh-keygen")):
        if not os.access(tool, os.X_OK):
            return f"{package} not installed"
    return None


@dataclass(frozen=True)
class LocalSsh:
    """How to reach the private sshd: ``argv(...)`` builds a complete ssh command."""

    port: int
    user: str
    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / "client_key"

    @property
    def control_path(self) -> Path:
        return self.directory / "cm.sock"

    @property
    def known_hosts(self) -> Path:
        """The server's host key, recorded by the first ``ssh`` run (accept-new)."""
        return self.directory / "known_hosts"

    @property
    def destination(self) -> str:
        """``USER@127.0.0.1:PORT``, as ``--ssh`` and ``Target.ssh`` take it."""
        return f"{self.user}@127.0.0.1:{self.port}"

    def options(self) -> list[str]:
        return [
            "-F",
            "/dev/null",
            "-T",
            "-i",
            str(self.key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "IdentityAgent=none",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-p",
            str(self.port),
        ]

    def paddock_options(self, target_url: str) -> list[str]:
        """``paddock run`` options that reach ``target_url`` through this sshd."""
        return [
            "--ssh",
            self.destination,
            "-i",
            str(self.key),
            "--known-hosts",
            str(self.known_hosts),
            "--target",
            target_url,
        ]

    def argv(self, remote: Sequence[str], *, shared: bool = False) -> list[str]:
        """``ssh ... user@127.0.0.1 REMOTE``; ``shared`` rides the ControlMaster connection."""
        control = ["-o", "ControlMaster=no", "-o", f"ControlPath={self.control_path}"]
        return [
            SSH,
            *self.options(),
            *(control if shared else []),
            f"{self.user}@127.0.0.1",
            *remote,
        ]


@contextlib.contextmanager
def local_sshd() -> Iterator[LocalSsh]:
    """Start sshd on a free loopback port with fresh keys; stop it and remove everything after."""
    with temp_dir("paddock-bench-ssh-") as directory:
        _ensure_privsep_dir()
        _make_keys(directory)
        proc, ssh = _start_sshd(directory)
        try:
            yield ssh
        finally:
            stop_process(proc)


def _start_sshd(directory: Path, tries: int = 3) -> tuple[subprocess.Popen[bytes], LocalSsh]:
    """sshd on a port that was free a moment ago; another try if someone took it first."""
    log = directory / "sshd.log"
    for attempt in range(1, tries + 1):
        ssh = LocalSsh(free_port(), getpass.getuser(), directory)
        config = _write_config(ssh)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for_port(ssh.port, proc)
            run_quiet(ssh.argv(["true"]))  # also records the host key
            return proc, ssh
        except RuntimeError as exc:
            stop_process(proc)
            if attempt == tries:
                raise RuntimeError(f"{exc}\nsshd log:\n{tail(log)}") from exc
    raise AssertionError("unreachable")


@contextlib.contextmanager
def control_master(ssh: LocalSsh) -> Iterator[None]:
    """One master connection (our child, in the foreground) that ``shared`` commands reuse."""
    proc = subprocess.Popen(
        [
            SSH,
            *ssh.options(),
            "-M",
            "-N",
            "-o",
            f"ControlPath={ssh.control_path}",
            "-o",
            "ControlPersist=no",
            f"{ssh.user}@127.0.0.1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_master(ssh, proc)
        yield
    finally:
        subprocess.run(
            [SSH, "-F", "/dev/null", "-o", f"ControlPath={ssh.control_path}", "-O", "exit", "x"],
            capture_output=True,
            check=False,
            timeout=10,
        )
        stop_process(proc)


@contextlib.contextmanager
def port_forward(ssh: LocalSsh, target_port: int) -> Iterator[int]:
    """``ssh -N -L``: a local port forwarded to 127.0.0.1:``target_port`` via the sshd; yields it.

    OpenSSH's own alternative to paddock's tunnel, as the README documents it.
    """
    local_port = free_port()
    proc = subprocess.Popen(
        [
            SSH,
            *ssh.options(),
            "-N",
            "-o",
            "ExitOnForwardFailure=yes",
            "-L",
            f"127.0.0.1:{local_port}:127.0.0.1:{target_port}",
            f"{ssh.user}@127.0.0.1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(local_port, proc)
        yield local_port
    finally:
        stop_process(proc)


def _wait_for_master(ssh: LocalSsh, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the ssh ControlMaster exited {proc.returncode}")
        check = subprocess.run(
            [SSH, "-F", "/dev/null", "-o", f"ControlPath={ssh.control_path}", "-O", "check", "x"],
            capture_output=True,
            check=False,
        )
        if check.returncode == 0:
            return
        time.sleep(0.05)
    raise RuntimeError("the ssh ControlMaster did not come up")


def _ensure_privsep_dir() -> None:
    """Make /run/sshd if we are root and it is missing, as the openssh-server package would.

    It is left in place afterwards: any other sshd on this machine needs it too.
    """
    if os.getuid() == 0:
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)


def _make_keys(directory: Path) -> None:
    for name in ("host_key", "client_key"):
        run_quiet([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)])
    authorized = directory / "authorized_keys"
    authorized.write_bytes((directory / "client_key.pub").read_bytes())
    os.chmod(authorized, 0o600)


def _write_config(ssh: LocalSsh) -> Path:
    d = ssh.directory
    config = d / "sshd_config"
    config.write_text(
        f"""\
ListenAddress 127.0.0.1
Port {ssh.port}
HostKey {d / "host_key"}
AuthorizedKeysFile {d / "authorized_keys"}
PidFile {d / "sshd.pid"}
StrictModes no
UsePAM no
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
PrintMotd no
X11Forwarding no
AllowTcpForwarding local
PermitOpen 127.0.0.1:*
AllowAgentForwarding no
"""
    )
    os.chmod(config, 0o600)
    return config
