"""The target's TOML configuration (DESIGN.md, "Target configuration").

Unknown keys and relative paths are errors that name them. ``Settings`` is a
plain value: ``create_app(settings)`` takes one, and nothing reads a global.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from target_side.errors import ConfigError, UnsafeFileError
from target_side.safe_files import read_private

DEFAULT_FENCE_PATH = "/usr/local/bin:/usr/bin:/bin"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _absolute(value: str, what: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{what} {value!r} is relative; write it as an absolute path")
    return value


class ServerConfig(_Section):
    """Where the target listens and keeps its state."""

    listen: str = "127.0.0.1:8443"
    tls_cert: str | None = None
    tls_key: str | None = None
    state_root: str = "/var/lib/paddock"
    heartbeat_s: float = Field(default=15.0, gt=0)
    retention_h: float = Field(default=24.0, gt=0)
    max_turns: int = Field(default=32, gt=0)
    """Turns running at once on this target; one more is answered 429 with Retry-After."""
    memory_mb: int | None = Field(default=None, gt=0)
    """Memory of all running turns together (their parent cgroup); default: 3/4 of the machine's."""
    pids: int = Field(default=4096, gt=0)
    """Processes and threads of all running turns together (their parent cgroup)."""
    stop_grace_s: float = Field(default=20.0, ge=0)
    """On SIGTERM, how long running turns may go on before they are killed and recorded."""
    max_connections: int = Field(default=512, gt=0)
    """Open client connections; past it, the oldest one still sending its request is closed."""
    request_timeout_s: float = Field(default=10.0, gt=0)
    """How long a client may take to send a whole request (TLS handshake, head, body)."""

    @field_validator("tls_cert", "tls_key", "state_root")
    @classmethod
    def _paths_absolute(cls, value: str | None) -> str | None:
        return None if value is None else _absolute(value, "path")

    @field_validator("listen")
    @classmethod
    def _listen_shape(cls, value: str) -> str:
        _, port = split_listen(value)
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is out of range 0..65535")
        return value

    @model_validator(mode="after")
    def _tls_or_loopback(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both tls_cert and tls_key, or neither")
        if self.tls_cert is None and not is_loopback(split_listen(self.listen)[0]):
            raise ValueError(
                f"listen = {self.listen!r} is not loopback, so TLS is required: "
                "set tls_cert and tls_key (plain HTTP is allowed only on 127.0.0.1 or ::1)"
            )
        return self

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


class FenceConfig(_Section):
    """How turns are fenced, for every role."""

    backend: Literal["bubblewrap", "none"] = "bubblewrap"
    on_unavailable: Literal["fail", "warn"] = "fail"
    path: str = DEFAULT_FENCE_PATH
    forbidden: tuple[str, ...] = ()

    @field_validator("path")
    @classmethod
    def _path_dirs_absolute(cls, value: str) -> str:
        for entry in value.split(":"):
            _absolute(entry, "fence PATH entry")
        return value

    @field_validator("forbidden")
    @classmethod
    def _forbidden_absolute(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_absolute(p, "forbidden path") for p in value)


class RoleLimits(_Section):
    """A role's maxima; a request may ask for less, never more."""

    wall_s: float = Field(default=3600, gt=0)
    memory_mb: int = Field(default=4096, gt=0)
    pids: int = Field(default=1024, gt=0)
    cpu: float = Field(default=2.0, gt=0)
    output_mb: int = Field(default=256, gt=0)
    turns: int | None = Field(default=None, gt=0)
    """This role's turns running at once (default: only ``[server] max_turns`` bounds them)."""


class RoleConfig(_Section):
    """One role: who may use it (by token hash) and what its turns may touch."""

    token_sha256: str
    workspaces: tuple[str, ...] = Field(min_length=1)
    allow_network: bool = False
    shared_ro: tuple[str, ...] = ()
    limits: RoleLimits = Field(default_factory=RoleLimits)

    @field_validator("token_sha256")
    @classmethod
    def _digest_shape(cls, value: str) -> str:
        if not _SHA256_HEX.fullmatch(value):
            raise ValueError(
                "token_sha256 must be 64 lowercase hex digits "
                "(use `paddock-target token mint ROLE` to make one)"
            )
        return value

    @field_validator("workspaces", "shared_ro")
    @classmethod
    def _paths_absolute(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_absolute(p, "path") for p in value)


class Settings(_Section):
    """The whole target configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    fence: FenceConfig = Field(default_factory=FenceConfig)
    roles: dict[str, RoleConfig] = Field(min_length=1)
    config_path: str | None = Field(default=None, exclude=True)

    @field_validator("roles")
    @classmethod
    def _role_names(cls, roles: dict[str, RoleConfig]) -> dict[str, RoleConfig]:
        for name in roles:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"role name {name!r} may use only letters, digits, '_', '.', '-'")
        return roles

    @property
    def state_root(self) -> Path:
        return Path(self.server.state_root)


def split_listen(listen: str) -> tuple[str, int]:
    """Split ``host:port`` (``[::1]:8443`` for IPv6) into host and port."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"listen = {listen!r} is not host:port (e.g. '127.0.0.1:8443')")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (names other than 'localhost' are not trusted)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_settings(text: str, source: str = "<config>") -> Settings:
    """Parse TOML text into ``Settings``; every problem is named in one ``ConfigError``."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(_describe(e) for e in exc.errors())) from exc
    return settings.model_copy(update={"config_path": source if source.startswith("/") else None})


def load_settings(path: str | Path) -> Settings:
    """Read (safely: no symlink, not world-readable, trusted ancestors) and parse ``path``."""
    source = str(path)
    if not source.startswith("/"):
        raise ConfigError(f"config path {source!r} is relative; give an absolute path")
    try:
        text = read_private(Path(source), allow_group_read=True).decode("utf-8")
    except UnsafeFileError as exc:
        raise ConfigError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source} is not UTF-8 text") from exc
    return parse_settings(text, source)


def _describe(error: ErrorDetails) -> str:
    """One problem from pydantic, worded around the TOML key it concerns."""
    key = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"unknown key '{key}' (check its spelling against DESIGN.md)"
    if error["type"] == "missing":
        return f"missing key '{key}'"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"'{key}': {message}"
