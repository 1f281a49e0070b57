"""Real paddock targets for the benchmarks, on 127.0.0.1.

Two shapes: ``embedded_target`` runs the server on a thread of this process
(``ServerThread``, as the tests do); ``target_process`` runs
``python -m target_side.tools.cli serve --config FILE`` as a separate process, so
its memory can be read and it does not share this process's GIL. Both speak
TLS; ``target_process(tls=False)`` listens on plain HTTP instead, as a target
reached only through SSH is deployed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent_side.api import Target
from agent_side.client import TargetClient
from agent_side.errors import AgentError
from bench.common import PYTHON, REPO, child_env, free_port, stop_process, tail, temp_dir
from bench.sshd import LocalSsh
from target_side.config import RoleConfig, RoleLimits, ServerConfig, Settings
from target_side.service.server import ServerThread
from target_side.tools.tls import make_tls_material

ROLE = "bench"
WALL_S = 600
OUTPUT_MB = 4096
"""Role maxima: far above what any section asks, so no limit shapes a measurement."""
MAX_TURNS = 512
MAX_CONNECTIONS = 2048
"""Target maxima, likewise: the memory section runs 200 turns at once, each followed."""


@dataclass(frozen=True)
class TargetInfo:
    """How to reach a running target as the benchmark role."""

    url: str
    token: str = field(repr=False)
    cacert: str
    workspace: str
    pid: int

    def client(self) -> TargetClient:
        return TargetClient(self.url, self.token, cacert=self.cacert)

    def https(self) -> Target:
        """The Python API's ``Target.https`` for this target (one connection pool)."""
        return Target.https(self.url, token=self.token, cacert=self.cacert, role=ROLE)

    def tunnel(self, ssh: LocalSsh) -> Target:
        """``Target.ssh``: every request through one SSH connection to the private sshd.

        Only the bench's client key is offered and only the sshd's host key
        trusted (no agent, nothing from ~/.ssh). Connects at once.
        """
        return Target.ssh(
            ssh.destination,
            token=self.token,
            url=self.url,
            cacert=self.cacert,
            role=ROLE,
            identity_files=[str(ssh.key)],
            known_hosts=[str(ssh.known_hosts)],
            ssh_config=None,
            use_agent=False,
        )

    def cli_env(self) -> dict[str, str]:
        """Environment for ``python -m agent_side.cli run`` against this target."""
        return child_env(
            PADDOCK_TARGET=self.url,
            PADDOCK_TOKEN=self.token,
            PADDOCK_CACERT=self.cacert,
            PADDOCK_ROLE=ROLE,
        )


@dataclass(frozen=True)
class _Root:
    """A target's private directory: TLS material, workspace, state."""

    path: Path
    token: str = field(repr=False)

    @property
    def workspace(self) -> Path:
        return self.path / "ws"

    @property
    def state(self) -> Path:
        return self.path / "state"

    @property
    def cacert(self) -> Path:
        return self.path / "tls" / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.path / "tls" / "cert.pem"

    @property
    def key(self) -> Path:
        return self.path / "tls" / "key.pem"

    @property
    def token_sha256(self) -> str:
        return hashlib.sha256(self.token.encode()).hexdigest()


def _prepare(path: Path) -> _Root:
    root = _Root(path, secrets.token_urlsafe(32))
    # The fence runs as nobody when the server is root: the workspace must be enterable.
    os.chmod(path, 0o755)
    root.workspace.mkdir(mode=0o755)
    (path / "tls").mkdir(mode=0o700)
    material = make_tls_material(["127.0.0.1"])
    for target, data in (
        (root.cacert, material.ca_cert_pem),
        (root.cert, material.cert_chain_pem),
        (root.key, material.key_pem),
    ):
        target.write_bytes(data)
        os.chmod(target, 0o600)
    return root


def _settings(root: _Root) -> Settings:
    role = RoleConfig(
        token_sha256=root.token_sha256,
        workspaces=(str(root.workspace),),
        limits=RoleLimits(wall_s=WALL_S, output_mb=OUTPUT_MB),
    )
    return Settings(
        server=ServerConfig(
            listen="127.0.0.1:0",
            tls_cert=str(root.cert),
            tls_key=str(root.key),
            state_root=str(root.state),
            max_turns=MAX_TURNS,
            max_connections=MAX_CONNECTIONS,
        ),
        roles={ROLE: role},
    )


def _config_toml(root: _Root, port: int, tls: bool) -> str:
    tls_lines = f'tls_cert = "{root.cert}"\ntls_key = "{root.key}"\n' if tls else ""
    return f"""\
[server]
listen = "127.0.0.1:{port}"
{tls_lines}state_root = "{root.state}"
max_turns = {MAX_TURNS}
max_connections = {MAX_CONNECTIONS}

[fence]
backend = "bubblewrap"

[roles.{ROLE}]
token_sha256 = "{root.token_sha256}"
workspaces = ["{root.workspace}"]
[roles.{ROLE}.limits]
wall_s = {WALL_S}
output_mb = {OUTPUT_MB}
"""


@contextlib.contextmanager
def embedded_target() -> Iterator[TargetInfo]:
    """A target on a thread of this process (uvicorn, TLS, bubblewrap)."""
    with temp_dir("paddock-bench-") as path:
        root = _prepare(path)
        with ServerThread(_settings(root)) as server:
            yield TargetInfo(
                server.url, root.token, str(root.cacert), str(root.workspace), os.getpid()
            )


SERVER_MODULE = "target_side.tools.cli"


@contextlib.contextmanager
def target_process(
    tls: bool = True, module: str = SERVER_MODULE, env: dict[str, str] | None = None
) -> Iterator[TargetInfo]:
    """A target as its own process, from a TOML config, stopped (SIGTERM) on leaving.

    ``tls=False``: plain HTTP on 127.0.0.1, the listener a target behind SSH has.
    ``module``: what ``python -m`` runs (a probe around the server, for ``bench/stages.py``),
    with ``env`` added to its environment.
    """
    with temp_dir("paddock-bench-") as path:
        root = _prepare(path)
        proc, info = _start_serving(root, tls, module, env or {})
        try:
            yield info
        finally:
            stop_process(proc)


def _start_serving(
    root: _Root, tls: bool, module: str, env: dict[str, str], tries: int = 3
) -> tuple[subprocess.Popen[bytes], TargetInfo]:
    """``serve`` on a port that was free a moment ago; another try if someone took it first."""
    config = root.path / "target.toml"
    log = root.path / "target.log"
    for attempt in range(1, tries + 1):
        port = free_port()
        config.write_text(_config_toml(root, port, tls))
        os.chmod(config, 0o600)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [PYTHON, "-m", module, "serve", "--config", str(config)],
                cwd=REPO,
                env=child_env(**env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        scheme = "https" if tls else "http"
        info = TargetInfo(
            f"{scheme}://127.0.0.1:{port}",
            root.token,
            str(root.cacert),
            str(root.workspace),
            proc.pid,
        )
        try:
            _wait_healthy(info, proc)
            return proc, info
        except RuntimeError as exc:
            stop_process(proc)
            if attempt == tries:
                raise RuntimeError(f"{exc}; its log:\n{tail(log)}") from exc
    raise AssertionError("unreachable")


def _wait_healthy(info: TargetInfo, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    with TargetClient(info.url, None, cacert=info.cacert) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the target process exited {proc.returncode}")
            try:
                client.health()
                return
            except AgentError:
                time.sleep(0.05)
    raise RuntimeError("the target process did not answer /v1/health within 20 s")
