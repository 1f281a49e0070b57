"""Where each setting of a ``paddock`` command comes from, and the target it opens.

    setting  first           then            with -t NAME          else
    target   --target URL    PADDOCK_TARGET  its stored route      --ssh: DEFAULT_SSH_TARGET
    token    --token-file F  PADDOCK_TOKEN   its role's token      a usage error
    CA       --cacert F      PADDOCK_CACERT  its pinned CA         --ssh: the host's, over SFTP
    role     --role R        PADDOCK_ROLE    its default role      the token's only role

With ``-t NAME`` the stored target replaces --target, --ssh and the PADDOCK_*
variables, though --token-file, --cacert and --role still win. With ``--ssh``
the URL is the listener as seen from the SSH host, so only ``--target`` names
it: PADDOCK_TARGET names a target as seen from here. ``--local`` starts its own
target and takes none of these.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

from agent_side.defaults import DEFAULT_SSH_TARGET
from agent_side.errors import UsageError

if TYPE_CHECKING:
    # Loaded when a target is opened: resolving where it is needs neither httpx nor pydantic.
    from agent_side.api import Target
    from agent_side.ssh import PassphraseSource
    from agent_side.targets_file import StoredTarget


class Connection(NamedTuple):
    """Where the target is and how to prove who we are to it.

    A NamedTuple, not a dataclass: ``dataclasses`` (through ``inspect``) would
    cost a fast ``paddock run`` a tenth of its start.
    """

    url: str
    token: str | None
    cacert: str | None
    stored: StoredTarget | None = None
    """The stored target ``-t NAME`` named, if it did."""
    role: str | None = None
    """The role named (flag, variable or stored); None: the only one the token holds."""

    def __repr__(self) -> str:  # never the token
        return (
            f"Connection(url={self.url!r}, cacert={self.cacert!r}, "
            f"stored={self.stored!r}, role={self.role!r})"
        )


@contextlib.contextmanager
def opened_target(
    args: argparse.Namespace, environ: Mapping[str, str], *, need_token: bool = True
) -> Iterator[Target]:
    """The target the command line names, open for the block: --local, -t, --ssh or --target."""
    if getattr(args, "local", False):
        from agent_side.api import Target
        from agent_side.local import LOCAL_ROLE, local_target

        refuse_with_local(args, LOCAL_ROLE)
        with (
            local_target(os.getcwd()) as local,
            Target.https(
                local.url,
                token=local.token if need_token else None,
                cacert=local.cacert,
                role=LOCAL_ROLE,
            ) as target,
        ):
            yield target
        return
    connection = resolve_connection(args, environ, need_token=need_token)
    with open_target(args, environ, connection) as target:
        yield target


def resolve_connection(
    args: argparse.Namespace, environ: Mapping[str, str], *, need_token: bool = True
) -> Connection:
    """Target, token, CA and role, each from the first place that gives it (module docstring)."""
    if getattr(args, "target_name", None):
        return _stored_connection(args, environ, need_token=need_token)
    if getattr(args, "ssh", None):
        url = args.target or DEFAULT_SSH_TARGET
    else:
        _refuse_ssh_options_without_ssh(args)
        url = args.target or environ.get("PADDOCK_TARGET")
    if not url:
        raise UsageError(
            "no target: give --target URL or set PADDOCK_TARGET (or use --local or --ssh)"
        )
    token: str | None = None
    token_file = getattr(args, "token_file", None)
    if token_file:
        token = read_token(token_file)
    elif environ.get("PADDOCK_TOKEN"):
        token = environ["PADDOCK_TOKEN"].strip()
    elif need_token:
        raise UsageError("no token: give --token-file F or set PADDOCK_TOKEN")
    return Connection(
        url=url,
        token=token,
        cacert=args.cacert or environ.get("PADDOCK_CACERT"),
        role=getattr(args, "role", None) or environ.get("PADDOCK_ROLE") or None,
    )


def _stored_connection(
    args: argparse.Namespace, environ: Mapping[str, str], *, need_token: bool
) -> Connection:
    """``-t NAME``: the stored route, token and CA; --token-file, --cacert and --role still win."""
    from agent_side import targets_file

    name = args.target_name
    for flag, value in (("--target", args.target), ("--ssh", args.ssh)):
        if value:
            raise UsageError(f"-t {name} names the target already; drop {flag}")
    entry = targets_file.load(name, environ)
    if entry.route != "ssh":
        _refuse_ssh_options_without_ssh(args)
    role = getattr(args, "role", None) or entry.default_role or _only(entry.tokens)
    token_file = getattr(args, "token_file", None)
    token = None
    if token_file:
        token = read_token(token_file)
    elif need_token:
        if role is None:
            stored = ", ".join(sorted(entry.tokens)) or "none"
            raise UsageError(
                f"target {name} stores tokens for several roles ({stored}); name one with --role R"
            )
        token = read_token(str(entry.token_file(role)))
    cacert = args.cacert or entry.checked_ca()
    return Connection(url=entry.url, token=token, cacert=cacert, stored=entry, role=role)


def _only(names: Mapping[str, object]) -> str | None:
    return next(iter(names)) if len(names) == 1 else None


def _refuse_ssh_options_without_ssh(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, value in (
            ("-i", args.identity),
            ("--known-hosts", args.known_hosts),
            ("--remote-cacert", args.remote_cacert),
        )
        if value
    ]
    if given:
        flags = " and ".join(given)
        raise UsageError(f"{flags} only apply with --ssh USER@HOST, or -t NAME of an SSH route")


def refuse_with_local(args: argparse.Namespace, local_role: str) -> None:
    """``--local`` starts its own target: every option naming another one is a mistake."""
    flags = (
        ("--target", args.target),
        ("--cacert", args.cacert),
        ("--ssh", args.ssh),
        ("-t", args.target_name),
        ("-i", args.identity),
        ("--known-hosts", args.known_hosts),
        ("--remote-cacert", args.remote_cacert),
        ("--token-file", getattr(args, "token_file", None)),
    )
    given = [flag for flag, value in flags if value]
    if given:
        raise UsageError(f"--local starts its own target; drop {', '.join(given)}")
    if getattr(args, "role", None) not in (None, local_role):
        raise UsageError(f"the --local target has one role, {local_role!r}; drop --role")


def refuse_local_for(args: argparse.Namespace, command: str) -> None:
    """``paddock COMMAND`` needs a target that outlives one run."""
    if args.local:
        raise UsageError(
            f"--local starts a target that lives only for one 'paddock run'; "
            f"'paddock {command}' needs a lasting one (--target, --ssh or -t)"
        )


def open_target(
    args: argparse.Namespace, environ: Mapping[str, str], connection: Connection
) -> Target:
    """The target ``connection`` describes: through SSH for --ssh or a stored SSH route."""
    from agent_side.route import SSH, route_of

    route = route_of(args, connection)
    # Only an SSH route has keys to unlock (and only it needs paramiko loaded).
    passphrase = ssh_passphrase(environ) if route.kind == SSH else None
    return route.open(token=connection.token, role=connection.role, passphrase=passphrase)


def ssh_passphrase(environ: Mapping[str, str]) -> PassphraseSource:
    """PADDOCK_SSH_PASSPHRASE when set (for unattended use), else a prompt on the terminal."""
    from agent_side.ssh import interactive_passphrase

    secret = environ.get("PADDOCK_SSH_PASSPHRASE")
    if secret is not None:
        return lambda _path: secret
    return interactive_passphrase


def read_token(path: str) -> str:
    """The token in ``path``, surrounding whitespace removed; refused if others may open it."""
    try:
        with open(path, encoding="utf-8") as source:
            mode = os.fstat(source.fileno()).st_mode
            # Judged before reading: a token others could read is no longer a secret.
            if mode & 0o077:
                raise UsageError(
                    f"token file {path} is open to group or others (mode {mode & 0o777:o}); "
                    f"run: chmod 600 {path}"
                )
            token = source.read().strip()
    except OSError as exc:
        raise UsageError(f"cannot read token file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"token file {path} is not UTF-8 text") from exc
    if not token:
        raise UsageError(f"token file {path} is empty")
    return token
