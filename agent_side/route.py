"""How a target is reached: straight over HTTPS, or through an SSH server; not who we are to it.

``route_of`` decides it from the command line once, for both ways a turn is
run: opened in this process (``connection.open_target``) or by the local
multiplexer, whose socket is named by ``identity()``. The token, the role
and any passphrase are no part of a route: they are handed over per request.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from agent_side.defaults import REMOTE_CA
from agent_side.errors import UsageError
from agent_side.sha256 import sha256_hex

if TYPE_CHECKING:
    from agent_side.api import Target
    from agent_side.connection import Connection
    from agent_side.ssh import PassphraseSource

HTTPS = "https"
SSH = "ssh"


class Route(NamedTuple):
    """Where the target's listener is, and through which SSH server (if any) to reach it."""

    kind: str
    """``https``: straight to ``url``; ``ssh``: ``url`` as seen from the SSH server ``ssh``."""
    url: str
    cacert: str | None = None
    ssh: str | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    remote_cacert: str | None = None
    """With ``ssh`` and no ``cacert``: the CA file on the SSH host to trust, read over SSH."""

    def open(
        self, *, token: str | None, role: str | None, passphrase: PassphraseSource | None
    ) -> Target:
        """Connect: a ``Target`` over HTTPS, or through one SSH connection."""
        from agent_side.api import Target

        if self.kind == SSH and self.ssh is not None:
            return Target.ssh(
                self.ssh,
                token=token,
                url=self.url,
                cacert=self.cacert,
                remote_cacert=self.remote_cacert,
                role=role,
                identity_files=self.identity_files,
                known_hosts=self.known_hosts,
                passphrase=passphrase,
            )
        return Target.https(self.url, token=token, cacert=self.cacert, role=role)

    def absolute(self) -> Route:
        """The same route with every local file named by an absolute path, for another process."""
        return self._replace(
            cacert=_absolute(self.cacert),
            identity_files=tuple(p for p in map(_absolute, self.identity_files) if p),
            known_hosts=tuple(p for p in map(_absolute, self.known_hosts) if p),
        )

    def identity(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """What makes two routes the same connection, as JSON values (no secret among them).

        The CA is named by its contents, so a replaced CA file means a new
        connection. Over SSH, HOME (``~/.ssh``) and the agent socket count too.
        """
        identity: dict[str, Any] = {"uid": os.getuid(), **self._asdict()}
        identity["cacert_sha256"] = _file_sha256(self.cacert)
        if self.kind == SSH:
            identity["home"] = environ.get("HOME", "")
            identity["ssh_auth_sock"] = environ.get("SSH_AUTH_SOCK", "")
        return identity

    def describe(self) -> str:
        """One line for a person: ``https://host:8443`` or ``user@host -> http://127.0.0.1:8443``."""
        return f"{self.ssh} -> {self.url}" if self.kind == SSH else self.url

    @classmethod
    def from_identity(cls, identity: Mapping[str, Any]) -> Route:
        """The route an ``identity()`` describes; a ``UsageError`` if it is not one."""
        try:
            return cls(
                kind=str(identity["kind"]),
                url=str(identity["url"]),
                cacert=_optional_str(identity.get("cacert")),
                ssh=_optional_str(identity.get("ssh")),
                identity_files=tuple(map(str, identity.get("identity_files") or ())),
                known_hosts=tuple(map(str, identity.get("known_hosts") or ())),
                remote_cacert=_optional_str(identity.get("remote_cacert")),
            )
        except (KeyError, TypeError) as exc:
            raise UsageError(f"not a target route: {exc}") from exc


def route_of(args: argparse.Namespace, connection: Connection) -> Route:
    """The route the command line names: a stored target's, ``--ssh``'s, or straight HTTPS."""
    stored = connection.stored
    if stored is not None and stored.route == SSH and stored.ssh is not None:
        return Route(
            SSH,
            connection.url,
            cacert=connection.cacert,
            ssh=stored.ssh,
            identity_files=tuple(args.identity or stored.identity_files),
            known_hosts=tuple(args.known_hosts or stored.known_hosts),
            # The CA was pinned when it was deployed; never trade it for another.
            remote_cacert=None,
        )
    if not getattr(args, "ssh", None):
        return Route(HTTPS, connection.url, cacert=connection.cacert)
    return Route(
        SSH,
        connection.url,
        cacert=connection.cacert,
        ssh=args.ssh,
        identity_files=tuple(args.identity),
        known_hosts=tuple(args.known_hosts),
        remote_cacert=args.remote_cacert or REMOTE_CA,
    )


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(os.path.expanduser(path)) if path else None


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


def _file_sha256(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as source:
            return sha256_hex(source.read())
    except OSError:
        # Opening it will fail with the reason; the name only has to be stable.
        return "unreadable"
