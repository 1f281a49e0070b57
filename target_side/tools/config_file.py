"""Checking and installing config files, and minting role tokens into them (safe_files).

``check`` collects every problem rather than stopping at the first, so one run
tells the operator everything to fix. ``apply`` installs only a file that
checks clean, through ``safe_files.write_atomic``.
"""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomlkit

from target_side.config import Settings, parse_settings, settings_from
from target_side.errors import ConfigError, LauncherError, UnsafeFileError
from target_side.fence.launcher_client import ViaLauncher
from target_side.policy import managed
from target_side.safe_files import read_private, write_atomic
from target_side.service.auth import token_sha256
from target_side.tools.identities import identity_problems


def check(path: Path) -> tuple[Settings | None, list[str]]:
    """The settings in ``path`` if usable, and every problem found (empty when clean).

    Never raises: a file that cannot be read is a problem like any other. Each
    problem names its key; only those about the file itself name the file.
    """
    try:
        text = read_private(path, allow_group_read=True).decode("utf-8")
    except UnsafeFileError as exc:
        return None, [str(exc)]
    except FileNotFoundError:
        return None, [f"{path} does not exist"]
    except OSError as exc:
        return None, [f"cannot read {path}: {exc.strerror}"]
    except UnicodeDecodeError:
        return None, [f"{path} is not UTF-8 text"]
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return None, [f"not valid TOML: {exc}"]
    settings, problems = settings_from(raw)
    if settings is not None:
        settings = settings.model_copy(update={"config_path": str(path)})
        problems += launcher_problems(settings)
    # The filesystem is checked even when a key is wrong, so one run shows everything.
    problems += _path_problems(raw)
    if settings is not None:
        problems += identity_problems(settings) + managed_problems(settings)
    return settings, problems


LAUNCHER_FIX = (
    'set launcher = "/run/paddock/launcher.sock" in [fence] and run `paddock-target launcher '
    "--config FILE` as root (paddock-deploy sets up both), or, for a private single-user "
    'target, identity = "server"'
)


def launcher_problems(settings: Settings) -> list[str]:
    """Why no turn could run as its role's uid in this process, if none could."""
    fence = settings.fence
    if fence.identity == "server" or fence.launcher is not None or os.getuid() == 0:
        return []
    return [
        f"fence: every turn would be refused: this process runs as uid {os.getuid()}, not root, "
        f"and [fence] launcher is not set: {LAUNCHER_FIX}"
    ]


async def identity_notes(settings: Settings) -> list[str]:
    """How turns get their role's uid with these settings, and whether the launcher answers."""
    fence = settings.fence
    if fence.identity == "server":
        return [
            'every turn runs as the server\'s own uid (identity = "server"): only the fence '
            "stands between a turn and the server's files"
        ]
    if fence.launcher is None:
        if os.getuid() != 0:
            return []
        return [
            "turns run as their role's uid only while the server runs as root: a server "
            f"running as another user refuses every turn until {LAUNCHER_FIX}"
        ]
    try:
        pid, hello = await ViaLauncher(fence.launcher).hello()
    except LauncherError as exc:
        return [f"{exc}; until it runs, every turn is refused"]
    if "error" in hello:
        return [
            f"the launcher at {fence.launcher} runs as root (pid {pid}) and serves only the "
            f"server's uid: {hello['error']}"
        ]
    return [
        f"turns run as their role's uid through the launcher at {fence.launcher} (pid {pid}, "
        f"root, paddock {hello.get('version')})"
    ]


def check_report(
    settings: Settings | None, problems: list[str], notes: list[str]
) -> dict[str, Any]:
    """``config check --json``: problems, notes, and the host ids each role's turns run as."""
    roles = {}
    if settings is not None:
        for name, role in settings.roles.items():
            uid, gid = settings.role_ids(name)
            roles[name] = {"uid": uid, "gid": gid, "workspaces": list(role.workspaces)}
    return {
        "ok": settings is not None and not problems,
        "problems": problems,
        "notes": notes,
        "roles": roles,
    }


