"""The agent side's stored targets: what ``paddock deploy`` learnt, for ``paddock run -t NAME``.

    $XDG_CONFIG_HOME/paddock/            (else ~/.config/paddock)    0700
      targets.toml                       one table per target        0600
      targets/NAME/ca.pem                the pinned CA               0600
      targets/NAME/token-ROLE            one token per role          0600

``targets.toml`` holds no secret, so it can be read and edited freely:

    [targets."build-host"]
    route = "ssh"                          # or "https": straight to url from here
    ssh = "root@build-host"                # how paddock deploy reached the host
    url = "https://127.0.0.1:8443"         # route ssh: the listener as seen from that host
    identity_files = []                    # -i and --known-hosts given to paddock deploy
    known_hosts = []
    ca_file = "targets/build-host/ca.pem"  # relative paths are below this directory
    ca_sha256 = "AB:CD:..."                # the CA file must still hash to this
    default_role = "builder"
    release = "0.1.0-0123456789ab"
    deployed_at = "2026-01-02T03:04:05+00:00"

    [targets."build-host".tokens]
    builder = "targets/build-host/token-builder"

    [pools.ci]                             # a named list of stored targets
    targets = ["build-host", "build-2"]    # each must be a [targets.NAME] above

Pools are written by hand for now and kept as they are when ``paddock deploy``
rewrites the file; ``paddock run -t POOL`` sends a turn to one of them
(``agent_side.pools``).

Every file is written whole to a temporary name beside it and renamed over the
old one, so a crash leaves the old file or the new one, never half of either.
A key this module does not know is an error that names it: a misspelt
``default_role`` must not quietly mean "no default".
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent_side.errors import UsageError
from agent_side.user_files import config_dir, locked, private_dir, write_private
from paddock_deploy.protocol import certificate_sha256

INDEX_NAME = "targets.toml"
ROUTES = ("ssh", "https")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
"""Entry names: host names, IP addresses (IPv6 too) and aliases; never a path."""
ENTRY_KEYS = frozenset(
    {
        "route",
        "url",
        "ssh",
        "identity_files",
        "known_hosts",
        "ca_file",
        "ca_sha256",
        "cert_sha256",
        "tokens",
        "default_role",
        "release",
        "deployed_at",
    }
)
"""The keys a ``[targets.NAME]`` table may hold."""
POOL_KEYS = frozenset({"targets"})
"""The keys a ``[pools.NAME]`` table may hold."""
_HEADER = (
    "# paddock's targets, written by `paddock deploy`; `paddock run -t NAME` reads them.\n"
    "# Tokens and CA certificates are in the files named here, each 0600.\n"
)


@dataclass(frozen=True)
class StoredTarget:
    """One entry of ``targets.toml``, with its paths made absolute."""

    name: str
    route: str
    url: str
    ssh: str | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    ca_file: Path | None = None
    ca_sha256: str | None = None
    cert_sha256: str | None = None
    """The server certificate's fingerprint, for a certificate the operator supplied."""
    tokens: Mapping[str, Path] = field(default_factory=dict)
    default_role: str | None = None
    release: str | None = None
    deployed_at: str | None = None

    def token_file(self, role: str) -> Path:
        """The file holding ``role``'s token; a ``UsageError`` naming the stored roles if none."""
        path = self.tokens.get(role)
        if path is None:
            stored = ", ".join(sorted(self.tokens)) or "none"
            raise UsageError(
                f"target {self.name} has no token stored for role {role!r} (stored: {stored}); "
                "give --role with a stored one, or --token-file F"
            )
        return path

    def checked_ca(self) -> str | None:
        """The CA file to trust, after checking it still holds the certificate deployed."""
        if self.ca_file is None:
            return None
        try:
            pem = self.ca_file.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(
                f"target {self.name}: cannot read its CA {self.ca_file}: {exc}"
            ) from exc
        if self.ca_sha256 is not None and fingerprint(pem) != self.ca_sha256:
            raise UsageError(
                f"target {self.name}: {self.ca_file} no longer holds the CA pinned at deploy "
                f"time (SHA-256 {self.ca_sha256}); refusing to trust it. Re-run paddock deploy"
            )
        return str(self.ca_file)


def checked_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise UsageError(
            f"target name {name!r}: use letters, digits and . _ : @ - (not first), "
            "at most 128; give another with --name"
        )
    return name


def fingerprint(pem: str) -> str:
    """SHA-256 of the first certificate in ``pem``, as the deploy result states it."""
    try:
        return certificate_sha256(pem)
    except ValueError as exc:
        raise UsageError(f"{exc}") from exc


