"""Checking and installing config files, and minting role tokens into them (seed 003, D4).

``check`` collects every problem rather than stopping at the first, so one run
tells the operator everything to fix. ``apply`` installs only a file that
checks clean, through ``safe_files.write_atomic``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import tomlkit

from target_side.config import Settings, parse_settings
from target_side.errors import ConfigError, UnsafeFileError
from target_side.safe_files import read_private, write_atomic
from target_side.service.auth import token_sha256


def check(path: Path) -> tuple[Settings | None, list[str]]:
    """The settings in ``path`` if usable, and every problem found (empty when clean)."""
    try:
        text = read_private(path, allow_group_read=True).decode("utf-8")
    except (UnsafeFileError, UnicodeDecodeError) as exc:
        return None, [str(exc)]
    try:
        settings = parse_settings(text, str(path))
    except ConfigError as exc:
        return None, [str(exc)]
    return settings, filesystem_problems(settings)


def filesystem_problems(settings: Settings) -> list[str]:
    """What the filesystem says is wrong with otherwise valid settings (missing dirs, open keys)."""
    problems = []
    for name, role in settings.roles.items():
        problems += [
            f"roles.{name}.workspaces: {w} does not exist (create it, or remove it)"
            for w in role.workspaces
            if not os.path.isdir(w)
        ]
    key = settings.server.tls_key
    if key is not None:
        try:
            read_private(Path(key))
        except UnsafeFileError as exc:
            problems.append(f"server.tls_key: {exc}")
    cert = settings.server.tls_cert
    if cert is not None and not os.path.isfile(cert):
        problems.append(f"server.tls_cert: {cert} does not exist")
    return problems


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
