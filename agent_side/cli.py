"""The ``paddock`` command: parse the command line, run its command, report paddock's failures.

    paddock run [--target URL] [--token-file F] [--cacert F] [--role R] [-w DIR]
                [-e K=V | -e NAME ...] [--env-file F ...] [--write P ...] [--read P ...]
                [--net] [--timeout S] [--json] [--no-stdin] [--no-mux] [--mux-persist DUR]
                [--local | --ssh USER@HOST[:PORT] [-i KEY] [--known-hosts F] | -t NAME]
                -- CMD...
    paddock plan    (as run; runs nothing)
    paddock run ... --session ID -- CMD...          paddock run -it ... -- CMD...
    paddock shell [options as run] [-- CMD...]      a terminal on the target, as ssh gives one
    paddock session start [options as run]          paddock session end ID
    paddock sessions [--limit N]
    paddock logs TURN [--follow [--from-start]]     paddock attach TURN [--from-start]
    paddock turns [--limit N]        paddock kill TURN               paddock health
    paddock status [NAME ...]        paddock deploy USER@HOST[:PORT] ... | --inventory F
    paddock cp [-r] [--mode MODE] SRC DST      (a remote path: :PATH, or NAME:PATH)
    paddock mux status|stop          paddock lease take|renew|release|show
    paddock mcp [--role R] [--local | --ssh ... | -t NAME | --target URL]
                                     a Model Context Protocol server on stdio

The jobs live in their own modules: ``connection`` (where the target, token,
CA and role come from, and opening the target), ``request_options`` (the turn
asked for), ``streaming`` (output, signals and stdin while a turn runs),
``commands`` (each command's handler), ``cursors`` (what each turn delivered,
for ``logs --follow`` and ``attach``), ``status``, ``deploy_command`` and
``mux`` (the local multiplexer ``paddock run`` hands its turn to, when one
serves the target).

This module and what ``paddock run`` needs before it reaches a multiplexer
import only the standard library and paddock's light modules: httpx, the wire
models (pydantic), paramiko and asyncio load only where a command uses them.

Exit statuses (docs/cli.md): the command's own 0..123, 124 timed out, 125
paddock itself failed (a ``paddock: LABEL: ...`` line on stderr and, with
``--json``, one JSON object on stdout), 126 refused, 127 not found, 128+N
killed by signal N (141 when whoever read our stdout went away).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from agent_side.defaults import DEFAULT_SSH_TARGET, REMOTE_CA
from agent_side.deploy_command import HELP as DEPLOY_HELP
from agent_side.deploy_command import fill_deploy_parser
from agent_side.errors import AgentError, UsageError
from agent_side.lease_command import HELP as LEASE_HELP
from agent_side.lease_command import fill_lease_parser
from agent_side.mux.command import HELP as MUX_HELP
from agent_side.mux.command import add_run_options, fill_mux_parser, run_handler
from agent_side.stdio import BROKEN_PIPE, INTERRUPTED, StopWaiting, silence_stdout
from agent_side.views import say
from shared.exit_status import ExitStatus


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``paddock`` command line; returns the process exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(arguments)
    except BrokenPipeError:
        # Whoever read our stdout has gone (``paddock plan --json | head``): end as a
        # pipeline's producer does, quietly.
        silence_stdout()
        return BROKEN_PIPE


def program() -> NoReturn:
    """The ``paddock`` executable: ``main()``, then leave at once with its status.

    Tearing the interpreter down module by module costs ~10 ms after a run
    through the multiplexer (far more with httpx loaded) and does nothing a
    finished command needs: its output is flushed here, every connection and
    temporary file was closed by the ``with`` blocks that made them, and only
    daemon threads may still exist. Embedders call ``main()`` instead.
    """
    skip_httpx_command_line()
    status = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(status)  # a thread that must finish: let the interpreter wait for it
    os._exit(status)


def skip_httpx_command_line() -> None:
    """Keep httpx from loading its own command line, which paddock never runs.

    Importing httpx imports ``httpx._main`` where it can, and that imports
    click, rich and pygments wherever they are installed (uvicorn brings click
    along): measured, 44 ms of a 300 ms ``paddock run --no-mux``, and as much
    of starting a multiplexer. Python refuses to import a module whose entry
    in ``sys.modules`` is None, and httpx falls back to a stub then. Only the
    executable does this; ``main()`` leaves an embedder's modules alone.
    """
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]


def _run(argv: list[str]) -> int:
    as_json = _asks_for_json(argv)
    try:
        _refuse_terminal_options(argv)
        # "": no subcommand given (--version, --help), so no subcommand's options are needed.
        parser = build_parser(_subcommand(argv) or "")
        args = parser.parse_args(argv)
        args = _terminal_options(parser, argv, args)
    except UsageError as exc:
        return report_failure(exc, as_json=as_json)
    except SystemExit as exc:  # --help and --version end parsing on purpose
        return exc.code if isinstance(exc.code, int) else 0
    as_json = bool(getattr(args, "json", False))
    try:
        return int(args.handler(args, os.environ))
    except AgentError as exc:
        return report_failure(exc, as_json=as_json)
    except KeyboardInterrupt as exc:
        say("interrupted; the turn may still be running on the target")
        return exc.status if isinstance(exc, StopWaiting) else INTERRUPTED


def report_failure(exc: AgentError, *, as_json: bool) -> int:
    """Say what paddock failed at (and, in JSON mode, as a JSON object on stdout); 125."""
    status = ExitStatus.PADDOCK_FAILED
    say(f"{exc.label}: {exc}")
    if as_json:
        record = {"error": exc.label, "message": str(exc), "exit_code": int(status)}
        print(json.dumps(record), flush=True)
    return int(status)


class CommandParser(argparse.ArgumentParser):
    """argparse, with usage errors raised as ``UsageError`` (exit 125, not argparse's 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse would exit 2, which belongs to the command; paddock's own failures are 125.
        raise UsageError(f"{message} (see '{self.prog} --help')")


class _Formatter(argparse.HelpFormatter):
    """argparse's, told the terminal's width.

    Left to find it, argparse asks ``shutil`` on every ``add_argument`` (to
    check a metavar), and importing ``shutil`` (with bz2 and lzma) costs a
    fast ``paddock run`` several milliseconds. The width is found the same way.
    """

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_terminal_columns() - 2)


