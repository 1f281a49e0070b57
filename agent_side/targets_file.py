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

Every file is written whole to a temporary name beside it and renamed over the
old one, so a crash leaves the old file or the new one, never half of either.
A key this module does not know is an error that names it: a misspelt
``default_role`` must not quietly mean "no default".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent_side.errors import UsageError
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


def config_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/paddock``, else ``~/.config/paddock`` (XDG: only absolute paths count)."""
    xdg = environ.get("XDG_CONFIG_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "paddock"
    home = environ.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".config" / "paddock"


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
    entries = _read_index(directory)
    table = entries.get(name)
    if table is None:
        known = ", ".join(sorted(entries)) or "none yet"
        raise UsageError(
            f"no stored target {name!r} in {directory / INDEX_NAME} (stored: {known}); "
            "paddock deploy USER@HOST stores one"
        )
    return _entry(name, table, directory)


def _read_index(directory: Path) -> dict[str, Any]:
    path = directory / INDEX_NAME
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    unknown = sorted(set(data) - {"targets"})
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r}; only [targets.NAME] tables belong")
    targets = data.get("targets", {})
    if not isinstance(targets, dict):
        raise UsageError(f"{path}: 'targets' must be a table")
    return targets


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
    directory = _private_dir(config_dir(environ))
    checked_name(entry.name)
    with _locked(directory):
        entries = _read_index(directory)
        old = _entry(entry.name, entries[entry.name], directory) if entry.name in entries else None
        same_install = old is not None and _pin(old) == _pin(entry)
        kept = dict(old.tokens) if old is not None and same_install else {}
        dropped = tuple(sorted(old.tokens)) if old is not None and not same_install else ()
        own = _private_dir(_private_dir(directory / "targets") / entry.name)
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
        write_private(directory / INDEX_NAME, _render(entries))
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


def _render(entries: Mapping[str, Any]) -> str:
    import tomlkit  # only when writing: reading stays on the standard library's tomllib

    document = tomlkit.document()
    document.add(tomlkit.comment(_HEADER.splitlines()[0].removeprefix("# ")))
    document.add(tomlkit.comment(_HEADER.splitlines()[1].removeprefix("# ")))
    targets = tomlkit.table(is_super_table=True)
    for name in sorted(entries):
        targets.add(name, entries[name])
    document.add("targets", targets)
    return tomlkit.dumps(document)


def _private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter (created, or tightened, to 0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        # It holds tokens: whatever made it wider, nobody else may list or enter it.
        path.chmod(0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``path`` atomically, 0600 from its creation, and make the rename durable."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One writer at a time: two deploys finishing together must not lose an entry."""
    fd = os.open(directory / ".targets.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
