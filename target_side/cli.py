"""``paddock-target``: serve, check a config, mint a token."""

from __future__ import annotations

import argparse
import logging
import secrets
import sys

from target_side.auth import token_sha256
from target_side.config import load_settings
from target_side.errors import TargetError
from target_side.server import serve


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``paddock-target``; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except TargetError as exc:
        print(f"paddock-target: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paddock-target", description="The paddock target server.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    run = commands.add_parser("serve", help="serve the API (TLS unless listening on loopback)")
    run.add_argument("--config", required=True, help="absolute path of the TOML config")
    run.set_defaults(handler=_serve)

    config = commands.add_parser("config", help="work with a config file")
    config_commands = config.add_subparsers(required=True, metavar="ACTION")
    check = config_commands.add_parser("check", help="report every problem in FILE")
    check.add_argument("file")
    check.set_defaults(handler=_check)

    token = commands.add_parser("token", help="work with role tokens")
    token_commands = token.add_subparsers(required=True, metavar="ACTION")
    mint = token_commands.add_parser("mint", help="print a new token for ROLE, once, and its hash")
    mint.add_argument("role")
    mint.set_defaults(handler=_mint)
    return parser


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(load_settings(args.config))
    return 0


def _check(args: argparse.Namespace) -> int:
    settings = load_settings(args.file)
    print(f"{args.file}: ok ({len(settings.roles)} role(s), backend {settings.fence.backend})")
    return 0


def _mint(args: argparse.Namespace) -> int:
    token = secrets.token_urlsafe(32)
    print(f"token for role {args.role} (shown once; keep it secret): {token}")
    print(f'[roles.{args.role}]\ntoken_sha256 = "{token_sha256(token)}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
