"""``paddock deploy``'s command line: its options, and handing them to ``agent_side.deploy``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from agent_side.connection import ssh_passphrase
from agent_side.errors import UsageError

if TYPE_CHECKING:
    from agent_side.cli import CommandParser

HELP = "install or upgrade a target over SSH, and store it for -t NAME"


def add_deploy_parser(
    commands: argparse._SubParsersAction[CommandParser], *, options: bool = True
) -> None:
    """``paddock deploy``; with ``options`` False only its name and help (another command runs)."""
    if not options:
        commands.add_parser("deploy", help=HELP)
        return
    # Loaded only for deploy: the protocol module brings ssl and pathlib with it.
    from pathlib import Path

    from paddock_deploy.protocol import PASSED_OPTIONS

    deploy = commands.add_parser(
        "deploy",
        help=HELP,
        description="Upload this paddock and its deploy script over SSH, run it as root, "
        "and store the target (route, tokens, pinned CA) under NAME for 'paddock run -t NAME'.",
    )
    deploy.add_argument("destination", metavar="USER@HOST[:PORT]")
    deploy.add_argument(
        "--role",
        action="append",
        default=[],
        metavar="R",
        help="a role to serve (repeatable; needed on a first deploy); each new one gets a token",
    )
    deploy.add_argument(
        "-i", dest="identity", action="append", default=[], metavar="KEY", help="SSH key to offer"
    )
    deploy.add_argument(
        "--known-hosts", action="append", default=[], metavar="F", help="another known_hosts file"
    )
    deploy.add_argument("--name", help="store the target under NAME (default: HOST)")
    deploy.add_argument(
        "--route",
        choices=("ssh", "https"),
        default="ssh",
        help="how -t NAME reaches it: through SSH (default) or straight over HTTPS",
    )
    deploy.add_argument("--url", help="with --route https: the listener's URL as seen from here")
    deploy.add_argument(
        "--wheel", type=Path, metavar="W", help="a paddock wheel (default: build this checkout)"
    )
    deploy.add_argument(
        "--wheelhouse",
        type=Path,
        metavar="DIR",
        help="wheels of the dependencies, uploaded with it (a target without a package index)",
    )
    deploy.add_argument(
        "--script",
        type=Path,
        metavar="F",
        help="a paddock-deploy.pyz to run (default: built from this paddock at deploy time)",
    )
    deploy.add_argument(
        "--python",
        default="python3",
        metavar="P",
        help="the target's Python (3.11+) to run it with, e.g. /usr/bin/python3 "
        "(default: python3 on the login's PATH); the service user must be able to run it",
    )
    deploy.add_argument("--json", action="store_true", help="pass the script's JSON lines through")
    passed = deploy.add_argument_group("passed to paddock-deploy (see deploy/README.md)")
    for option in PASSED_OPTIONS:
        passed.add_argument(
            option.flag,
            metavar=option.metavar,
            help=option.described,
            action="append" if option.repeated else "store",
            default=[] if option.repeated else None,
            choices=option.choices or None,
        )
    deploy.add_argument("--fail-at", help=argparse.SUPPRESS)  # the script's rollback tests
    deploy.set_defaults(handler=deploy_command)


def deploy_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock deploy``: the target's own exit status (0..3), or 125 if paddock failed."""
    from agent_side.deploy import DeployRequest, deploy, passed_options, script_options

    if args.url is not None and args.route != "https":
        raise UsageError("--url names a direct route: give --route https too")
    pairs = passed_options(vars(args))
    request = DeployRequest(
        destination=args.destination,
        roles=tuple(args.role),
        identity_files=tuple(args.identity),
        known_hosts=tuple(args.known_hosts),
        script_options=script_options(pairs, args.fail_at),
        name=args.name,
        route=args.route,
        url=args.url,
        wheel=args.wheel,
        wheelhouse=args.wheelhouse,
        script=args.script,
        python=args.python,
        as_json=args.json,
    )
    return deploy(request, environ, ssh_passphrase(environ))