# -- reading --------------------------------------------------------------------------


def load(name: str, environ: Mapping[str, str]) -> StoredTarget:
    """The entry ``name``; a ``UsageError`` listing the stored names when there is none."""
    directory = config_dir(environ)
    index = _read_index(directory)
    entries = index.targets
    table = entries.get(name)
    if table is None and name in index.pools:
        raise UsageError(
            f"{name!r} is a pool ([pools.{name}] in {directory / INDEX_NAME}): only "
            "'paddock run -t POOL' sends a turn to a pool; name one of its targets here"
        )
    if table is None:
        known = ", ".join(sorted(entries)) or "none yet"
        raise UsageError(
            f"no stored target {name!r} in {directory / INDEX_NAME} (stored: {known}); "
            "paddock deploy USER@HOST stores one"
        )
    return _entry(name, table, directory)


def load_all(environ: Mapping[str, str]) -> list[StoredTarget]:
    """Every stored target, by name; an entry that does not parse is a ``UsageError`` naming it."""
    directory = config_dir(environ)
    entries = _read_index(directory).targets
    return [_entry(name, entries[name], directory) for name in sorted(entries)]


@dataclass(frozen=True)
class Pool:
    """A ``[pools.NAME]`` table: a named list of stored targets."""

    name: str
    targets: tuple[str, ...]


def load_pools(environ: Mapping[str, str]) -> list[Pool]:
    """Every pool, each checked: known keys only, and members that are stored targets."""
    directory = config_dir(environ)
    index = _read_index(directory)
    return [_pool(name, index, directory) for name in sorted(index.pools)]


@dataclass(frozen=True)
class _Index:
    """``targets.toml`` as parsed: the raw ``[targets]`` and ``[pools]`` tables."""

    targets: dict[str, Any]
    pools: dict[str, Any]


def _read_index(directory: Path) -> _Index:
    path = directory / INDEX_NAME
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _Index({}, {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    unknown = sorted(set(data) - {"targets", "pools"})
    if unknown:
        raise UsageError(
            f"{path}: unknown key {unknown[0]!r}; only [targets.NAME] and [pools.NAME] "
            "tables belong"
        )
    tables = {}
    for key in ("targets", "pools"):
        tables[key] = data.get(key, {})
        if not isinstance(tables[key], dict):
            raise UsageError(f"{path}: {key!r} must be a table")
    return _Index(tables["targets"], tables["pools"])


def _pool(name: str, index: _Index, directory: Path) -> Pool:
    where = f"{directory / INDEX_NAME} [pools.{name}]"
    table = index.pools[name]
    if not isinstance(table, dict):
        raise UsageError(f"{where} is not a table")
    unknown = sorted(set(table) - POOL_KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (known: targets); remove it")
    members = table.get("targets")
    if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
        raise UsageError(f'{where}: needs targets = ["NAME", ...], one stored target or more')
    missing = [m for m in members if m not in index.targets]
    if missing:
        raise UsageError(
            f"{where}: {missing[0]!r} is not a stored target; deploy it, or remove it from the pool"
        )
    if len(set(members)) != len(members):
        raise UsageError(f"{where}: a target is listed twice; list each once")
    if name in index.targets:
        raise UsageError(f"{where}: a target is named {name!r} too; -t NAME must mean one thing")
    return Pool(name, tuple(members))


def _entry(name: str, table: Any, directory: Path) -> StoredTarget:
    where = f"{directory / INDEX_NAME} [targets.{name}]"
    if not isinstance(table, dict):
        raise UsageError(f"{where} is not a table")
    unknown = sorted(set(table) - ENTRY_KEYS)
    if unknown:
        raise UsageError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(ENTRY_KEYS))}); "
            "correct its spelling or remove it"
        )
    route, url = table.get("route"), table.get("url")
    if route not in ROUTES or not isinstance(url, str):
        raise UsageError(f'{where}: needs route = "ssh" or "https", and url')
    ssh = table.get("ssh")
    if route == "ssh" and not isinstance(ssh, str):
        raise UsageError(f'{where}: route "ssh" needs ssh = "USER@HOST[:PORT]"')
    tokens = table.get("tokens", {})
    if not isinstance(tokens, dict) or not all(isinstance(v, str) for v in tokens.values()):
        raise UsageError(f"{where}.tokens must map each role to a file")
    ca_file = table.get("ca_file")
    return StoredTarget(
        name=name,
        route=route,
        url=url,
        ssh=ssh,
        identity_files=_strings(table, "identity_files", where),
        known_hosts=_strings(table, "known_hosts", where),
        ca_file=directory / ca_file if isinstance(ca_file, str) else None,
        ca_sha256=_optional(table, "ca_sha256"),
        cert_sha256=_optional(table, "cert_sha256"),
        tokens={role: directory / path for role, path in tokens.items()},
        default_role=_optional(table, "default_role"),
        release=_optional(table, "release"),
        deployed_at=_optional(table, "deployed_at"),
    )


