"""What each ``paddock`` command does once its command line is parsed.

Each handler takes the parsed arguments and the environment and returns the
exit status; paddock's own failures leave as ``AgentError`` for ``cli.main``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from agent_side.api import Target
from agent_side.connection import (
    open_target,
    opened_target,
    refuse_local_for,
    resolve_connection,
)
from agent_side.cursors import CursorStore
from agent_side.errors import UsageError
from agent_side.request_options import fence_options, request_options
from agent_side.streaming import (
    BROKEN_PIPE,
    SignalForwarder,
    Sink,
    run_turn,
    with_stdin,
    write,
)
from agent_side.turns import exit_status
from agent_side.views import (
    print_plan,
    print_sessions,
    print_turns,
    refusal_sentence,
    say,
    visible,
)
from shared.wire import TERMINAL_KINDS

if TYPE_CHECKING:
    from agent_side.request_options import RequestOptions


def run_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock run``: submit, stream, forward Ctrl-C, and return the turn's status."""
    options = request_options(args, environ, os.getcwd() if args.local else None)
    if args.tty:
        if args.json:
            raise UsageError("--json and --tty (-it): a terminal's output is not JSON; drop one")
        return _on_terminal(args, environ, options)
    with opened_target(args, environ) as target:
        request = with_stdin(options.request(target.role), forward=not args.no_stdin)
        # An embedded target ends with this run: nothing could attach to its turns later.
        cursors = None if args.local else cursor_store(args, environ, target)
        return run_turn(target.client, request, as_json=args.json, cursors=cursors)


def shell_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock shell``: an interactive shell (or CMD) on a terminal, in a fence; its status."""
    if not [word for word in args.command if word != "--"]:
        args.command = ["--", *DEFAULT_SHELL]
    options = request_options(args, environ, os.getcwd() if args.local else None)
    return _on_terminal(args, environ, options)


DEFAULT_SHELL = ("bash", "-l")
"""What ``paddock shell`` runs when given no command: a login shell, as ``ssh host`` does."""


def _on_terminal(
    args: argparse.Namespace, environ: Mapping[str, str], options: RequestOptions
) -> int:
    from agent_side.terminal import run_on_terminal

    with opened_target(args, environ) as target:
        return run_on_terminal(target.client, options.request(target.role))


def session_start_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock session start``: start a session, print its id (126/127 if it was refused)."""
    from agent_side.sessions import session_request

    refuse_local_for(args, "session start")
    options = fence_options(args, environ, None)
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        request = session_request(
            role=target.role,
            cwd=options.cwd,
            env=options.env,
            read=options.read,
            write=options.write,
            network=options.network,
            timeout=options.wall_s,
            idle_s=args.idle,
            lifetime_s=args.lifetime,
            lease=options.lease,
        )
        session = target.client.start_session(request, idempotency_key=str(uuid.uuid4()))
    if args.json:
        write(sys.stdout, (session.model_dump_json() + "\n").encode())
    if session.refusal is not None:
        say(refusal_sentence(session.refusal))
        return session.refusal.exit_code
    if not args.json:
        write(sys.stdout, (session.session_id + "\n").encode())
    return 0


def session_end_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock session end ID``: end it; everything in it is killed."""
    refuse_local_for(args, "session end")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        session = target.client.end_session(args.session_id)
    if args.json:
        write(sys.stdout, (session.model_dump_json() + "\n").encode())
    else:
        say(f"session {session.session_id} {session.state}: {session.ended or session.state}")
    return 0


def sessions_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock sessions``: this token's roles' sessions, as a table."""
    refuse_local_for(args, "sessions")
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        sessions = target.client.sessions(args.limit)
    return print_sessions(sessions, as_json=args.json)


def plan_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock plan``: print the fence a command would get; exit as ``run`` would refuse."""
    options = request_options(args, environ, os.getcwd() if args.local else None)
    with opened_target(args, environ) as target:
        plan = target.client.plan(options.request(target.role))
    return print_plan(plan, as_json=args.json)


def logs_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock logs TURN``: its output so far; with ``--follow``, on from the last delivered."""
    refuse_local_for(args, "logs")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        if args.follow:
            return _follow(args, environ, target, forward_signals=False)
        # A look at the output so far: from its start, leaving the cursor as it is.
        sink = Sink(as_json=args.json)
        for event in target.client.events(args.turn_id, wait=0.5):
            sink.event(event)
            if sink.pipe_broken:
                return BROKEN_PIPE
        return 0


