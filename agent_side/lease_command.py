"""``paddock lease take|renew|release|show``: a seat's lease, from the command line.

    paddock lease take    [TARGET OPTIONS] [--role R] [--seat S] [--ttl S] [--supersede] [--json]
    paddock lease renew   [TARGET OPTIONS] ID [--ttl S] [--json]
    paddock lease release [TARGET OPTIONS] ID [--json]
    paddock lease show    [TARGET OPTIONS] [ID] [--json]

``take`` keeps the lease in this user's state directory (``agent_side.leases``)
so that ``paddock run --lease ID`` names it; ``release`` removes it. Each
prints the lease as one line (``--json``: as JSON; ``show`` without ID: one a
line, every seat of the token's roles).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_side.api import Target
    from agent_side.connection import Connection
    from shared.wire import Lease

Adder = Callable[[argparse.ArgumentParser], None]
DEFAULT_TTL_S = 60.0


HELP = "take, renew, release or show a lease on a seat (one live holder per seat)"


def fill_lease_parser(
    lease: argparse.ArgumentParser,
    add_target_options: Adder,
    add_token_option: Adder,
    seconds: Callable[[str], float],
) -> None:
    """``paddock lease``'s actions and their options."""
    lease.description = (
        "A lease holds a seat (a name within a role, by default its first "
        "workspace) for its ttl; a turn that names it (paddock run --lease ID) is refused once "
        "a newer holder has superseded it."
    )
    actions = lease.add_subparsers(dest="lease_action", required=True, metavar="ACTION")

    def action(name: str, help_text: str, handler: Callable[..., int]) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text)
        add_target_options(parser)
        add_token_option(parser)
        parser.add_argument("--json", action="store_true", help="print the lease as JSON")
        parser.set_defaults(handler=handler)
        return parser

    take = action("take", "take a lease on a seat and keep it for --lease", take_command)
    take.add_argument(
        "--role", help="the role the seat belongs to (PADDOCK_ROLE; default: the token's only)"
    )
    take.add_argument(
        "--seat", metavar="SEAT", help="the seat to take (default: the role's first workspace)"
    )
    take.add_argument(
        "--ttl",
        type=seconds,
        default=DEFAULT_TTL_S,
        metavar="S",
        help=f"seconds it holds unless renewed (default {DEFAULT_TTL_S:g})",
    )
    take.add_argument(
        "--supersede",
        action="store_true",
        help="take the seat even while another lease holds it: that one's turns are refused",
    )
    renew = action("renew", "renew a lease for its ttl (or --ttl) from now", renew_command)
    renew.add_argument("lease_id", metavar="ID")
    renew.add_argument(
        "--ttl", type=seconds, metavar="S", help="seconds from now (default: its own)"
    )
    release = action("release", "give the seat up and forget the lease", release_command)
    release.add_argument("lease_id", metavar="ID")
    show = action("show", "show a lease, or every seat's current lease", show_command)
    show.add_argument("lease_id", nargs="?", metavar="ID", help="default: every seat's lease")


def take_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from agent_side import leases

    with _target(args, environ, "take") as (target, connection):
        lease = target.client.take_lease(target.role, args.seat, args.ttl, supersede=args.supersede)
    leases.save(lease, _where(args, connection), environ)
    _print(lease, as_json=args.json)
    return 0


def renew_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from agent_side import leases

    lease_id = leases.checked_id(args.lease_id)
    with _target(args, environ, "renew") as (target, connection):
        lease = target.client.renew_lease(lease_id, args.ttl)
    leases.save(lease, _where(args, connection), environ)
    _print(lease, as_json=args.json)
    return 0


def release_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from agent_side import leases
    from agent_side.errors import LeaseLost

    lease_id = leases.checked_id(args.lease_id)
    with _target(args, environ, "release") as (target, _):
        try:
            lease = target.client.release_lease(lease_id)
        except LeaseLost:
            leases.forget(lease_id, environ)  # released already, or never here: nothing to keep
            raise
    leases.forget(lease_id, environ)
    _print(lease, as_json=args.json)
    return 0


def show_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from agent_side import leases

    with _target(args, environ, "show") as (target, _):
        if args.lease_id:
            found = [target.client.lease(leases.checked_id(args.lease_id))]
        else:
            found = target.client.leases()
    for lease in found:
        _print(lease, as_json=args.json)
    return 0


@contextlib.contextmanager
def _target(
    args: argparse.Namespace, environ: Mapping[str, str], action: str
) -> Iterator[tuple[Target, Connection]]:
    """The target the command line names, open, and how it was named (for the lease's file)."""
    from agent_side.connection import open_target, refuse_local_for, resolve_connection

    refuse_local_for(args, f"lease {action}")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        yield target, connection


def _where(args: argparse.Namespace, connection: Connection) -> str:
    """How the command line named the target: ``-t NAME``, else its URL (and SSH host)."""
    if getattr(args, "target_name", None):
        return f"-t {args.target_name}"
    ssh = getattr(args, "ssh", None)
    return f"{ssh} -> {connection.url}" if ssh else connection.url


def _print(lease: Lease, *, as_json: bool) -> None:
    from agent_side.leases import describe
    from agent_side.stdio import write

    line = lease.model_dump_json() if as_json else describe(lease)
    write(sys.stdout, (line + "\n").encode())
