"""``paddock deploy``'s command line: its options, and handing them to ``agent_side.deploy``
(one host) or ``agent_side.fleet`` (several, or an inventory)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from agent_side.connection import ssh_passphrase
from agent_side.errors import UsageError

HELP = "install or upgrade targets over SSH, and store each for -t NAME"


def fill_deploy_parser(deploy: argparse.ArgumentParser) -> None:
    """``paddock deploy``'s options (only when it is the command run: they cost imports)."""
    # Loaded only for deploy: the protocol module brings ssl and pathlib with it.
    from pathlib import Path

    from paddock_deploy.protocol import PASSED_OPTIONS

    deploy.description = (
        "Upload this paddock and its deploy script over SSH, run it as root, "
        "and store the target (route, tokens, pinned CA) under NAME for 'paddock run -t NAME'. "
        "Several hosts (or --inventory) are deployed side by side, with a summary at the end."
    )
    deploy.add_argument(
        "destinations", nargs="*", metavar="USER@HOST[:PORT]", help="the hosts to deploy"
    )
    deploy.add_argument(
        "--inventory",
        type=Path,
        metavar="FILE",
        help="TOML: [hosts.NAME] tables (ssh = ..., and any option below), [defaults] for all",
    )
    deploy.add_argument(
        "--parallel",
        type=int,
        default=4,
        metavar="N",
        help="deploy at most N hosts at once (default 4)",
    )
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
    """``paddock deploy``: the worst host's exit status (0..3), or 125 if paddock failed."""
    from agent_side.fleet import Shared, deploy_fleet, requests_for

    if args.url is not None and args.route != "https":
        raise UsageError("--url names a direct route: give --route https too")
    requests = requests_for(
        args.destinations,
        args.inventory,
        given_options(args),
        Shared(wheel=args.wheel, wheelhouse=args.wheelhouse, script=args.script, as_json=args.json),
        name=args.name,
    )
    return deploy_fleet(requests, environ, ssh_passphrase(environ), parallel=args.parallel)


def given_options(args: argparse.Namespace) -> dict[str, object]:
    """The per-host options given on the command line, by their inventory key."""
    from paddock_deploy.protocol import PASSED_OPTIONS

    given: dict[str, object] = {
        "role": args.role,
        "identity": args.identity,
        "known-hosts": args.known_hosts,
        "route": args.route,
        "url": args.url,
        "python": args.python,
        "fail-at": args.fail_at,
    }
    for option in PASSED_OPTIONS:
        given[option.flag.removeprefix("--")] = getattr(args, option.dest)
    return {key: value for key, value in given.items() if value not in (None, [])}