def filesystem_problems(settings: Settings) -> list[str]:
    """What the filesystem says is wrong with otherwise valid settings (missing dirs, open keys,
    workspaces out of the roles' reach)."""
    return (
        _path_problems(settings.model_dump())
        + identity_problems(settings)
        + managed_problems(settings)
    )


def managed_problems(settings: Settings) -> list[str]:
    """Managed home entries the filesystem does not back (gone, a symlink, the wrong type)."""
    return [
        f"roles.{role}.home.{entry.kind}[{entry.index}]: {problem}"
        for role, config in settings.roles.items()
        for entry in managed.entries(config.home, settings.fence)
        if (problem := managed.file_problem(entry)) is not None
    ]


def _path_problems(raw: Mapping[str, Any]) -> list[str]:
    """Missing workspaces and TLS files, and a key others could read, in parsed TOML."""
    problems = []
    roles = raw.get("roles")
    for name, role in roles.items() if isinstance(roles, Mapping) else ():
        workspaces = role.get("workspaces") if isinstance(role, Mapping) else None
        problems += [
            f"roles.{name}.workspaces: {w} does not exist (create it, or remove it)"
            for w in _absolute_paths(workspaces)
            if not os.path.isdir(w)
        ]
    server = raw.get("server")
    server = server if isinstance(server, Mapping) else {}
    cert, key = _absolute(server.get("tls_cert")), _absolute(server.get("tls_key"))
    missing = [
        (name, path)
        for name, path in (("tls_cert", cert), ("tls_key", key))
        if path is not None and not os.path.lexists(path)
    ]
    for name, path in missing:
        problems.append(f"server.{name}: {path} does not exist")
    if missing:
        directory = os.path.dirname(missing[0][1])
        problems[-1] += (
            f" (make a certificate and key with: paddock-target tls init --dir {directory})"
        )
    if key is not None and os.path.lexists(key):
        try:
            read_private(Path(key))
        except UnsafeFileError as exc:
            problems.append(f"server.tls_key: {exc}")
        except OSError as exc:
            problems.append(f"server.tls_key: cannot read {key}: {exc.strerror}")
    if cert is not None and os.path.lexists(cert) and not os.path.isfile(cert):
        problems.append(f"server.tls_cert: {cert} is not a regular file")
    return problems


def _absolute(value: object) -> str | None:
    """``value`` if it is an absolute path string; anything else is the validation's to report."""
    return value if isinstance(value, str) and value.startswith("/") else None


def _absolute_paths(values: object) -> list[str]:
    """The absolute path strings among ``values``; the rest are the validation's to report."""
    if not isinstance(values, list | tuple):
        return []
    return [v for v in values if isinstance(v, str) and v.startswith("/")]


def apply(source: Path, destination: Path) -> Settings:
    """Install ``source`` at ``destination`` atomically, if and only if it checks clean."""
    settings, problems = check(source)
    if settings is None or problems:
        raise ConfigError(f"{source} was not applied: " + "; ".join(problems))
    write_atomic(destination, read_private(source, allow_group_read=True))
    return settings


def mint_token(path: Path, role: str) -> str:
    """A new token for ``role``; its hash replaces the role's in the config at ``path``.

    The token is returned to be shown once; only its hash is written anywhere.
    """
    try:
        document = tomlkit.parse(read_private(path, allow_group_read=True).decode("utf-8"))
    except UnsafeFileError as exc:
        raise ConfigError(str(exc)) from exc
    roles = document.get("roles")
    if roles is None or role not in roles:
        raise ConfigError(f"{path} has no role {role!r}; add a [roles.{role}] table first")
    token = secrets.token_urlsafe(32)
    roles[role]["token_sha256"] = token_sha256(token)
    text = tomlkit.dumps(document)
    parse_settings(text, str(path))  # never write a config the server would refuse
    write_atomic(path, text.encode())
    return token
