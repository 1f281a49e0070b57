"""The turns a target knows: submit (plan, build, launch), follow, signal, and finish.

A turn's life is its own task on the server's event loop; no request handler
waits for it, so a client that goes away changes nothing for the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from dataclasses import dataclass, field

from shared.wire import Executable, Turn, TurnRequest, Usage
from target_side import refusals
from target_side.config import Settings
from target_side.errors import BackendError, RefusedError, TargetError
from target_side.launch import LaunchFds, bwrap_argv, find_bwrap, script_fd
from target_side.plan import FencePlan, plan_turn
from target_side.runner import Outcome, RunningTurn
from target_side.scratch import Scratch, build_scratch, remove_scratch
from target_side.spool import EventSpool, now

log = logging.getLogger("paddock.target")


class UnknownTurn(TargetError):
    """No turn with that id is visible to the caller."""


class TurnNotRunning(TargetError):
    """The turn has already ended, so it takes no signal or input."""


@dataclass
class TurnRecord:
    """A turn, its event spool, and (while it runs) its process."""

    turn: Turn
    spool: EventSpool
    running: RunningTurn | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class TurnManager:
    """Every turn of one target, keyed by id."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._turns: dict[str, TurnRecord] = {}
        self._idempotency: dict[tuple[str, str], str] = {}
        self._bwrap: str | None = None

    def bwrap(self) -> str:
        if self._bwrap is None:
            self._bwrap = find_bwrap()
        return self._bwrap

    async def submit(self, request: TurnRequest, idempotency_key: str | None = None) -> Turn:
        """Plan, build and launch a turn; a refusal is a finished turn, not an error."""
        if idempotency_key is not None:
            earlier = self._idempotency.get((request.role, idempotency_key))
            if earlier is not None:
                return self._turns[earlier].turn
        turn_id = f"t-{uuid.uuid4().hex}"
        spool = EventSpool(self.settings.state_root / "turns" / turn_id / "events.jsonl")
        record = TurnRecord(Turn(turn_id=turn_id, role=request.role, state="running", created_at=now()), spool)
        self._turns[turn_id] = record
        if idempotency_key is not None:
            self._idempotency[(request.role, idempotency_key)] = turn_id
        try:
            plan = plan_turn(request, self.settings, turn_id)
            await self._launch(record, plan)
        except RefusedError as refused:
            self._finish(record, Outcome(refused.refusal.exit_code, refusal=refused.refusal))
        return record.turn

    async def _launch(self, record: TurnRecord, plan: FencePlan) -> None:
        try:
            bwrap = self.bwrap()
        except BackendError as exc:
            raise refusals.backend_unavailable(str(exc)) from exc
        try:
            scratch = await asyncio.to_thread(build_scratch, self.settings, plan.role, plan.turn_id)
        except TargetError as exc:
            raise refusals.backend_unavailable(str(exc)) from exc
        try:
            running = await self._spawn(bwrap, plan, scratch, record.spool)
        except BaseException:
            remove_scratch(scratch)
            raise
        record.running = running
        record.turn = record.turn.model_copy(
            update={"started_at": now(), "executable": plan.executable}
        )
        record.spool.append("started", executable=plan.executable)
        record.task = asyncio.create_task(self._follow(record, plan, scratch))

    async def _spawn(
        self, bwrap: str, plan: FencePlan, scratch: Scratch, spool: EventSpool
    ) -> RunningTurn:
        status_read, status_write = os.pipe()
        body_fd = script_fd(plan.script) if plan.script is not None else None
        fds = LaunchFds(status=status_write, script=body_fd)
        try:
            return await RunningTurn.start(
                bwrap_argv(bwrap, plan, scratch, fds), plan.env, fds.passed(), status_read,
                plan.stdin_open, spool.append, plan.limits.wall_s, plan.limits.output_mb << 20,
            )
        except OSError as exc:
            os.close(status_read)
            raise refusals.backend_unavailable(f"could not start bubblewrap: {exc}") from exc
        finally:
            for fd in fds.passed():
                os.close(fd)

    async def _follow(self, record: TurnRecord, plan: FencePlan, scratch: Scratch) -> None:
        running = record.running
        if running is None:
            return
        try:
            outcome = await running.wait()
        except Exception:
            log.exception("turn %s: lost track of its process", plan.turn_id)
            running.kill()
            outcome = Outcome(125)
        finally:
            if not plan.keep_scratch:
                await asyncio.to_thread(remove_scratch, scratch)
        self._finish(record, outcome, plan.executable)

    def _finish(self, record: TurnRecord, outcome: Outcome, executable: Executable | None = None) -> None:
        state = "refused" if outcome.refusal is not None else "exited"
        record.turn = record.turn.model_copy(update={
            "state": state, "exit_code": outcome.exit_code, "signal": outcome.signal,
            "refusal": outcome.refusal, "ended_at": now(),
            "usage": Usage(wall_s=outcome.wall_s), "output_truncated": outcome.output_truncated,
        })
        record.running = None
        if outcome.refusal is not None:
            record.spool.append("refused", refusal=outcome.refusal, exit_code=outcome.exit_code)
        else:
            record.spool.append("exit", exit_code=outcome.exit_code, signal=outcome.signal)
        log.info("turn %s role=%s ended state=%s exit=%s", record.turn.turn_id, record.turn.role,
                 state, outcome.exit_code)

    def get(self, turn_id: str, roles: frozenset[str]) -> TurnRecord:
        """The turn ``turn_id`` if it belongs to one of ``roles``."""
        record = self._turns.get(turn_id)
        if record is None or record.turn.role not in roles:
            raise UnknownTurn(f"no turn {turn_id} among the turns of this token's roles")
        return record

    def signal(self, record: TurnRecord, name: str) -> int:
        if record.running is None:
            raise TurnNotRunning(f"turn {record.turn.turn_id} has ended; it takes no signal")
        return record.running.signal(name)

    async def shutdown(self) -> None:
        """Kill every running turn and wait for each to be recorded as ended."""
        tasks = []
        for record in self._turns.values():
            if record.running is not None:
                record.running.kill_now()
            if record.task is not None:
                tasks.append(record.task)
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks)
        for record in self._turns.values():
            record.spool.close()
