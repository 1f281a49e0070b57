"""One turn, from request to final status: the part the CLI and the Python API share.

``drive`` submits with an idempotency key and follows the event stream to its
terminal event (one request where the target streams the submission's answer;
resuming by cursor through dropped connections), and reads the turn's final
state; ``follow_turn`` does the same for a turn that exists,
after a given event (``paddock attach``); ``exit_status`` turns that into its status
(docs/design.md);
``sole_role`` is the role a request runs as when none is named. Both callers go
through here, so ``paddock run`` and ``Target.run`` cannot disagree.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from agent_side.client import TargetClient
from agent_side.errors import ProtocolError, TurnLost, UsageError
from agent_side.sha256 import sha256_hex
from shared.exit_status import is_exit_status
from shared.wire import (
    TERMINAL_KINDS,
    Event,
    FsAccess,
    LeaseRef,
    Limits,
    OutputEvent,
    Tty,
    Turn,
    TurnRequest,
)


@dataclass(frozen=True)
class Finished:
    """A turn that has ended, and the terminal event that said so (if one came)."""

    turn: Turn
    terminal: Event | None

    @property
    def exit_status(self) -> int:
        return exit_status(self.turn, self.terminal)


def new_request(
    *,
    role: str,
    argv: Sequence[str],
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    read: Sequence[str] = (),
    write: Sequence[str] = (),
    network: bool = False,
    wall_s: float | None = None,
    lease: tuple[str, str, int] | None = None,
    session: str | None = None,
    tty: Tty | None = None,
    script: str | None = None,
) -> TurnRequest:
    """A validated TurnRequest; whatever the contract rejects is a ``UsageError`` naming it.

    ``lease``: (lease id, seat, generation) of the lease the turn acts under.
    ``script`` (a bash script's body, its digest computed here) runs instead of ``argv``.
    """
    program: dict[str, object] = {"argv": list(argv)}
    if script is not None:
        program = {"script": script, "script_sha256": sha256_hex(script.encode())}
    fence: dict[str, object] = {}
    if cwd is not None or env or read or write or network:
        fence = {
            "cwd": cwd,
            "env": dict(env or {}),
            "fs": FsAccess(read=list(read), write=list(write)),
            "network": "host" if network else "none",
        }
    try:
        return TurnRequest.model_validate(
            {
                "role": role,
                **program,
                **fence,
                "limits": Limits(wall_s=wall_s),
                "lease": _lease_ref(lease),
                "session": session,
                "tty": tty,
            }
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(f"the request is not valid: {problems}") from exc


def _lease_ref(lease: tuple[str, str, int] | None) -> LeaseRef | None:
    if lease is None:
        return None
    lease_id, seat, generation = lease
    return LeaseRef(lease_id=lease_id, seat=seat, generation=generation)


def drive(
    client: TargetClient,
    request: TurnRequest,
    on_event: Callable[[Event], None],
    on_submitted: Callable[[str], None] | None = None,
) -> Finished:
    """Run ``request`` to its end, handing each event to ``on_event`` exactly once.

    Followed even when refused at submission: the stream carries its refused event.
    """
    submitted: list[str] = []

    def started(turn_id: str) -> None:
        submitted.append(turn_id)
        if on_submitted is not None:
            on_submitted(turn_id)

    events = client.submit_and_follow(request, str(uuid.uuid4()), started)
    terminal = _deliver(events, on_event)
    return _finished(client, submitted[0], terminal)


def follow_turn(
    client: TargetClient, turn_id: str, on_event: Callable[[Event], None], after: int = 0
) -> Finished:
    """Hand each event after ``after`` to ``on_event`` exactly once, to the turn's end.

    When every event was delivered before (``after`` is the terminal one), none
    comes, and the status is the finished turn's own.
    """
    terminal = _deliver(client.follow(turn_id, after=after), on_event)
    return _finished(client, turn_id, terminal)


def _deliver(events: Iterable[Event], on_event: Callable[[Event], None]) -> Event | None:
    """Hand every event to ``on_event``; the terminal one, if it came."""
    terminal: Event | None = None
    for event in events:
        on_event(event)
        if event.kind in TERMINAL_KINDS:
            terminal = event
    return terminal


def _finished(client: TargetClient, turn_id: str, terminal: Event | None) -> Finished:
    # The terminal event carries the ended turn (from targets that send it): no GET needed.
    ended = getattr(terminal, "turn", None)
    return Finished(ended if ended is not None else client.turn(turn_id), terminal)


def exit_status(final: Turn, terminal: Event | None) -> int:
    """The status to exit with: the terminal event's, else the finished turn's."""
    if final.state == "lost":
        raise TurnLost(f"the target marked turn {final.turn_id} lost (it crashed or restarted)")
    status = getattr(terminal, "exit_code", None)
    if status is None:
        status = final.exit_code
    if status is None:
        raise ProtocolError(f"turn {final.turn_id} ended ({final.state}) without an exit status")
    if not is_exit_status(status):
        raise ProtocolError(f"turn {final.turn_id} reported exit status {status}, not 0..255")
    return int(status)


def sole_role(client: TargetClient) -> str:
    """The only role the client's token holds; a ``UsageError`` naming them when it holds more."""
    roles = client.roles()
    if len(roles) == 1:
        return roles[0]
    raise UsageError(
        f"the token holds {len(roles)} roles ({', '.join(roles) or 'none'}); name the one to run "
        "as with --role R (or PADDOCK_ROLE; role= in Python)"
    )


def output_bytes(event: OutputEvent) -> bytes:
    """The bytes an output event carries, whichever way it encoded them."""
    if event.output is not None:
        return event.output
    if event.data is not None:
        return event.data.encode()
    try:
        return base64.b64decode(event.data_b64 or "", validate=True)
    except binascii.Error as exc:
        raise ProtocolError(f"event {event.seq} carries data_b64 that is not base64") from exc
