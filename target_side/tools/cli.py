"""``paddock-target``: serve, launch, check a config, mint a token, make TLS files, doctor, ledger.

Each command imports what it needs when it runs: ``launcher`` runs as root and
loads nothing of the web server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import socket
import sys
from pathlib import Path

from paddock_deploy.protocol import CONFIG_FILE
from shared import __version__
from target_side.config import load_settings
from target_side.errors import LedgerError, TargetError
from target_side.service.auth import token_sha256


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``paddock-target``; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except TargetError as exc:
        print(f"paddock-target: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # A file the command needed: the message names it; a traceback would not help.
        print(f"paddock-target: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paddock-target", description="The paddock target server."
    )
    parser.add_argument("--version", action="version", version=f"paddock-target {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    run = commands.add_parser("serve", help="serve the API (TLS unless listening on loopback)")
    run.add_argument("--config", required=True, help="absolute path of the TOML config")
    run.set_defaults(handler=_serve)

    launcher = commands.add_parser(
        "launcher",
        help="as root: start turns as their role's uid for a server that is not root",
        description="The privileged launcher: listens on the [fence] launcher socket of the "
        "config and serves only the server's uid (the state root's owner).",
    )
    launcher.add_argument("--config", type=_absolute, required=True, help="the target's config")
    launcher.set_defaults(handler=_launcher)

    config = commands.add_parser("config", help="work with a config file")
    config_commands = config.add_subparsers(required=True, metavar="ACTION")
    check = config_commands.add_parser("check", help="report every problem in FILE")
    check.add_argument("file", type=_absolute)
    check.add_argument(
        "--json", action="store_true", help="problems, notes and each role's host ids as JSON"
    )
    check.set_defaults(handler=_check)
    install = config_commands.add_parser("apply", help="install SOURCE at DEST if it checks clean")
    install.add_argument("source", type=_absolute)
    install.add_argument("dest", type=_absolute)
    install.set_defaults(handler=_apply)

    token = commands.add_parser("token", help="work with role tokens")
    token_commands = token.add_subparsers(required=True, metavar="ACTION")
    mint = token_commands.add_parser("mint", help="print a new token for ROLE, once")
    mint.add_argument("role")
    mint.add_argument("--config", type=_absolute, help="store the token's hash in this config")
    mint.set_defaults(handler=_mint)

    tls_parser = commands.add_parser("tls", help="make the server's TLS certificate")
    tls_commands = tls_parser.add_subparsers(required=True, metavar="ACTION")
    init = tls_commands.add_parser(
        "init",
        help="make a CA, and a server certificate and key signed by it, in DIR",
        description="Write DIR/ca.pem (the CA agents trust), DIR/cert.pem and DIR/key.pem "
        "(0600), then print the config lines that use them. Existing files are never replaced.",
    )
    init.add_argument("--dir", type=_absolute, required=True, metavar="DIR")
    init.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="H",
        help="a name or address agents use to reach the target (repeatable; 127.0.0.1 and "
        "localhost are always included; default: also this machine's host names)",
    )
    init.set_defaults(handler=_tls_init)

    doctor = commands.add_parser("doctor", help="say what is enforced here and what is degraded")
    doctor.add_argument(
        "--config",
        type=_absolute,
        default=Path(CONFIG_FILE),
        help=f"the target's config (default: {CONFIG_FILE})",
    )
    doctor.add_argument("--json", action="store_true", help="the findings as one JSON object")
    doctor.set_defaults(handler=_doctor)

    ledger = commands.add_parser("ledger", help="work with the ledger")
    ledger_commands = ledger.add_subparsers(required=True, metavar="ACTION")
    check_ledger = ledger_commands.add_parser("verify", help="check the ledger's hash chain")
    check_ledger.add_argument("--config", type=_absolute, required=True)
    check_ledger.set_defaults(handler=_verify_ledger)
    mend = ledger_commands.add_parser(
        "repair",
        help="keep the records that check out, move the rest aside, record the cut "
        "(the target must be stopped)",
    )
    mend.add_argument("--config", type=_absolute, required=True)
    mend.set_defaults(handler=_repair_ledger)
    return parser


def _absolute(text: str) -> Path:
    path = Path(text)
    if not path.is_absolute():
        raise argparse.ArgumentTypeError(f"{text!r} is relative; give an absolute path")
    return path


def _serve(args: argparse.Namespace) -> int:
    from target_side.service.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(load_settings(args.config))
    return 0


def _launcher(args: argparse.Namespace) -> int:
    from target_side.fence import launcher

    return launcher.main(args.config)


def _check(args: argparse.Namespace) -> int:
    from target_side.tools import config_file

    settings, problems = config_file.check(args.file)
    notes = asyncio.run(config_file.identity_notes(settings)) if settings is not None else []
    if args.json:
        print(json.dumps(config_file.check_report(settings, problems, notes)))
        return 1 if settings is None or problems else 0
    for problem in problems:
        # A problem with the file itself names it already; the others name their key.
        shown = problem if str(args.file) in problem else f"{args.file}: {problem}"
        print(shown, file=sys.stderr)
    if len(problems) > 1:
        print(f"{args.file}: {len(problems)} problems", file=sys.stderr)
    for note in notes:
        print(f"{args.file}: note: {note}")
    if settings is None or problems:
        return 1
    print(f"{args.file}: ok ({len(settings.roles)} role(s))")
    return 0


def _apply(args: argparse.Namespace) -> int:
    from target_side.tools import config_file

    config_file.apply(args.source, args.dest)
    print(f"{args.dest}: installed from {args.source}")
    return 0


def _mint(args: argparse.Namespace) -> int:
    from target_side.tools import config_file

    if args.config is not None:
        token = config_file.mint_token(args.config, args.role)
        print(f"token for role {args.role} (shown once; its hash is now in {args.config}):")
        print(token)
        return 0
    token = secrets.token_urlsafe(32)
    print(f"token for role {args.role} (shown once; keep it secret): {token}")
    print(f'[roles.{args.role}]\ntoken_sha256 = "{token_sha256(token)}"')
    return 0


def _tls_init(args: argparse.Namespace) -> int:
    from target_side.tools import tls  # only this command needs cryptography

    hosts = [*args.host, "127.0.0.1", "localhost"]
    if not args.host:
        hosts += [socket.gethostname(), socket.getfqdn()]
    hosts = list(dict.fromkeys(h for h in hosts if h))
    material = tls.make_tls_material(hosts)
    try:
        files = tls.write_tls_files(args.dir, material)
    except FileExistsError as exc:
        print(f"paddock-target: {exc}", file=sys.stderr)
        return 1
    made = (
        (files.ca_cert, "the CA: agents trust it (paddock run --cacert ca.pem)"),
        (files.cert_chain, "the server's certificate, then the CA's"),
        (files.key, "its key, mode 0600: chown it to the user paddock-target runs as"),
    )
    width = max(len(str(path)) for path, _ in made)
    print(f"made a CA and a server certificate for {', '.join(hosts)}:")
    for path, what in made:
        print(f"  {path!s:<{width}}  {what}")
    print(f"CA SHA-256 fingerprint: {material.ca_fingerprint}")
    print("in the config's [server] table:")
    print(f'tls_cert = "{files.cert_chain}"')
    print(f'tls_key = "{files.key}"')
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from target_side.tools import doctor  # only this command needs it

    return doctor.run(args.config, as_json=args.json)


def _verify_ledger(args: argparse.Namespace) -> int:
    from target_side.service import ledger

    settings = load_settings(args.config)
    try:
        verified = ledger.verify(settings.state_root)
    except LedgerError as exc:
        print(f"ledger DAMAGED: {exc}", file=sys.stderr)
        return 1
    notes = [verified.note] if verified.note else []
    if verified.torn_bytes:
        notes.append(
            f"{verified.torn_bytes} bytes after the last whole record, torn by a crash "
            "mid-append; the target cuts them (kept aside, recorded) when it starts"
        )
    note = f" ({'; '.join(notes)})" if notes else ""
    print(f"ledger ok: {verified.count} records, head {verified.head_hash}{note}")
    return 0


def _repair_ledger(args: argparse.Namespace) -> int:
    from target_side.service import ledger
    from target_side.service.state_lock import StateLock

    settings = load_settings(args.config)
    # The server's lock: a repair under a running server would fork the chain it repairs.
    lock = StateLock.acquire(settings.state_root)
    try:
        repaired = ledger.repair(settings.state_root)
    finally:
        lock.release()
    if repaired.cut is None:
        print(f"ledger: {repaired.reason} ({repaired.kept} records)")
        return 0
    cut = repaired.cut
    print(
        f"ledger repaired: {repaired.reason}; kept {repaired.kept} record(s), moved "
        f"{cut.bytes} bytes (sha256 {cut.sha256}) to {cut.kept}, and recorded the cut"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