def _terminal_columns() -> int:
    """``COLUMNS``, else the terminal's width, else 80, as ``shutil.get_terminal_size`` says."""
    with contextlib.suppress(ValueError):
        columns = int(os.environ.get("COLUMNS", "0"))
        if columns > 0:
            return columns
    try:
        stdout = sys.__stdout__
        return os.get_terminal_size(stdout.fileno()).columns or 80 if stdout else 80
    except (AttributeError, ValueError, OSError):
        return 80


def build_parser(command: str | None = None) -> CommandParser:
    """The whole command line; each subcommand's ``handler`` is in ``commands``.

    ``command``: the subcommand being run, when known: only it is registered
    (every one, by name and help, when it is none of them, for the error to
    list them). The whole line costs a fast ``paddock run`` ~10 ms: about 290
    options in 78 parsers, argparse asking gettext (which looks for message
    catalogues on disk each time) for every parser's headings, and imports
    (deploy's).
    """
    parser = CommandParser(
        prog="paddock", description="Run a command as a fenced turn on a target."
    )
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    subcommands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    chosen = [entry for entry in _SUBCOMMANDS if entry[0] == command]
    for name, help_text, fill in chosen or _SUBCOMMANDS:
        sub = subcommands.add_parser(name, help=help_text)
        if command is None or chosen:
            fill(sub)
    return parser


