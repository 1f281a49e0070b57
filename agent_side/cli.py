"""The ``paddock`` command: run one turn on a target and exit with its status.

    paddock run [--target URL] [--token-file F] [--cacert F] [--role R] [--cwd D]
                [-e K=V ...] [--write P ...] [--read P ...] [--net] [--timeout S]
                [--json] [--local | --ssh USER@HOST[:PORT] [-i KEY] [--known-hosts F]]
                -- CMD...
    paddock health [--target URL] [--cacert F] [--local | --ssh USER@HOST[:PORT] ...]
    paddock deploy USER@HOST[:PORT] [--role R ...] [-i KEY] [--known-hosts F] [--name NAME]
                   [--route ssh|https] [--wheel W] [--listen ...] [--workspace ...] ...
    paddock run -t NAME -- CMD...        (also plan, logs, turns, health)

With ``--ssh``, every request goes through one SSH connection to the target
host (see ``agent_side.ssh``), and ``--target`` names the listener as seen from
there (default http://127.0.0.1:8443). A passphrase-protected key is unlocked
with PADDOCK_SSH_PASSPHRASE, else asked for on the terminal.

``paddock deploy`` installs a target over SSH (see ``agent_side.deploy``) and
stores it (``agent_side.targets_file``); ``-t NAME`` then stands for its route,
token and CA, in place of --target/--ssh and the PADDOCK_* variables.

Exit statuses follow DESIGN.md: the command's own 0..123, 124 timed out, 125
paddock itself failed (this module's ``paddock: LABEL: ...`` lines), 126
refused, 127 not found, 128+N killed by signal N.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, TextIO

from agent_side.api import DEFAULT_SSH_TARGET, Target
from agent_side.client import TargetClient
from agent_side.errors import AgentError, UsageError
from agent_side.turns import drive, new_request, output_bytes
from agent_side.turns import exit_status as exit_status  # re-exported: the CLI's status rule
from agent_side.views import print_plan, print_turns, refusal_sentence, say
from paddock_deploy.protocol import PASSED_OPTIONS
from shared import __version__
from shared.exit_status import ExitStatus, for_signal
from shared.wire import Event, OutputEvent, Turn, TurnRequest

if TYPE_CHECKING:
    from agent_side.ssh import PassphraseSource
    from agent_side.targets_file import StoredTarget

DEFAULT_ROLE = "default"
INTERRUPTED = for_signal(signal.SIGINT)
POST_GRACE_S = 5.0
"""How long leaving ``paddock run`` waits for a signal still being posted to the turn."""


@dataclass(frozen=True)
class Connection:
    """Where the target is and how to prove who we are to it."""

    url: str
    token: str | None = field(repr=False)
    cacert: str | None
    stored: StoredTarget | None = None
    """The stored target ``-t NAME`` named, if it did."""
    role: str | None = None
    """The role the stored target's token is for (``--role``, else its default)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``paddock`` command line; returns the process exit status."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _failed(exc)
    except SystemExit as exc:  # --help and --version end parsing on purpose
        return exc.code if isinstance(exc.code, int) else 0
    try:
        return int(args.handler(args, os.environ))
    except AgentError as exc:
        return _failed(exc)
    except KeyboardInterrupt:
        say("interrupted; the turn may still be running on the target")
        return INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, with usage errors raised as ``UsageError``."""
    parser = _Parser(prog="paddock", description="Run a command as a fenced turn on a target.")
    parser.add_argument("--version", action="version", version=f"paddock {__version__}")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run one command as a turn and stream its output")
    _add_target_options(run)
    _add_request_options(run)
    run.add_argument("--json", action="store_true", help="print events and the turn as JSON lines")
    run.add_argument(
        "--no-stdin",
        action="store_true",
        help="do not forward this command's stdin (forwarded by default when not a terminal)",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    run.set_defaults(handler=run_command)

    plan = commands.add_parser("plan", help="show the fence a command would get; run nothing")
    _add_target_options(plan)
    _add_request_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    plan.set_defaults(handler=plan_command)

    logs = commands.add_parser("logs", help="print a turn's output (--follow: until it ends)")
    _add_target_options(logs)
    _add_token_option(logs)
    logs.add_argument("turn_id", metavar="TURN")
    logs.add_argument("--follow", "-f", action="store_true", help="follow until the turn ends")
    logs.add_argument("--json", action="store_true", help="print events as JSON lines")
    logs.set_defaults(handler=logs_command)

    turns = commands.add_parser("turns", help="list recent turns of this token's roles")
    _add_target_options(turns)
    _add_token_option(turns)
    turns.add_argument("--limit", type=int, default=20, metavar="N", help="how many (default 20)")
    turns.add_argument("--json", action="store_true", help="print the turns as JSON lines")
    turns.set_defaults(handler=turns_command)

    health = commands.add_parser("health", help="print the target's health (exit 1: degraded)")
    _add_target_options(health)
    health.set_defaults(handler=health_command)

    _add_deploy_parser(commands)
    return parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would exit 2, which belongs to the command; paddock's own failures are 125.
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-t",
        "--target-name",
        metavar="NAME",
        help="a target stored by 'paddock deploy': its route, token and CA",
    )
    parser.add_argument(
        "--target",
        metavar="URL",
        help=f"target URL (PADDOCK_TARGET); with --ssh, as seen from the SSH host "
        f"(default {DEFAULT_SSH_TARGET})",
    )
    parser.add_argument("--cacert", metavar="F", help="CA certificate to trust (PADDOCK_CACERT)")
    parser.add_argument("--local", action="store_true", help="start an embedded loopback target")
    parser.add_argument(
        "--ssh", metavar="USER@HOST[:PORT]", help="reach the target through one SSH connection"
    )
    parser.add_argument(
        "-i",
        dest="identity",
        action="append",
        default=[],
        metavar="KEY",
        help="SSH private key to offer (repeatable; the SSH agent is used too)",
    )
    parser.add_argument(
        "--known-hosts",
        action="append",
        default=[],
        metavar="F",
        help="known_hosts file to check besides ~/.ssh/known_hosts (repeatable)",
    )


def _add_deploy_parser(commands: argparse._SubParsersAction[_Parser]) -> None:
    deploy = commands.add_parser(
        "deploy",
        help="install or upgrade a target over SSH, and store it for -t NAME",
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


def _add_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="F", help="file holding the token (PADDOCK_TOKEN)")


def _add_request_options(parser: argparse.ArgumentParser) -> None:
    _add_token_option(parser)
    parser.add_argument("--role", help="role to run as (PADDOCK_ROLE, else 'default')")
    parser.add_argument("--cwd", metavar="D", help="working directory on the target (absolute)")
    parser.add_argument(
        "-e", "--env", action="append", default=[], metavar="K=V", help="set a variable"
    )
    parser.add_argument("--write", action="append", default=[], metavar="P", help="writable path")
    parser.add_argument("--read", action="append", default=[], metavar="P", help="read-only path")
    parser.add_argument("--net", action="store_true", help="share the host's network")
    parser.add_argument("--timeout", type=_positive_seconds, metavar="S", help="wall-time limit")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


# -- resolving the command line -------------------------------------------------------


def resolve_connection(
    args: argparse.Namespace, environ: Mapping[str, str], *, need_token: bool = True
) -> Connection:
    """Target, token and CA: each from its flag, else its PADDOCK_* variable.

    With ``--ssh`` the URL is the listener as seen from the SSH host, so only
    ``--target`` names it: PADDOCK_TARGET names the target as seen from here.
    With ``-t NAME`` all three come from the stored target.
    """
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
    return Connection(url=url, token=token, cacert=args.cacert or environ.get("PADDOCK_CACERT"))


def _stored_connection(
    args: argparse.Namespace, environ: Mapping[str, str], *, need_token: bool
) -> Connection:
    """``-t NAME``: the stored route, token and CA; --token-file and --cacert still win."""
    from agent_side import targets_file

    name = args.target_name
    for flag, value in (("--target", args.target), ("--ssh", args.ssh)):
        if value:
            raise UsageError(f"-t {name} names the target already; drop {flag}")
    entry = targets_file.load(name, environ)
    if entry.route != "ssh":
        _refuse_ssh_options_without_ssh(args)
    role = getattr(args, "role", None) or entry.default_role or _only(entry.tokens) or DEFAULT_ROLE
    token = None
    token_file = getattr(args, "token_file", None)
    if token_file:
        token = read_token(token_file)
    elif need_token:
        token = read_token(str(entry.token_file(role)))
    cacert = args.cacert or entry.checked_ca()
    return Connection(url=entry.url, token=token, cacert=cacert, stored=entry, role=role)


def _only(names: Mapping[str, object]) -> str | None:
    return next(iter(names)) if len(names) == 1 else None


def _refuse_ssh_options_without_ssh(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, value in (("-i", args.identity), ("--known-hosts", args.known_hosts))
        if value
    ]
    if given:
        flags = " and ".join(given)
        raise UsageError(f"{flags} only apply with --ssh USER@HOST, or -t NAME of an SSH route")


def open_target(
    args: argparse.Namespace, environ: Mapping[str, str], connection: Connection
) -> Target:
    """The target the command line names: through SSH with ``--ssh``, else directly."""
    stored = connection.stored
    if stored is not None and stored.route == "ssh" and stored.ssh is not None:
        return Target.ssh(
            stored.ssh,
            token=connection.token,
            url=connection.url,
            cacert=connection.cacert,
            identity_files=args.identity or stored.identity_files,
            known_hosts=args.known_hosts or stored.known_hosts,
            passphrase=ssh_passphrase(environ),
        )
    if not getattr(args, "ssh", None):
        return Target.https(connection.url, token=connection.token, cacert=connection.cacert)
    return Target.ssh(
        args.ssh,
        token=connection.token,
        url=connection.url,
        cacert=connection.cacert,
        identity_files=args.identity,
        known_hosts=args.known_hosts,
        passphrase=ssh_passphrase(environ),
    )


def ssh_passphrase(environ: Mapping[str, str]) -> PassphraseSource:
    """PADDOCK_SSH_PASSPHRASE when set (for unattended use), else a prompt on the terminal."""
    from agent_side.ssh import interactive_passphrase

    secret = environ.get("PADDOCK_SSH_PASSPHRASE")
    if secret is not None:
        return lambda _path: secret
    return interactive_passphrase


def resolve_role(
    args: argparse.Namespace, environ: Mapping[str, str], connection: Connection | None = None
) -> str:
    """``--role``, else the stored target's role, else PADDOCK_ROLE, else ``default``."""
    if connection is not None and connection.role is not None:
        return connection.role
    return str(args.role or environ.get("PADDOCK_ROLE") or DEFAULT_ROLE)