def attach_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock attach TURN``: on from the last event delivered, Ctrl-C to the turn, its status."""
    refuse_local_for(args, "attach")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        return _follow(args, environ, target, forward_signals=True)


def _follow(
    args: argparse.Namespace, environ: Mapping[str, str], target: Target, *, forward_signals: bool
) -> int:
    """Follow a turn to its end from its cursor (or its start), recording what is delivered."""
    client, turn_id = target.client, args.turn_id
    store = cursor_store(args, environ, target)
    after = 0 if args.from_start else store.last_delivered(turn_id)
    if after:
        say(
            f"continuing turn {turn_id} after event {after}, which was shown before "
            "(--from-start shows it all)"
        )
    forwarder = SignalForwarder(client)
    forwarder.attach(turn_id)
    installed = forwarder.installed() if forward_signals else contextlib.nullcontext()
    sink = Sink(as_json=args.json, cursor=store.open(turn_id, start=after))
    terminal = None
    with installed, sink:
        for event in client.follow(turn_id, after=after):
            sink.event(event)
            if sink.pipe_broken:
                # Nobody reads on: stop here, leaving the turn be and the rest unrecorded.
                return BROKEN_PIPE
            if event.kind in TERMINAL_KINDS:
                terminal = event
        final = client.turn(turn_id)
    if final.refusal is not None and not sink.refusal_shown and not after:
        say(refusal_sentence(final.refusal))
    sink.turn(final)
    return exit_status(final, terminal)


def cursor_store(
    args: argparse.Namespace, environ: Mapping[str, str], target: Target
) -> CursorStore:
    """This user's cursors for the target the command line names (-t NAME, --ssh, or a URL)."""
    return CursorStore.for_user(
        environ,
        target.client.base_url,
        name=getattr(args, "target_name", None),
        ssh=getattr(args, "ssh", None),
    )


def turns_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock turns``: the recent turns of this token's roles, as a table."""
    refuse_local_for(args, "turns")
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        turns = target.client.turns(args.limit)
    return print_turns(turns, as_json=args.json)


def kill_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock kill TURN``: send KILL (or ``--signal``) to every process of the turn."""
    refuse_local_for(args, "kill")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        turn = target.client.signal(args.turn_id, args.signal)
    if args.json:
        write(sys.stdout, (turn.model_dump_json() + "\n").encode())
    else:
        say(f"sent {args.signal} to turn {turn.turn_id}")
    return 0


def health_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock health``: print the health JSON; exit 0 armed, 1 degraded."""
    with opened_target(args, environ, need_token=False) as target:
        health = target.health()
    write(sys.stdout, (health.model_dump_json() + "\n").encode())
    return 0 if health.status == "armed" else 1


def status_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock status``: each stored target's causes, with when each began; 1 if any is set."""
    import json

    from agent_side import status

    if not args.timeout > 0:
        raise UsageError("--timeout must be a positive number of seconds")
    statuses = status.check(args.names, environ, timeout_s=args.timeout)
    if args.json:
        record = {"targets": [s.as_json() for s in statuses]}
        write(sys.stdout, (json.dumps(record) + "\n").encode())
    elif not statuses:
        say("no stored targets yet: paddock deploy USER@HOST stores one")
    else:
        for line in status.table_lines(statuses):
            write(sys.stdout, (visible(line) + "\n").encode())
    return 0 if all(s.armed for s in statuses) else 1


def cp_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock cp SRC DST``: a file or directory to or from a target (``copy_command``)."""
    from agent_side.copy_command import copy

    return copy(args, environ)


def mcp_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock mcp``: an MCP server on stdio (``mcp_server``; the SDK loads only here)."""
    from agent_side.mcp_server import serve

    return serve(args, environ)
