"""What each ``paddock`` command does once its command line is parsed.

Each handler takes the parsed arguments and the environment and returns the
exit status; paddock's own failures leave as ``AgentError`` for ``cli.main``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from agent_side.connection import (
    open_target,
    opened_target,
    refuse_local_for,
    resolve_connection,
)
from agent_side.errors import UsageError
from agent_side.request_options import request_options
from agent_side.streaming import BROKEN_PIPE, Sink, run_turn, with_stdin, write
from agent_side.turns import exit_status
from agent_side.views import print_plan, print_turns, say


def run_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock run``: submit, stream, forward Ctrl-C, and return the turn's status."""
    options = request_options(args, environ, os.getcwd() if args.local else None)
    with opened_target(args, environ) as target:
        request = with_stdin(options.request(target.role), forward=not args.no_stdin)
        return run_turn(target.client, request, as_json=args.json)


def plan_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock plan``: print the fence a command would get; exit as ``run`` would refuse."""
    options = request_options(args, environ, os.getcwd() if args.local else None)
    with opened_target(args, environ) as target:
        plan = target.client.plan(options.request(target.role))
    return print_plan(plan, as_json=args.json)


def logs_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock logs TURN``: its output so far; with ``--follow``, to its end and status."""
    refuse_local_for(args, "logs")
    connection = resolve_connection(args, environ)
    with open_target(args, environ, connection) as target:
        client = target.client
        sink = Sink(as_json=args.json)
        events = (
            client.follow(args.turn_id) if args.follow else client.events(args.turn_id, wait=0.5)
        )
        terminal = None
        for event in events:
            sink.event(event)
            if sink.pipe_broken:
                return BROKEN_PIPE
            if event.kind in ("exit", "refused"):
                terminal = event
        if not args.follow:
            return 0
        return exit_status(client.turn(args.turn_id), terminal)


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
