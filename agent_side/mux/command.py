"""The command line of the multiplexer: ``run``'s two options, and ``paddock mux``.

paddock run ... [--no-mux] [--mux-persist DUR] -- CMD
paddock mux status [TARGET OPTIONS] [--json]   the daemons running for you (or that target)
paddock mux stop   [TARGET OPTIONS]            stop them (or that target's): new runs start anew
paddock mux serve --dir D NAME                 the daemon itself, as ``paddock run`` starts it
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping

from agent_side.mux.settings import (
    DEFAULT_PERSIST_S,
    NO_MUX_VARIABLE,
    PERSIST_VARIABLE,
    duration_argument,
)


def add_run_options(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--no-mux",
        action="store_true",
        help=f"connect from this process, not through the local multiplexer ({NO_MUX_VARIABLE}=1)",
    )
    run.add_argument(
        "--mux-persist",
        type=duration_argument,
        metavar="DUR",
        help=f"how long the multiplexer stays after its last run ({PERSIST_VARIABLE}; "
        f"default {DEFAULT_PERSIST_S / 60:g}m; seconds, or with s, m or h)",
    )


def run_handler(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock run``: through the multiplexer when wanted and possible, else in-process.

    ``-t POOL`` (a pool of stored targets) is run in-process by ``agent_side.pools``.
    """
    from agent_side.mux import client

    if getattr(args, "target_name", None):
        from agent_side import pools

        pool = pools.named(args.target_name, environ)
        if pool is not None:
            return pools.run_command(args, environ, pool)

    def in_process() -> int:
        from agent_side.commands import run_command

        return run_command(args, environ)

    if client.wanted(args, environ):
        return client.run(args, environ, in_process)
    return in_process()


HELP = "the local multiplexer that keeps connections to targets warm"


def fill_mux_parser(
    mux: argparse.ArgumentParser, add_target_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    """``paddock mux``'s actions and their options."""
    mux.description = (
        "paddock run starts one multiplexer per target and user, which keeps the "
        "target's connection (and SSH tunnel) open between runs and leaves after "
        "--mux-persist of idleness."
    )
    actions = mux.add_subparsers(dest="mux_action", required=True, metavar="ACTION")
    status = actions.add_parser("status", help="list the multiplexers running for you")
    add_target_options(status)
    status.add_argument("--json", action="store_true", help="one JSON object per multiplexer")
    status.set_defaults(handler=status_command)
    stop = actions.add_parser("stop", help="stop them; the next run starts a new one")
    add_target_options(stop)
    stop.add_argument("--json", action="store_true", help="one JSON object per multiplexer")
    stop.set_defaults(handler=stop_command)
    serve = actions.add_parser("serve", help="run one (paddock run starts it when needed)")
    serve.add_argument("--dir", required=True, help="the private directory of its socket")
    serve.add_argument("name", metavar="NAME", help="the socket's name, a hash of the target")
    serve.add_argument("--persist", type=duration_argument, default=DEFAULT_PERSIST_S)
    serve.add_argument("--detach", action="store_true", help="fork and leave the parent at once")
    serve.set_defaults(handler=serve_command)


def serve_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from agent_side.mux.daemon import serve

    return serve(args.dir, args.name, args.persist, detach=args.detach)


def status_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Print each multiplexer: pid, clients, idle time, and its route."""
    for name, reply in _ask_each(args, environ, "status"):
        if args.json:
            print(json.dumps({"name": name, **reply}), flush=True)
        elif reply.get("t") == "status":
            print(
                f"{name}  pid {reply['pid']}  clients {reply['clients']}  "
                f"idle {reply['idle_s']:g}s of {reply['persist_s']:g}s  {reply['route']}",
                flush=True,
            )
        else:
            print(f"{name}  {reply.get('t')}", flush=True)
    return 0


def stop_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Stop each multiplexer (or the one for the target named); say which."""
    for name, reply in _ask_each(args, environ, "stop"):
        if args.json:
            print(json.dumps({"name": name, **reply}), flush=True)
        elif reply.get("t") == "stopped":
            print(f"{name}  stopped (pid {reply['pid']})", flush=True)
    return 0


def _ask_each(
    args: argparse.Namespace, environ: Mapping[str, str], op: str
) -> list[tuple[str, dict[str, object]]]:
    from agent_side.mux.client import connect, daemon_name, mux_identity
    from agent_side.mux.frames import PROTOCOL, Channel
    from agent_side.mux.paths import MuxDir, default_dir

    names = None
    if _names_a_target(args):
        from agent_side.connection import resolve_connection
        from agent_side.route import route_of

        connection = resolve_connection(args, environ, need_token=False)
        names = [daemon_name(mux_identity(route_of(args, connection).absolute(), environ))]
    answers: list[tuple[str, dict[str, object]]] = []
    with MuxDir.open(default_dir(environ)) as mux_dir:
        for name in names if names is not None else mux_dir.names():
            sock = connect(mux_dir, name)
            if sock is None:
                if names is None:
                    answers.append((name, {"t": "stale", "socket": mux_dir.shown(name)}))
                continue
            channel = Channel(sock)
            try:
                channel.send({"op": op, "protocol": PROTOCOL})
                received = channel.receive()
            finally:
                channel.close()
            if received is not None:
                answers.append((name, received[0]))
    return answers


def _names_a_target(args: argparse.Namespace) -> bool:
    # Only options name one: PADDOCK_TARGET alone does not narrow "stop them all".
    return any((args.target_name, args.target, args.ssh))
