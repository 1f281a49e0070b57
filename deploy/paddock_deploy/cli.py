"""``paddock-deploy``'s command line: ``python3 paddock-deploy.pyz --wheel W --role R [...]``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from paddock_deploy.context import CONFIG_NAME, DEFAULT_STATE_ROOT, Context
from paddock_deploy.errors import Refused
from paddock_deploy.progress import Progress
from paddock_deploy.protocol import PASSED_OPTIONS, STEPS, Exit, failure_result
from paddock_deploy.runner import deploy, deploy_lock, interrupted
from paddock_deploy.systemd_unit import render_launcher_unit, render_unit

DEFAULT_WORKSPACE = "/srv/paddock/work"
DEFAULT_LAUNCHER_SOCKET = "/run/paddock/launcher.sock"


def _absolute(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is relative; give an absolute path")
    return os.path.normpath(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paddock-deploy",
        description="Install, upgrade and check a paddock target on this machine (as root).",
    )
    p.add_argument("--wheel", required=True, type=_absolute, help="the paddock wheel to install")
    p.add_argument(
        "--role",
        action="append",
        default=[],
        help="a role to serve (repeatable); a token is minted for each new one",
    )
    for option in PASSED_OPTIONS:
        p.add_argument(
            option.flag,
            metavar=option.metavar,
            help=option.described,
            type=_absolute if option.path else str,
            action="append" if option.repeated else "store",
            default=[] if option.repeated else option.default,
            choices=option.choices or None,
        )
    p.add_argument("--tls-cert", type=_absolute, help="an operator's certificate chain (PEM)")
    p.add_argument("--tls-key", type=_absolute, help="the key of --tls-cert (PEM)")
    p.add_argument(
        "--find-links",
        action="append",
        type=_absolute,
        default=[],
        help="a directory of wheels for pip (repeatable)",
    )
    p.add_argument(
        "--no-index",
        action="store_true",
        help="install dependencies only from --find-links (an offline target)",
    )
    p.add_argument("--health-timeout", type=float, default=30.0)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--print-unit",
        action="store_true",
        help="print the server's systemd unit these options give, and change nothing",
    )
    p.add_argument(
        "--print-launcher-unit",
        action="store_true",
        help="print the launcher's systemd unit these options give, and change nothing",
    )
    p.add_argument("--fail-at", choices=STEPS, help=argparse.SUPPRESS)
    return p


def print_unit(opts: argparse.Namespace) -> Exit:
    common = {
        "prefix": Path(opts.prefix),
        "config": Path(opts.config_dir) / CONFIG_NAME,
        "state_root": Path(opts.state_root or DEFAULT_STATE_ROOT),
        "workspaces": opts.workspace,
    }
    try:
        if opts.print_launcher_unit:
            text = render_launcher_unit(socket=Path(opts.launcher_socket), **common)
        else:
            text = render_unit(user=opts.user, group=opts.user, **common)
        sys.stdout.write(text)
    except Refused as exc:
        print(f"paddock-deploy: {exc}", file=sys.stderr)
        return Exit.REFUSED
    return Exit.OK


def main(argv: list[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    opts.workspace = opts.workspace or [DEFAULT_WORKSPACE]
    opts.given_launcher_socket = opts.launcher_socket
    opts.launcher_socket = opts.launcher_socket or DEFAULT_LAUNCHER_SOCKET
    if opts.print_unit or opts.print_launcher_unit:
        return print_unit(opts)
    progress = Progress(opts.json)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    os.umask(0o022)
    try:
        with deploy_lock(Path(opts.prefix)):
            return deploy(Context(opts, progress))
    except Refused as exc:
        event = failure_result(
            None, str(exc), rolled_back=False, problems=[], summary="nothing was changed"
        )
        progress.emit(event, f"paddock-deploy: {exc}", must_arrive=False)
        return Exit.REFUSED
