"""The listen address: its parts, and where this machine reaches it."""

from __future__ import annotations

import ipaddress

from paddock_deploy.errors import Refused


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(f"--listen {listen!r} is not host:port (e.g. 127.0.0.1:8443)")
    return host.strip("[]"), int(port)


def health_host(host: str) -> str:
    """Where to reach a server listening on ``host`` from this machine."""
    if host in {"0.0.0.0", ""}:  # noqa: S104 - the configured bind address, not one we bind
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