def read_token(path: str) -> str:
    """The token in ``path``, surrounding whitespace removed; warns if others may read it."""
    try:
        with open(path, encoding="utf-8") as source:
            token = source.read().strip()
            mode = os.fstat(source.fileno()).st_mode
    except OSError as exc:
        raise UsageError(f"cannot read token file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"token file {path} is not UTF-8 text") from exc
    if not token:
        raise UsageError(f"token file {path} is empty")
    if mode & 0o077:
        say(
            f"warning: token file {path} is open to group or others (mode {mode & 0o777:o}); "
            "chmod 600 it"
        )
    return token


def build_request(args: argparse.Namespace, role: str, local_cwd: str | None) -> TurnRequest:
    """The TurnRequest the command line asks for.

    ``local_cwd`` is set only for ``--local``: relative paths then mean paths
    on this machine and are joined to it (not normalised: the target's walk
    resolves ``..`` physically). For a remote target they are an error.
    """
    argv = list(args.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("give the command to run after '--', e.g. paddock run -- make test")
    cwd = _target_path(args.cwd, "--cwd", local_cwd) if args.cwd else local_cwd
    return new_request(
        role=role,
        argv=argv,
        cwd=cwd,
        env=_env_pairs(args.env),
        read=[_target_path(p, "--read", local_cwd) for p in args.read],
        write=[_target_path(p, "--write", local_cwd) for p in args.write],
        network=args.net,
        wall_s=args.timeout,
    )


def _target_path(path: str, flag: str, local_cwd: str | None) -> str:
    if path.startswith("/"):
        return path
    if local_cwd is None:
        raise UsageError(
            f"{flag} {path!r} is relative; give an absolute path on the target "
            "(relative paths are accepted only with --local)"
        )
    return os.path.join(local_cwd, path)


def _env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"-e {pair!r} is not NAME=VALUE")
        env[name] = value
    return env


# -- run ------------------------------------------------------------------------------


def run_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock run``: submit, stream, forward Ctrl-C, and return the turn's status."""
    if args.local:
        _refuse_with_local(args)
        from agent_side.local import LOCAL_ROLE, local_target

        local_cwd = os.getcwd()
        request = _with_stdin(args, build_request(args, args.role or LOCAL_ROLE, local_cwd))
        with (
            local_target(local_cwd) as local,
            Target.https(local.url, token=local.token, cacert=local.cacert) as target,
        ):
            return run_turn(target.client, request, as_json=args.json)
    connection = resolve_connection(args, environ)
    role = resolve_role(args, environ, connection)
    request = _with_stdin(args, build_request(args, role, None))
    with open_target(args, environ, connection) as target:
        return run_turn(target.client, request, as_json=args.json)


def _with_stdin(args: argparse.Namespace, request: TurnRequest) -> TurnRequest:
    """Open the turn's stdin when ours is a pipe or file (``echo x | paddock run -- cat``)."""
    if args.no_stdin or _stdin_fd() is None:
        return request
    return request.model_copy(update={"stdin": "open"})


def _stdin_fd() -> int | None:
    """Our stdin's descriptor if it is something to forward: open, and not a terminal."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return None if os.isatty(fd) else fd


def _refuse_with_local(args: argparse.Namespace) -> None:
    flags = (
        ("--target", args.target),
        ("--cacert", args.cacert),
        ("--ssh", args.ssh),
        ("-t", args.target_name),
        ("-i", args.identity),
        ("--known-hosts", args.known_hosts),
    )
    given = [f for f, v in flags if v]
    if getattr(args, "token_file", None):
        given.append("--token-file")
    if given:
        raise UsageError(f"--local starts its own target; drop {', '.join(given)}")
    if getattr(args, "role", None) not in (None, "default"):
        raise UsageError("the --local target has one role, 'default'; drop --role")


def run_turn(client: TargetClient, request: TurnRequest, *, as_json: bool) -> int:
    """Run ``request`` on the target and return the status ``paddock run`` exits with."""
    forwarder = SignalForwarder(client)
    feeder = StdinFeeder(client) if request.stdin == "open" else None

    def submitted(turn_id: str) -> None:
        forwarder.attach(turn_id)
        if feeder is not None:
            feeder.start(turn_id)

    with forwarder.installed():
        sink = _Sink(as_json=as_json, on_broken_pipe=lambda: forwarder.send("TERM"))
        finished = drive(client, request, sink.event, on_submitted=submitted)
    final = finished.turn
    if final.refusal is not None and not sink.refusal_shown:
        say(refusal_sentence(final.refusal))
    sink.turn(final)
    return finished.exit_status


class _Sink:
    """Writes events as they arrive: raw bytes to stdout/stderr, or JSON lines."""

    def __init__(self, *, as_json: bool, on_broken_pipe: Callable[[], None]) -> None:
        self._as_json = as_json
        self._on_broken_pipe = on_broken_pipe
        self._stdout_open = True
        self.refusal_shown = False

    def event(self, event: Event) -> None:
        if event.kind == "refused":
            say(refusal_sentence(event.refusal))
            self.refusal_shown = True
        if self._as_json:
            self._stdout((event.model_dump_json() + "\n").encode())
        elif isinstance(event, OutputEvent):
            if event.kind == "stdout":
                self._stdout(output_bytes(event))
            else:
                _write(sys.stderr, output_bytes(event))
        elif event.kind == "notice":
            say(f"notice: {event.message}")

    def turn(self, turn: Turn) -> None:
        if self._as_json:
            self._stdout((turn.model_dump_json() + "\n").encode())

    def _stdout(self, data: bytes) -> None:
        if not self._stdout_open:
            return
        try:
            _write(sys.stdout, data)
        except BrokenPipeError:
            # Like SIGPIPE for a local pipeline: nobody reads on, so stop the producer.
            self._stdout_open = False
            _silence_stdout()
            self._on_broken_pipe()


def _write(stream: TextIO, data: bytes) -> None:
    stream.flush()  # keep text already written ahead of these bytes
    stream.buffer.write(data)
    stream.buffer.flush()


def _silence_stdout() -> None:
    # Point fd 1 at /dev/null so interpreter shutdown does not trip on the dead pipe.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


# -- Ctrl-C ---------------------------------------------------------------------------


class SignalForwarder:
    """Ctrl-C sends INT to the turn; a second sends KILL; a third stops waiting for it.

    The handler runs on the main thread between bytecodes, so it only decides;
    a helper thread does the HTTP request and the talking.
    """

    def __init__(self, client: TargetClient) -> None:
        self._client = client
        self._turn_id: str | None = None
        self._pending: str | None = None
        self._presses = 0
        self._posting: list[threading.Thread] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalForwarder]:
        """Handle SIGINT while the block runs (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)
            # A KILL still on its way must reach the target before the client closes.
            for thread in self._posting:
                thread.join(POST_GRACE_S)

    def attach(self, turn_id: str) -> None:
        """The turn now exists; deliver a Ctrl-C that came before it did."""
        self._turn_id = turn_id
        pending, self._pending = self._pending, None
        if pending is not None:
            self.send(pending)

    def send(self, name: str) -> None:
        """Post ``name`` to the turn from a helper thread."""
        turn_id = self._turn_id
        if turn_id is None:
            self._pending = name
            return
        thread = threading.Thread(
            target=self._deliver, args=(turn_id, name), daemon=True, name="paddock-signal"
        )
        self._posting.append(thread)
        thread.start()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self._presses += 1
        if self._presses >= 3:
            raise KeyboardInterrupt
        self.send("INT" if self._presses == 1 else "KILL")

    def _deliver(self, turn_id: str, name: str) -> None:
        try:
            self._client.signal(turn_id, name)
        except (AgentError, RuntimeError) as exc:
            say(f"could not send {name} to turn {turn_id}: {exc}")
            return
        if name == "INT":
            say(f"sent INT to turn {turn_id}; Ctrl-C again sends KILL")


# -- stdin ----------------------------------------------------------------------------


class StdinFeeder:
    """Copies this process's stdin to the turn's, from a helper thread, then closes it."""

    CHUNK = 64 * 1024

    def __init__(self, client: TargetClient) -> None:
        self._client = client

    def start(self, turn_id: str) -> None:
        threading.Thread(
            target=self._copy, args=(turn_id,), daemon=True, name="paddock-stdin"
        ).start()

    def _copy(self, turn_id: str) -> None:
        fd = _stdin_fd()
        try:
            while fd is not None and (chunk := os.read(fd, self.CHUNK)):
                self._client.write_stdin(turn_id, chunk)
            self._client.write_stdin(turn_id, b"", eof=True)
        except (AgentError, RuntimeError, OSError, ValueError):
            # The turn ended without reading it all (like a closed pipe), or we are closing.
            return


# -- plan, logs, turns ------------------------------------------------------------------


def plan_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock plan``: print the fence a command would get; exit as ``run`` would refuse."""
    if args.local:
        _refuse_with_local(args)
        from agent_side.local import LOCAL_ROLE, local_target

        local_cwd = os.getcwd()
        request = build_request(args, args.role or LOCAL_ROLE, local_cwd)
        with (
            local_target(local_cwd) as local,
            Target.https(local.url, token=local.token, cacert=local.cacert) as target,
        ):
            return print_plan(target.client.plan(request), as_json=args.json)
    connection = resolve_connection(args, environ)
    request = build_request(args, resolve_role(args, environ, connection), None)
    with open_target(args, environ, connection) as target:
        return print_plan(target.client.plan(request), as_json=args.json)


def logs_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock logs TURN``: its output so far; with ``--follow``, to its end and status."""
    _refuse_local_for(args, "logs")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        client = target.client
        sink = _Sink(as_json=args.json, on_broken_pipe=lambda: None)
        events = (
            client.follow(args.turn_id) if args.follow else client.events(args.turn_id, wait=0.5)
        )
        terminal = None
        for event in events:
            sink.event(event)
            if event.kind in ("exit", "refused"):
                terminal = event
        if not args.follow:
            return 0
        return exit_status(client.turn(args.turn_id), terminal)


def turns_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock turns``: the recent turns of this token's roles, as a table."""
    _refuse_local_for(args, "turns")
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        return print_turns(target.client.turns(args.limit), as_json=args.json)


def _refuse_local_for(args: argparse.Namespace, command: str) -> None:
    if args.local:
        raise UsageError(
            f"--local starts a target that lives only for one 'paddock run'; "
            f"'paddock {command}' needs a lasting one (--target, --ssh or -t)"
        )


# -- health ---------------------------------------------------------------------------


def health_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock health``: print the health JSON; exit 0 armed, 1 degraded."""
    if args.local:
        _refuse_with_local(args)
        from agent_side.local import local_target

        with (
            local_target() as local,
            Target.https(local.url, token=None, cacert=local.cacert) as target,
        ):
            return _print_health(target)
    connection = resolve_connection(args, environ, need_token=False)
    with open_target(args, environ, connection) as target:
        return _print_health(target)


def _print_health(target: Target) -> int:
    health = target.health()
    _write(sys.stdout, (health.model_dump_json() + "\n").encode())
    return 0 if health.status == "armed" else 1


# -- deploy ---------------------------------------------------------------------------


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


# -- output ---------------------------------------------------------------------------


def _failed(exc: AgentError) -> int:
    say(f"{exc.label}: {exc}")
    return int(ExitStatus.PADDOCK_FAILED)


if __name__ == "__main__":
    sys.exit(main())
