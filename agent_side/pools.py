"""``paddock run -t POOL``: one turn, sent to a healthy target of a pool that has room for it.

    [pools.ci]                               in targets.toml (agent_side.targets_file)
    targets = ["build-1", "build-2"]         each a stored target; the first listed is preferred

How the target is chosen:

1. Health first. Every member is opened and asked ``GET /v1/health`` at once.
   Members that answer ``armed`` come first, then ``degraded`` ones (a
   degraded target still takes turns), each group in the pool's order; a
   member that does not answer (stopped, unreachable, TLS or token refused)
   is left out, and named if no member is left.
2. Then room. The turn is submitted to each in that order, without waiting:
   a member at its cap (429) or taking no turns for now (503) passes it on
   to the next, as does one that cannot be reached any more. The first that
   takes it runs it.
3. Every member busy: the round starts again after the shortest
   ``Retry-After`` they asked for, for up to ``RetryPolicy.busy_s`` (five
   minutes), as ``paddock run`` waits for a single target.

The target that took the turn is said on stderr (``paddock: pool ci: turn T
runs on build-2``) and, with ``--json``, as ``"target"`` in the final turn
object. From then on the turn is that target's, as with ``-t build-2``:
output, Ctrl-C, stdin, resume, and the agent's cursor (``paddock attach -t
build-2 T`` goes on with it). A pool run does not use the multiplexer.

A submission that broke mid-exchange is not passed on: the turn may have
started where it was sent, and a second target would run it twice.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from agent_side.errors import (
    AgentError,
    ConnectionDropped,
    RequestRejected,
    ServiceUnavailable,
    TargetBusy,
    TargetUnreachable,
    UsageError,
)
from agent_side.request_options import RequestOptions, request_options
from agent_side.targets_file import Pool, load_pools

if TYPE_CHECKING:
    # Loaded once a pool run starts: ``paddock run -t NAME`` of one target must stay light.
    from agent_side.api import Target
    from agent_side.streaming import Sink
    from shared.wire import Health, Turn, TurnRequest

UNAVAILABLE_RETRY_S = 5.0
"""How long a member that answered 503 is given before the next round."""
_FATAL = (RequestRejected, UsageError, ConnectionDropped)
"""Failures another member would repeat (the request itself), or that may have started the turn."""


def named(name: str | None, environ: Mapping[str, str]) -> Pool | None:
    """The pool ``-t NAME`` names, if it names one (not a stored target)."""
    if not name:
        return None
    return next((pool for pool in load_pools(environ) if pool.name == name), None)


class Chosen(NamedTuple):
    """The member that took the turn, the turn, and the request it was sent."""

    name: str
    target: Target
    turn: Turn
    request: TurnRequest


@dataclass
class Member:
    """One target of the pool, as the health round found it."""

    name: str
    target: Target | None = None
    health: Health | None = None
    problem: str | None = None

    @property
    def rank(self) -> int:
        """0 armed, 1 degraded: the order members are tried in (then the pool's)."""
        return 0 if self.health is not None and self.health.status == "armed" else 1


def run_command(args: argparse.Namespace, environ: Mapping[str, str], pool: Pool) -> int:
    """``paddock run -t POOL``: choose a member, submit there, then follow as ``run`` does."""
    if getattr(args, "lease", None):
        raise UsageError(
            f"-t {pool.name} is a pool, and a lease belongs to the one target that granted it: "
            "run with -t TARGET (that target) to use --lease"
        )
    if args.local:
        raise UsageError(f"--local starts its own target; drop -t {pool.name}")
    options = request_options(args, environ, None)
    with contextlib.ExitStack() as opened:
        members = _health_round(args, environ, pool, opened)
        chosen = _submit(args, pool, members, options)
        for other in members:
            if other.name != chosen.name and other.target is not None:
                other.target.close()  # only the chosen one is needed from here on
        from agent_side.views import say

        say(f"pool {pool.name}: turn {chosen.turn.turn_id} runs on {chosen.name}")
        return _follow(args, environ, chosen)


def _member_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "target_name": name})


def _health_round(
    args: argparse.Namespace, environ: Mapping[str, str], pool: Pool, opened: contextlib.ExitStack
) -> list[Member]:
    """Every member opened and asked its health at once; reachable ones first, best first."""
    import concurrent.futures

    members = [Member(name) for name in pool.targets]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(members)) as workers:
        for member in members:
            workers.submit(_look_at, member, _member_args(args, member.name), environ)
    for member in members:
        if member.target is not None:
            opened.callback(member.target.close)
    answering = sorted((m for m in members if m.health is not None), key=lambda m: m.rank)
    if not answering:
        raise TargetUnreachable(
            f"no target of pool {pool.name} answers: " + "; ".join(_problems(members))
        )
    return answering


