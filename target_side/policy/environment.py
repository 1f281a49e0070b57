"""A turn's environment, built from empty (docs/design.md, "The environment").

The names a turn gets are a fixed list, then what the request declares, then
the turn id the target mints. Nothing of the server's own environment reaches
a turn but the terminal names below, and nothing of the request's reaches any
program the target runs on the host: bubblewrap receives these values as
arguments to set inside the fence, and runs under its own fixed environment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shared.wire import LeaseRef
from target_side.errors import RefusedError
from target_side.policy import refusals

FENCE_LOCALE = "C.UTF-8"
"""Not C: that is ASCII, and would mangle any output that is not."""

INHERITED_ENV = ("TERM", "COLORTERM")
"""The only names a turn inherits from the server's own environment."""

LOCALE_NAMES = re.compile(r"LANG|LANGUAGE|LC_[A-Z]+")
"""A request that declares any of these chooses its own locale; LC_ALL is then not pinned."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def build_env(
    declared: Mapping[str, str],
    *,
    fence_path: str,
    home: str,
    user: str,
    turn_id: str,
    server_env: Mapping[str, str],
    lease: LeaseRef | None = None,
) -> dict[str, str]:
    """The turn's environment: fixed names, the declared ones, then what the target sets.

    ``lease`` is the one the turn runs under, already found current: the turn
    sees its seat and generation (its fencing token), never its id.
    """
    _check_declared(declared)
    env = {
        "PATH": fence_path,
        "HOME": home,
        "USER": user,
        "LOGNAME": user,
        "SHELL": "/bin/sh",
        "TMPDIR": "/tmp",  # noqa: S108 - the fence's own /tmp, the turn's private scratch
        "LANG": FENCE_LOCALE,
    }
    if not any(LOCALE_NAMES.fullmatch(name) for name in declared):
        # LC_ALL outranks everything: pinned only when the request chose no locale at all.
        env["LC_ALL"] = FENCE_LOCALE
    env |= {name: server_env[name] for name in INHERITED_ENV if name in server_env}
    env |= declared
    env["PADDOCK_TURN_ID"] = turn_id
    if lease is not None:
        env["PADDOCK_LEASE_SEAT"] = lease.seat
        env["PADDOCK_LEASE_GENERATION"] = str(lease.generation)
    return env


def _check_declared(declared: Mapping[str, str]) -> None:
    for name, value in declared.items():
        if name.startswith("PADDOCK_"):
            raise RefusedError(refusals.reserved_env(name))
        if not _ENV_NAME.fullmatch(name):
            raise RefusedError(
                refusals.invalid_env(
                    name, "is not a valid name (letters, digits, '_'; not starting with a digit)"
                )
            )
        if "\0" in value:
            raise RefusedError(
                refusals.invalid_env(
                    name, "has a NUL byte in its value, which no process can receive"
                )
            )