def _fill_run(run: argparse.ArgumentParser) -> None:
    _add_target_options(run)
    _add_request_options(run)
    run.add_argument("--json", action="store_true", help="print events and the turn as JSON lines")
    run.add_argument(
        "--session",
        metavar="ID",
        help="run in this session's shell (paddock session start), in its fence",
    )
    run.add_argument(
        "--tty",
        action="store_true",
        help="run on a terminal on the target, driven from this one (also -it)",
    )
    run.add_argument(
        "--no-stdin",
        action="store_true",
        help="do not forward this command's stdin (forwarded when it is a pipe or a file)",
    )
    add_run_options(run)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    run.set_defaults(handler=run_handler)


def _fill_shell(shell: argparse.ArgumentParser) -> None:
    _add_target_options(shell)
    _add_request_options(shell)
    shell.add_argument(
        "--session", metavar="ID", help="open it in this session's shell, in its fence"
    )
    shell.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- CMD...", help="default: bash -l"
    )
    shell.set_defaults(handler=_command("shell_command"))


def _fill_session(session: argparse.ArgumentParser) -> None:
    actions = session.add_subparsers(dest="session_action", required=True, metavar="ACTION")
    start = actions.add_parser("start", help="start a session and print its id")
    _add_target_options(start)
    _add_request_options(start)
    start.add_argument(
        "--idle", type=_positive_seconds, metavar="S", help="end it after S seconds without a turn"
    )
    start.add_argument(
        "--lifetime", type=_positive_seconds, metavar="S", help="end it S seconds after it starts"
    )
    start.add_argument("--json", action="store_true", help="print the session as JSON")
    start.set_defaults(handler=_command("session_start_command"))
    end = actions.add_parser("end", help="end a session: everything in it is killed")
    _add_target_options(end)
    _add_token_option(end)
    end.add_argument("session_id", metavar="ID")
    end.add_argument("--json", action="store_true", help="print the ended session as JSON")
    end.set_defaults(handler=_command("session_end_command"))


def _fill_sessions(sessions: argparse.ArgumentParser) -> None:
    _add_target_options(sessions)
    _add_token_option(sessions)
    sessions.add_argument(
        "--limit", type=int, default=20, metavar="N", help="how many (default 20)"
    )
    sessions.add_argument("--json", action="store_true", help="print the sessions as JSON lines")
    sessions.set_defaults(handler=_command("sessions_command"))


def _fill_plan(plan: argparse.ArgumentParser) -> None:
    _add_target_options(plan)
    _add_request_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    plan.set_defaults(handler=_command("plan_command"))


def _fill_logs(logs: argparse.ArgumentParser) -> None:
    _add_target_options(logs)
    _add_token_option(logs)
    logs.add_argument("turn_id", metavar="TURN")
    logs.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="follow until the turn ends, from the last event shown before (by any paddock "
        "command)",
    )
    _add_from_start_option(logs)
    logs.add_argument("--json", action="store_true", help="print events as JSON lines")
    logs.set_defaults(handler=_command("logs_command"))


def _fill_attach(attach: argparse.ArgumentParser) -> None:
    _add_target_options(attach)
    _add_token_option(attach)
    attach.add_argument("turn_id", metavar="TURN")
    _add_from_start_option(attach)
    attach.add_argument("--json", action="store_true", help="print events and the turn as JSON")
    attach.set_defaults(handler=_command("attach_command"))


def _fill_turns(turns: argparse.ArgumentParser) -> None:
    _add_target_options(turns)
    _add_token_option(turns)
    turns.add_argument("--limit", type=int, default=20, metavar="N", help="how many (default 20)")
    turns.add_argument("--json", action="store_true", help="print the turns as JSON lines")
    turns.set_defaults(handler=_command("turns_command"))


def _fill_kill(kill: argparse.ArgumentParser) -> None:
    _add_target_options(kill)
    _add_token_option(kill)
    kill.add_argument("turn_id", metavar="TURN")
    kill.add_argument(
        "-s",
        "--signal",
        default="KILL",
        choices=("KILL", "TERM", "INT", "HUP"),
        help="the signal to send (default KILL)",
    )
    kill.add_argument("--json", action="store_true", help="print the turn as JSON")
    kill.set_defaults(handler=_command("kill_command"))


