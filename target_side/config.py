"""The target's TOML configuration (docs/configuration.md).

Unknown keys and relative paths are errors that name them. ``Settings`` is a
plain value: ``create_app(settings)`` takes one, and nothing reads a global.
"""

from __future__ import annotations

import hashlib
import itertools
import posixpath
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from shared.net import is_loopback
from shared.walk import is_within
from target_side.errors import ConfigError, UnsafeFileError
from target_side.policy.managed import KINDS, shape_problems
from target_side.safe_files import read_private

DEFAULT_FENCE_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_ID_POOL = "1900000000:65536"
"""Above the ranges that accounts, subordinate ids and container managers usually take."""
REPLACED_KEYS = {
    "shared_ro": "replaced by [roles.NAME.home] credentials, plugins and skills: typed, exact "
    "entries (see docs/configuration.md)",
}
FIXED_KEYS = {
    "fence.backend": 'paddock always runs turns in bubblewrap ("none" is gone); remove the key',
    "fence.on_unavailable": 'a target without a working fence refuses turns ("warn" is gone); '
    "remove the key",
}
"""Keys that once had a choice; configs written then still load with the one value left."""
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
    id_pool: str = DEFAULT_ID_POOL
    """``START:COUNT``: host uids (and gids) for roles that name no ``uid`` of their own."""
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

    @field_validator("id_pool")
    @classmethod
    def _pool_shape(cls, value: str) -> str:
        split_pool(value)
        return value

    @property
    def pool(self) -> tuple[int, int]:
        """The id pool as (first id, how many)."""
        return split_pool(self.id_pool)

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

    backend: Literal["bubblewrap"] = "bubblewrap"
    on_unavailable: Literal["fail"] = "fail"
    path: str = DEFAULT_FENCE_PATH
    forbidden: tuple[str, ...] = ()
    protect: tuple[str, ...] = ()
    """Names kept read-only inside writable mounts, on top of the built-in list."""
    plugin_roots: tuple[str, ...] = ()
    """Directories whose direct children a role's ``home.plugins`` may name."""
    skill_roots: tuple[str, ...] = ()
    """Directories whose direct children a role's ``home.skills`` may name."""
    plugin_dir: str = ".paddock/plugins"
    """Where plugins appear, relative to the role's home."""
    skill_dir: str = ".paddock/skills"
    """Where skills appear, relative to the role's home."""
    scan_limit: int = Field(default=100_000, gt=0)
    """How many directories of a writable mount are searched for protected names, at most."""
    launcher: str | None = None
    """The privileged launcher's socket: how a server that is not root runs turns as role uids."""
    identity: Literal["per-role", "server"] = "per-role"
    """``server`` runs every turn as the server's own uid: for a private, single-user target."""

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

    @field_validator("launcher")
    @classmethod
    def _launcher_absolute(cls, value: str | None) -> str | None:
        return None if value is None else _absolute(value, "launcher socket")

    @field_validator("plugin_roots", "skill_roots")
    @classmethod
    def _roots_exact(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for root in value:
            if not root.startswith("/") or posixpath.normpath(root) != root:
                raise ValueError(f"root {root!r} must be an exact absolute path (no '..', '//')")
        return value

    @field_validator("plugin_dir", "skill_dir")
    @classmethod
    def _place_relative(cls, value: str) -> str:
        if value.startswith(("/", "..")) or posixpath.normpath(value) != value:
            raise ValueError(f"{value!r} must be a plain relative path inside the home")
        return value

    def managed_roots(self, kind: str) -> tuple[str, ...]:
        return {"plugins": self.plugin_roots, "skills": self.skill_roots}.get(kind, ())

    def managed_place(self, kind: str) -> str:
        return {"plugins": self.plugin_dir, "skills": self.skill_dir}.get(kind, "")

    @field_validator("protect")
    @classmethod
    def _protect_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            parts = name.split("/")
            if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
                raise ValueError(
                    f"protect entry {name!r} must be a relative name such as '.envrc' "
                    "or '.vscode/tasks.json' (no '..', no leading '/')"
                )
        return value


class RoleLimits(_Section):
    """A role's maxima; a request may ask for less, never more."""

    wall_s: float = Field(default=3600, gt=0)
    memory_mb: int = Field(default=4096, gt=0)
    pids: int = Field(default=1024, gt=0)
    cpu: float = Field(default=2.0, gt=0)
    output_mb: int = Field(default=256, gt=0)
    scratch_mb: int = Field(default=1024, gt=0)
    file_mb: int = Field(default=1024, gt=0)
    """The most one file operation moves: a file read or written, an archive's body and what
    it unpacks to, a directory fetched as an archive."""
    turns: int | None = Field(default=None, gt=0)
    """This role's turns running at once (default: only ``[server] max_turns`` bounds them)."""
    session_s: float = Field(default=28800, gt=0)
    """How long one session of this role may live, at most."""
    session_idle_s: float = Field(default=1800, gt=0)
    """How long one session of this role may go without a turn, at most."""


class RoleHome(_Section):
    """What the operator hands a role in its home, read-only (``policy.managed``)."""

    credentials: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    skills: tuple[str, ...] = ()


class RoleConfig(_Section):
    """One role: who may use it (by token hash) and what its turns may touch."""

    token_sha256: str
    workspaces: tuple[str, ...] = Field(min_length=1)
    uid: int | None = Field(default=None, gt=0, lt=2**32 - 1)
    """The host uid this role's turns run as (default: a slot of ``[server] id_pool``)."""
    gid: int | None = Field(default=None, gt=0, lt=2**32 - 1)
    """The host gid (default: the same number as the uid)."""
    allow_network: bool = False
    require_lease: bool = False
    """Every turn of the role must name its seat's current lease (``service.leases``)."""
    home: RoleHome = Field(default_factory=lambda: RoleHome())
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

    @field_validator("workspaces")
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

    @model_validator(mode="after")
    def _roles_apart(self) -> Settings:
        seen: dict[int, str] = {}
        for name in self.roles:
            uid, _ = self.role_ids(name)
            if uid in seen:
                raise ValueError(
                    f"roles {seen[uid]!r} and {name!r} would both run as host uid {uid}; "
                    f"set a distinct uid for one of them ([roles.{name}] uid = ...)"
                )
            seen[uid] = name
        for (a, first), (b, second) in itertools.combinations(self.roles.items(), 2):
            for x, y in itertools.product(first.workspaces, second.workspaces):
                nx, ny = posixpath.normpath(x), posixpath.normpath(y)
                if nx != ny and (is_within(nx, ny) or is_within(ny, nx)):
                    raise ValueError(
                        f"workspace {x} of role {a!r} and {y} of role {b!r} overlap; "
                        "give each role its own directory, or list the very same one in both "
                        "to share it"
                    )
        return self

    @model_validator(mode="after")
    def _managed_entries_exact(self) -> Settings:
        problems = [
            f"roles.{name}.home.{problem}"
            for name, role in self.roles.items()
            for kind in KINDS
            for problem in shape_problems(
                kind,
                getattr(role.home, kind),
                self.fence.managed_roots(kind),
                self.fence.managed_place(kind),
            )
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def state_root(self) -> Path:
        return Path(self.server.state_root)

    def role_ids(self, role: str) -> tuple[int, int]:
        """The host uid and gid turns of ``role`` run as.

        A role's own ``uid`` wins; otherwise a slot of the id pool chosen from the
        role's name, so it is the same on every start and needs no state.
        """
        config = self.roles[role]
        if config.uid is not None:
            return config.uid, config.gid if config.gid is not None else config.uid
        first, size = self.server.pool
        slot = int.from_bytes(hashlib.sha256(role.encode()).digest()[:8], "big") % size
        uid = first + slot
        return uid, config.gid if config.gid is not None else uid


def split_pool(pool: str) -> tuple[int, int]:
    """Split ``START:COUNT`` into numbers, refusing a pool that reaches root or past 2**32-2."""
    start, sep, count = pool.partition(":")
    if not sep or not start.isdigit() or not count.isdigit():
        raise ValueError(f"id_pool = {pool!r} is not START:COUNT (e.g. '1900000000:65536')")
    first, size = int(start), int(count)
    if first < 1000 or size < 1 or first + size > 2**32 - 2:
        raise ValueError(
            f"id_pool = {pool!r} must start at 1000 or above, hold at least one id, "
            "and end below 4294967294"
        )
    return first, size


def split_listen(listen: str) -> tuple[str, int]:
    """Split ``host:port`` (``[::1]:8443`` for IPv6) into host and port."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"listen = {listen!r} is not host:port (e.g. '127.0.0.1:8443')")
    return host.strip("[]"), int(port)


def parse_settings(text: str, source: str = "<config>") -> Settings:
    """Parse TOML text into ``Settings``; every problem is named in one ``ConfigError``."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    settings, problems = settings_from(raw)
    if settings is None:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return settings.model_copy(update={"config_path": source if source.startswith("/") else None})


def settings_from(raw: dict[str, Any]) -> tuple[Settings | None, list[str]]:
    """``Settings`` from parsed TOML, or None and every problem, each naming its key."""
    try:
        return Settings.model_validate(raw), []
    except ValidationError as exc:
        return None, [_describe(e) for e in exc.errors()]


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
    if key in FIXED_KEYS and error["type"] == "literal_error":
        return f"'{key}': {FIXED_KEYS[key]}"
    if error["type"] == "extra_forbidden" and key.rsplit(".", 1)[-1] in REPLACED_KEYS:
        return f"'{key}' is {REPLACED_KEYS[key.rsplit('.', 1)[-1]]}"
    if error["type"] == "extra_forbidden":
        return f"unknown key '{key}' (check its spelling against docs/configuration.md)"
    if error["type"] == "missing":
        return f"missing key '{key}'"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"'{key}': {message}"
