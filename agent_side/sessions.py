"""Sessions from Python: one fence and one shell on the target, for many turns.

    with target.session(cwd="/srv/work/repo") as session:      # the fence is made here
        session.run("cd src && export MODE=fast")              # a string: shell code
        result = session.run(["make", "test"])                 # a list: one command
        result.exit_code, result.stdout, result.stderr

    async with target.session(cwd="/srv/work/repo") as session:  # AsyncTarget: the same, awaited
        result = await session.run(["make"])

``run`` mirrors ``Target.run``: the same ``RunResult`` and exit statuses; the
fence (cwd, environment, paths, network, memory) is the session's, fixed when
it started, so ``run`` takes only what a turn may still choose: its command,
its time limit, its events. A string is handed to the session's shell as it
is (``cd``, ``export``, functions and background jobs stay for the next
``run``); a list runs as one command, quoted. Leaving the ``with`` block ends
the session, and everything still running in it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agent_side.errors import AgentError, SessionRefused
from agent_side.turns import new_request
from shared.wire import Event, Session, SessionLimits, SessionRequest

if TYPE_CHECKING:
    from agent_side.api import AsyncTarget, RunResult, Target


def session_request(
    *,
    role: str,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    read: Sequence[str] = (),
    write: Sequence[str] = (),
    network: bool = False,
    timeout: float | None = None,
    idle_s: float | None = None,
    lifetime_s: float | None = None,
    lease: tuple[str, str, int] | None = None,
) -> SessionRequest:
    """A validated SessionRequest; whatever the contract rejects is a ``UsageError``."""
    from pydantic import ValidationError

    from agent_side.errors import UsageError

    try:
        return SessionRequest.model_validate(
            {
                "role": role,
                "cwd": cwd,
                "env": dict(env or {}),
                "fs": {"read": list(read), "write": list(write)},
                "network": "host" if network else "none",
                "limits": SessionLimits(
                    wall_s=timeout, session_idle_s=idle_s, session_s=lifetime_s
                ),
                "lease": None
                if lease is None
                else {"lease_id": lease[0], "seat": lease[1], "generation": lease[2]},
            }
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(f"the session request is not valid: {problems}") from exc


def open_session(target: Target, request: SessionRequest) -> Session:
    """Start the session ``request`` asks for; ``SessionRefused`` if the fence refused it."""
    from agent_side.views import refusal_sentence

    session = target.client.start_session(request, idempotency_key=str(uuid.uuid4()))
    if session.refusal is not None:
        raise SessionRefused(refusal_sentence(session.refusal), session.refusal)
    return session


class TargetSession:
    """An open session on a target: its turns run one at a time, in one shell.

    Thread-safe as its ``Target`` is, but the target runs one turn of a session at
    a time: a ``run`` while another runs fails with ``SessionUnavailable``.
    """

    def __init__(self, target: Target, session: Session) -> None:
        self._target = target
        self._session = session

    @property
    def id(self) -> str:
        return self._session.session_id

    @property
    def role(self) -> str:
        return self._session.role

    def __repr__(self) -> str:
        return f"TargetSession({self.id!r}, role={self.role!r})"

    def state(self) -> Session:
        """The session as the target knows it now (``state``, ``turns``, why it ended)."""
        self._session = self._target.client.session(self.id)
        return self._session

    def run(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> RunResult:
        """Run one turn in the session's shell and wait for it, as ``Target.run`` does.

        ``command``: a string is shell code for the session's shell; a list, one
        command. ``timeout`` kills the command, never the session.
        """
        script = command if isinstance(command, str) else None
        argv = () if isinstance(command, str) else command
        request = new_request(
            role=self.role, argv=argv, script=script, wall_s=timeout, session=self.id
        )
        return self._target.run_request(request, on_event=on_event)

    def end(self) -> Session:
        """End the session: everything still running in it is killed."""
        self._session = self._target.client.end_session(self.id)
        return self._session

    def __enter__(self) -> TargetSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(AgentError, RuntimeError):
            self.end()


class AsyncTargetSession:
    """``TargetSession`` for asyncio code (``AsyncTarget.session``): started on ``async with``."""

    def __init__(self, target: AsyncTarget, options: dict[str, Any], role: str | None) -> None:
        self._target = target
        self._options = options
        self._role = role
        self._session: TargetSession | None = None

    @property
    def session(self) -> TargetSession:
        if self._session is None:
            raise RuntimeError("this session is not open; use 'async with' or 'await open()'")
        return self._session

    @property
    def id(self) -> str:
        return self.session.id

    async def open(self) -> AsyncTargetSession:
        if self._session is None:
            sync = self._target.target

            def start() -> TargetSession:
                # On a worker thread: finding the role may ask the target.
                request = session_request(role=self._role or sync.role, **self._options)
                return TargetSession(sync, open_session(sync, request))

            self._session = await self._target.call(start)
        return self

    async def run(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> RunResult:
        """Like ``TargetSession.run``, awaited; cancelling it kills the turn's command."""
        session = self.session
        script = command if isinstance(command, str) else None
        argv = () if isinstance(command, str) else command
        request = new_request(
            role=session.role, argv=argv, script=script, wall_s=timeout, session=session.id
        )
        return await self._target.run_request(request, on_event=on_event)

    async def state(self) -> Session:
        return await self._target.call(self.session.state)

    async def end(self) -> Session:
        return await self._target.call(self.session.end)

    async def __aenter__(self) -> AsyncTargetSession:
        return await self.open()

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._session is not None:
            with contextlib.suppress(AgentError, RuntimeError):
                await self.end()