def _fill_health(health: argparse.ArgumentParser) -> None:
    _add_target_options(health)
    health.add_argument("--json", action="store_true", help="JSON (the only format it has)")
    health.set_defaults(handler=_command("health_command"))


def _fill_status(status: argparse.ArgumentParser) -> None:
    status.add_argument("names", nargs="*", metavar="NAME", help="only these stored targets")
    status.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for each target (default 10)",
    )
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(handler=_command("status_command"))


def _fill_cp(cp: argparse.ArgumentParser) -> None:
    _add_target_options(cp)
    _add_token_option(cp)
    cp.add_argument("--role", help="role to act as (PADDOCK_ROLE; default: the token's only role)")
    cp.add_argument(
        "-r", "--recursive", action="store_true", help="copy directories (as a tar stream)"
    )
    cp.add_argument(
        "--mode",
        metavar="MODE",
        help="octal permission bits for a file written on the target (default: the local file's)",
    )
    cp.add_argument(
        "--lease",
        metavar="ID",
        help="act under the lease ID that 'paddock lease take' took (its seat and generation)",
    )
    cp.add_argument("source", metavar="SRC", help="a local path, - (stdin), :PATH or NAME:PATH")
    cp.add_argument("dest", metavar="DST", help="a local path, - (stdout), :PATH or NAME:PATH")
    cp.set_defaults(handler=_command("cp_command"))


def _fill_mcp(mcp: argparse.ArgumentParser) -> None:
    _add_target_options(mcp)
    _add_token_option(mcp)
    mcp.add_argument("--role", help="role to act as (PADDOCK_ROLE; default: the token's only role)")
    mcp.add_argument(
        "--lease",
        metavar="ID",
        help="act under the lease ID that 'paddock lease take' took, in every tool call",
    )
    mcp.set_defaults(handler=_command("mcp_command"))


def _fill_mux(mux: argparse.ArgumentParser) -> None:
    fill_mux_parser(mux, _add_target_options)


def _fill_lease(lease: argparse.ArgumentParser) -> None:
    fill_lease_parser(lease, _add_target_options, _add_token_option, _positive_seconds)


Handler = Callable[[argparse.Namespace, Mapping[str, str]], int]

_SUBCOMMANDS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("run", "run one command as a turn and stream its output", _fill_run),
    ("shell", "open an interactive shell on the target, in a fence, on a terminal", _fill_shell),
    ("session", "start or end a session: one fence and one shell for many turns", _fill_session),
    ("sessions", "list this token's roles' sessions", _fill_sessions),
    ("plan", "show the fence a command would get; run nothing", _fill_plan),
    ("logs", "print a turn's output (--follow: until it ends)", _fill_logs),
    (
        "attach",
        "go on with a turn where the last paddock command stopped; Ctrl-C goes to the turn",
        _fill_attach,
    ),
    ("turns", "list recent turns of this token's roles", _fill_turns),
    ("kill", "kill a running turn (every process of it)", _fill_kill),
    ("health", "print the target's health (exit 1: degraded)", _fill_health),
    (
        "status",
        "check every stored target: each cause (connectivity, offline, tls, auth, degraded) "
        "with when it began; exit 1 if any is set",
        _fill_status,
    ),
    (
        "cp",
        "copy a file (or with -r a directory) to or from a target; remote paths are "
        ":PATH or NAME:PATH",
        _fill_cp,
    ),
    (
        "mcp",
        "serve the target's runs, files and sessions as MCP tools on stdin and stdout",
        _fill_mcp,
    ),
    ("deploy", DEPLOY_HELP, fill_deploy_parser),
    ("mux", MUX_HELP, _fill_mux),
    ("lease", LEASE_HELP, _fill_lease),
)
"""Every subcommand: its name, its line in ``paddock --help``, and what adds its options."""


