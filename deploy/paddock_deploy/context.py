"""One run of the deploy: its options, what the steps found, and what they changed.

Each step (``paddock_deploy.steps``) takes the ``Context``, reads what earlier
steps found, records what it found, registers the undo of every change with
``ctx.tx``, and returns an ``Outcome``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paddock_deploy.commands import run, shown
from paddock_deploy.errors import DeployError
from paddock_deploy.files import write_file
from paddock_deploy.progress import Progress
from paddock_deploy.service_user import Account
from paddock_deploy.systemd_unit import LAUNCHER_UNIT_NAME, UNIT_DIR, UNIT_NAME
from paddock_deploy.transaction import Transaction

CONFIG_NAME = "target.toml"
SUPERVISOR_NAME = "paddock-supervise"
DEFAULT_LISTEN = "127.0.0.1:8443"
DEFAULT_STATE_ROOT = "/var/lib/paddock"


@dataclass
class Outcome:
    """What a step did: whether it changed the host, and a sentence saying what."""

    changed: bool
    detail: str


@dataclass(frozen=True)
class Wheel:
    """The paddock wheel being deployed."""

    path: Path
    version: str
    sha256: str

    @property
    def release_id(self) -> str:
        return f"{self.version}-{self.sha256[:12]}"


@dataclass
class Context:
    """One run of the deploy: the options, what it found, and what it changed."""

    opts: argparse.Namespace
    progress: Progress
    tx: Transaction = field(default_factory=Transaction)
    wheel: Wheel | None = None
    account: Account | None = None
    mode: str = "supervised"
    previous: Path | None = None
    release: Path | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    restart_reasons: list[str] = field(default_factory=list)
    service_changed: bool = False
    existing: dict[str, Any] | None = None
    state_root: Path = Path(DEFAULT_STATE_ROOT)
    listen: str = ""
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    was_running: bool = False
    server_pid: int | None = None
    health: dict[str, Any] = field(default_factory=dict)
    role_ids: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each role's host uid and gid, as the config gives them (``config check --json``)."""

    # -- paths

    @property
    def prefix(self) -> Path:
        return Path(self.opts.prefix)

    @property
    def releases(self) -> Path:
        return self.prefix / "releases"

    @property
    def current_link(self) -> Path:
        return self.prefix / "current"

    @property
    def config_file(self) -> Path:
        return Path(self.opts.config_dir) / CONFIG_NAME

    @property
    def tls_dir(self) -> Path:
        return Path(self.opts.config_dir) / "tls"

    @property
    def supervisor(self) -> Path:
        return self.prefix / "bin" / SUPERVISOR_NAME

    @property
    def supervisor_settings(self) -> Path:
        return self.supervisor.with_name(SUPERVISOR_NAME + ".json")

    @property
    def unit_file(self) -> Path:
        return UNIT_DIR / UNIT_NAME

    @property
    def launcher_unit_file(self) -> Path:
        return UNIT_DIR / LAUNCHER_UNIT_NAME

    @property
    def launcher_socket(self) -> Path:
        return Path(self.opts.launcher_socket)

    @property
    def launcher_dir(self) -> Path:
        """Supervised mode: the launcher keeper's pid files and log, root's alone."""
        return self.prefix / "launcher"

    @property
    def command_link(self) -> Path:
        """``paddock-target`` on root's PATH, a symlink into the current release."""
        return Path(self.opts.bin_dir) / "paddock-target"

    @property
    def current_command(self) -> Path:
        return self.current_link / "bin" / "paddock-target"

    # -- what earlier steps found

    def need_account(self) -> Account:
        if self.account is None:
            raise DeployError("internal: the service user is not known yet")
        return self.account

    def need_release(self) -> Path:
        if self.release is None:
            raise DeployError("internal: the release is not known yet")
        return self.release

    def need_wheel(self) -> Wheel:
        if self.wheel is None:
            raise DeployError("internal: the wheel is not known yet")
        return self.wheel

    def target_bin(self) -> str:
        return str(self.need_release() / "bin" / "paddock-target")

    # -- doing things

    def run(
        self, argv: list[str], *, what: str | None = None, **options: Any
    ) -> subprocess.CompletedProcess[str]:
        """``commands.run`` with a heartbeat on the progress output while it runs."""
        return run(argv, waiting=self.progress.waiting(what or shown(argv)), **options)

    def ensure_dir(self, path: Path, mode: int, uid: int, gid: int) -> str | None:
        """Create ``path`` (and missing parents, root-owned 0755) unless it exists."""
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise DeployError(f"{path} exists and is not a directory")
        if path.exists():
            return None
        top = next(p for p in (*reversed(path.parents), path) if not p.exists())
        self.tx.on_failure(f"remove {top}", lambda: shutil.rmtree(top, ignore_errors=True))
        for missing in (*reversed(path.parents), path):
            if not missing.exists():
                missing.mkdir()
                os.chown(missing, 0, 0)
                os.chmod(missing, 0o755)  # noqa: S103 - a directory others must traverse
        os.chown(path, uid, gid)
        os.chmod(path, mode)
        return f"created {path}"

    def write_new(self, path: Path, data: bytes, mode: int, uid: int, gid: int) -> None:
        """Write a file that did not exist; the undo removes it."""
        self.tx.on_failure(f"remove {path}", lambda: path.unlink(missing_ok=True))
        write_file(path, data, mode, uid, gid)
