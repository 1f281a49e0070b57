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
from target_side.errors import ConfigError, UnsafeFileError
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
    # The filesystem is checked even when a key is wrong, so one run shows everything.
    problems += _path_problems(raw)
    if settings is not None:
        problems += identity_problems(settings)
    return settings, problems


def filesystem_problems(settings: Settings) -> list[str]:
    """What the filesystem says is wrong with otherwise valid settings (missing dirs, open keys,
    workspaces out of the roles' reach)."""
    return _path_problems(settings.model_dump()) + identity_problems(settings)


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
    cert, key = server.get("tls_cert"), server.get("tls_key")
    missing = [
        (name, path)
        for name, path in (("tls_cert", cert), ("tls_key", key))
        if _absolute_paths([path]) and not os.path.lexists(path)
    ]
    for name, path in missing:
        problems.append(f"server.{name}: {path} does not exist")
    if missing:
        directory = os.path.dirname(missing[0][1])
        problems[-1] += (
            f" (make a certificate and key with: paddock-target tls init --dir {directory})"
        )
    if _absolute_paths([key]) and os.path.lexists(key):
        try:
            read_private(Path(key))
        except UnsafeFileError as exc:
            problems.append(f"server.tls_key: {exc}")
        except OSError as exc:
            problems.append(f"server.tls_key: cannot read {key}: {exc.strerror}")
    if _absolute_paths([cert]) and os.path.lexists(cert) and not os.path.isfile(cert):
        problems.append(f"server.tls_cert: {cert} is not a regular file")
    return problems


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