def _command(name: str) -> Handler:
    """``commands.NAME``, imported when it runs: the commands load httpx and the wire models."""

    def handler(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
        from agent_side import commands

        function: Handler = getattr(commands, name)
        return function(args, environ)

    return handler


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked for (it costs ~30 ms)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> NoReturn:
        from shared import __version__

        print(f"paddock {__version__}", flush=True)
        parser.exit()


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
    parser.add_argument(
        "--remote-cacert",
        metavar="PATH",
        help=f"with --ssh and no --cacert: the CA file on the SSH host to trust, read over "
        f"SSH (default {REMOTE_CA}, where paddock deploy puts it)",
    )


def _add_from_start_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from-start",
        action="store_true",
        help="show the turn from its first event, whatever was shown before",
    )


def _add_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="F", help="file holding the token (PADDOCK_TOKEN)")


def _add_request_options(parser: argparse.ArgumentParser) -> None:
    _add_token_option(parser)
    parser.add_argument(
        "--role", help="role to run as (PADDOCK_ROLE; default: the token's only role)"
    )
    parser.add_argument(
        "-w", "--cwd", metavar="DIR", help="working directory on the target (absolute)"
    )
    parser.add_argument(
        "-e",
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="set a variable; -e NAME passes this shell's value on (repeatable)",
    )
    parser.add_argument(
        "--env-file",
        action="append",
        default=[],
        metavar="F",
        help="read variables from F, one NAME=VALUE (or NAME) a line; -e wins",
    )
    parser.add_argument("--write", action="append", default=[], metavar="P", help="writable path")
    parser.add_argument("--read", action="append", default=[], metavar="P", help="read-only path")
    parser.add_argument("--net", action="store_true", help="share the host's network")
    parser.add_argument("--timeout", type=_positive_seconds, metavar="S", help="wall-time limit")
    parser.add_argument(
        "--lease",
        metavar="ID",
        help="act under the lease ID that 'paddock lease take' took (its seat and generation)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


# -- docker's habits ---------------------------------------------------------------------

_TERMINAL_HINT = (
    "-i names an SSH key (-i KEY); for a terminal on the target give -it (or --tty) to "
    "paddock run, or use paddock shell"
)
_GLUED = ("-it", "-ti")
"""``docker run -it``: a terminal. argparse would read them as ``-i t`` and ``-t i``."""


def _options_part(argv: Sequence[str]) -> list[str]:
    """The tokens before ``--``: the part that is paddock's, not the command's."""
    return list(argv[: argv.index("--")]) if "--" in argv else list(argv)


def _refuse_terminal_options(argv: Sequence[str]) -> None:
    """``-i`` with no key after it is ``docker run -i``; argparse would only say it lacks one."""
    options = _options_part(argv)
    for position, word in enumerate(options):
        if word == "-i" and position + 1 == len(options):
            raise UsageError(f"-i: {_TERMINAL_HINT}")


def _terminal_options(
    parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace
) -> argparse.Namespace:
    """``-it`` (or ``-ti``) among paddock's own options asks ``run`` for a terminal (``--tty``).

    Only where it stands before the command: after it, it is the command's own.
    """
    command = getattr(args, "command", None) or []
    options = list(argv[: len(argv) - len(command)])
    glued = [word for word in options if word in _GLUED]
    if not glued:
        return args
    if args.subcommand not in ("run", "shell"):
        raise UsageError(f"{glued[0]}: only paddock run (and shell) runs on a terminal")
    words = [("--tty" if word in _GLUED else word) for word in options]
    if args.subcommand == "shell":
        words = [word for word in words if word != "--tty"]  # it always has one
    return parser.parse_args([*words, *argv[len(options) :]])


def _subcommand(argv: Sequence[str]) -> str | None:
    """The first word that is not an option: the subcommand, if the line is well formed."""
    return next((word for word in _options_part(argv) if not word.startswith("-")), None)


def _asks_for_json(argv: Sequence[str]) -> bool:
    """Whether ``--json`` is among paddock's own options, before parsing has succeeded."""
    return "--json" in _options_part(argv)


if __name__ == "__main__":
    program()