def _look_at(member: Member, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    from agent_side.connection import open_target, resolve_connection

    try:
        member.target = open_target(args, environ, resolve_connection(args, environ))
        member.health = member.target.health()
    except AgentError as exc:
        member.problem = f"{exc.label}: {exc}"


def _problems(members: list[Member]) -> list[str]:
    return [f"{m.name}: {m.problem or 'busy'}" for m in members]


def _submit(
    args: argparse.Namespace,
    pool: Pool,
    members: list[Member],
    options: RequestOptions,
    sleep: Callable[[float], None] = time.sleep,
) -> Chosen:
    """The first member (in order) that takes the turn, with the turn and the request sent."""
    import uuid

    from agent_side.client import RetryPolicy
    from agent_side.streaming import with_stdin

    stdin: str | None = None
    budget = RetryPolicy().busy_s
    waited = 0.0
    candidates = list(members)
    while True:
        pause: float | None = None
        for member in list(candidates):
            target = member.target
            if target is None:
                continue
            try:
                request = options.request(target.role)
                if stdin is None:  # decided (and a terminal's note said) once
                    stdin = with_stdin(request, forward=not args.no_stdin).stdin
                request = request.model_copy(update={"stdin": stdin})
                turn = target.client.submit(request, str(uuid.uuid4()), wait_busy=False)
            except TargetBusy as exc:
                member.problem = f"busy ({exc})"
                pause = min(pause or exc.retry_after_s, exc.retry_after_s)
                continue
            except ServiceUnavailable as exc:
                member.problem = str(exc)
                pause = min(pause or UNAVAILABLE_RETRY_S, UNAVAILABLE_RETRY_S)
                continue
            except _FATAL:
                raise
            except AgentError as exc:
                member.problem = f"{exc.label}: {exc}"
                candidates.remove(member)  # unreachable now, or refusing us: not asked again
                continue
            return Chosen(member.name, target, turn, request)
        if pause is None:
            raise TargetUnreachable(
                f"no target of pool {pool.name} took the turn: " + "; ".join(_problems(members))
            )
        if waited + pause > budget:
            raise TargetBusy(
                f"every target of pool {pool.name} stayed busy for {waited:g} s: "
                + "; ".join(_problems(candidates)),
                pause,
            )
        sleep(pause)
        waited += pause


def _follow(args: argparse.Namespace, environ: Mapping[str, str], chosen: Chosen) -> int:
    """Follow the turn to its end on the member that took it, as ``paddock run`` does."""
    from agent_side.cursors import CursorStore
    from agent_side.streaming import BROKEN_PIPE, SignalForwarder, StdinFeeder
    from agent_side.turns import follow_turn
    from agent_side.views import refusal_sentence, say

    client, turn_id = chosen.target.client, chosen.turn.turn_id
    forwarder = SignalForwarder(client)
    sink = _sink(
        chosen.name, as_json=args.json, on_broken_pipe=lambda: forwarder.send("TERM", quiet=True)
    )
    sink.cursor = CursorStore.for_user(environ, client.base_url, name=chosen.name).open(turn_id)
    forwarder.attach(turn_id)
    feeder = StdinFeeder(client) if chosen.request.stdin == "open" else None
    if feeder is not None:
        feeder.start(turn_id)
    with forwarder.installed(), sink, feeder or contextlib.nullcontext():
        finished = follow_turn(client, turn_id, sink.event)
    final = finished.turn
    if final.refusal is not None and not sink.refusal_shown:
        say(refusal_sentence(final.refusal))
    sink.turn(final)
    status = finished.exit_status
    return BROKEN_PIPE if sink.pipe_broken else status


def _sink(name: str, *, as_json: bool, on_broken_pipe: Callable[[], None]) -> Sink:
    import json

    from agent_side.streaming import Sink

    class PoolSink(Sink):
        """``Sink``, whose final turn object (``--json``) says which target ran it."""

        def turn(self, turn: Turn) -> None:
            if as_json:
                record = {**turn.model_dump(mode="json"), "target": name}
                self._stdout((json.dumps(record) + "\n").encode())

    return PoolSink(as_json=as_json, on_broken_pipe=on_broken_pipe)