def _strings(table: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where}: {key} must be a list of paths")
    return tuple(value)


def _optional(table: Mapping[str, Any], key: str) -> str | None:
    value = table.get(key)
    return value if isinstance(value, str) else None


# -- writing --------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """What ``save`` did: the entry as stored, and whether older tokens were dropped."""

    entry: StoredTarget
    index: Path
    new_token_files: Mapping[str, Path]
    dropped_roles: tuple[str, ...]


def save(
    entry: StoredTarget,
    *,
    tokens: Mapping[str, str],
    ca_pem: str | None,
    environ: Mapping[str, str],
) -> Saved:
    """Store ``entry`` with its new tokens and CA, keeping the tokens stored before.

    ``entry.tokens`` and ``entry.ca_file`` are ignored: they are filled in here.
    Tokens of an entry that named another install (a different CA or
    certificate) would never work again, so they are dropped, and said so.
    """
    directory = private_dir(config_dir(environ))
    checked_name(entry.name)
    with locked(directory, ".targets.lock"):
        index = _read_index(directory)
        entries = index.targets
        old = _entry(entry.name, entries[entry.name], directory) if entry.name in entries else None
        same_install = old is not None and _pin(old) == _pin(entry)
        kept = dict(old.tokens) if old is not None and same_install else {}
        dropped = tuple(sorted(old.tokens)) if old is not None and not same_install else ()
        own = private_dir(private_dir(directory / "targets") / entry.name)
        written = {role: own / f"token-{role}" for role in tokens}
        for role, token in tokens.items():
            write_private(written[role], token + "\n")
        ca_file = None
        if ca_pem is not None:
            ca_file = own / "ca.pem"
            write_private(ca_file, ca_pem)
        stored = replace(
            entry,
            tokens={**kept, **written},
            ca_file=ca_file,
            default_role=entry.default_role or (old.default_role if old else None),
        )
        entries[entry.name] = _table(stored, directory)
        # Pools are the user's own writing: kept as they are.
        write_private(directory / INDEX_NAME, _render(entries, index.pools))
    return Saved(stored, directory / INDEX_NAME, written, dropped)


def _pin(entry: StoredTarget) -> str | None:
    return entry.ca_sha256 or entry.cert_sha256


def _table(entry: StoredTarget, directory: Path) -> dict[str, Any]:
    def relative(path: Path) -> str:
        return str(path.relative_to(directory)) if path.is_relative_to(directory) else str(path)

    table: dict[str, Any] = {"route": entry.route, "url": entry.url}
    if entry.ssh is not None:
        table["ssh"] = entry.ssh
    table["identity_files"] = list(entry.identity_files)
    table["known_hosts"] = list(entry.known_hosts)
    optional = {
        "ca_file": relative(entry.ca_file) if entry.ca_file is not None else None,
        "ca_sha256": entry.ca_sha256,
        "cert_sha256": entry.cert_sha256,
        "default_role": entry.default_role,
        "release": entry.release,
        "deployed_at": entry.deployed_at,
    }
    table |= {key: value for key, value in optional.items() if value is not None}
    table["tokens"] = {role: relative(path) for role, path in sorted(entry.tokens.items())}
    return table


def _render(entries: Mapping[str, Any], pools: Mapping[str, Any]) -> str:
    import tomlkit  # only when writing: reading stays on the standard library's tomllib

    document = tomlkit.document()
    document.add(tomlkit.comment(_HEADER.splitlines()[0].removeprefix("# ")))
    document.add(tomlkit.comment(_HEADER.splitlines()[1].removeprefix("# ")))
    targets = tomlkit.table(is_super_table=True)
    for name in sorted(entries):
        targets.add(name, entries[name])
    document.add("targets", targets)
    if pools:
        tables = tomlkit.table(is_super_table=True)
        for name in sorted(pools):
            tables.add(name, pools[name])
        document.add("pools", tables)
    return tomlkit.dumps(document)
