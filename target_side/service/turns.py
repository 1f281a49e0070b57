"""The turns a target knows: submit (plan, build, launch), follow, signal, finish, recover.

A turn's life is its own task on the server's event loop; no request handler
waits for it, so a client that goes away changes nothing for the turn. Every
turn is on disk (``store``) and in the ledger, so a restarted target can say
what became of each: finished, or lost with the process that ran it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from shared.wire import FenceView, PlannedMount, PlanResult, Turn, TurnRequest, Usage
from target_side.config import Settings
from target_side.errors import (
    BackendError,
    RefusedError,
    StdinClosed,
    TargetError,
    TurnNotRunning,
    UnknownTurn,
)
from target_side.fence.held import FailureHook, no_failure
from target_side.fence.home import open_state_root
from target_side.fence.identity import for_settings
from target_side.fence.launch import find_bwrap, launch_turn, signal_reset_prefix
from target_side.fence.limits import Limiter
from target_side.fence.runner import Outcome, RunningTurn
from target_side.policy import refusals
from target_side.policy.plan import FencePlan, plan_turn
from target_side.service.health import HealthBoard
from target_side.service.ledger import Ledger
from target_side.service.spool import EventSpool, now
from target_side.service.store import StoredTurn, TurnStore, expired

log = logging.getLogger("paddock.target")

FAILING_AFTER = 3
"""Consecutive turns the target itself failed before health says ``turns-failing``."""
MIN_FREE_BYTES = 256 << 20
"""Below this much free space under the state root, health says ``disk``."""


@dataclass
class TurnRecord:
    """A turn, its event spool, and (while it runs) its process."""

    stored: StoredTurn
    spool: EventSpool
    running: RunningTurn | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def turn(self) -> Turn:
        return self.stored.turn

    def update(self, **changes: Any) -> None:
        self.stored = self.stored.model_copy(update={"turn": self.turn.model_copy(update=changes)})


class TurnManager:
    """Every turn of one target, keyed by id."""

    def __init__(
        self, settings: Settings, board: HealthBoard, inject: FailureHook = no_failure
    ) -> None:
        self.settings = settings
        self.board = board
        self.store = TurnStore(settings.state_root)
        self._inject = inject
        self._turns: dict[str, TurnRecord] = {}
        self._idempotency: dict[str, str] = {}
        self._bwrap: str | None = None
        self.limiter = Limiter.detect()
        self.identity = for_settings(settings)
        self._ledger: Ledger | None = None
        self._failures = 0

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            raise TargetError("the turn manager has not been started")
        return self._ledger

    def bwrap(self) -> str:
        if self._bwrap is None:
            self._bwrap = find_bwrap()
        return self._bwrap

    async def start(self) -> None:
        """Open the ledger, take back every turn on disk, and reap what a crash left."""
        await asyncio.to_thread(open_state_root, self.settings.state_root)
        self._ledger = await asyncio.to_thread(Ledger, self.settings.state_root)
        for stored in await asyncio.to_thread(lambda: list(self.store.load_all())):
            await self._recover(stored)
        # Probed once with a child process: off the event loop, before any turn needs it.
        await asyncio.to_thread(signal_reset_prefix)

    async def _recover(self, stored: StoredTurn) -> None:
        record = TurnRecord(stored, EventSpool(self.store.spool_path(stored.turn.turn_id)))
        self._turns[stored.turn.turn_id] = record
        if stored.idempotency:
            self._idempotency[stored.idempotency] = stored.turn.turn_id
        if stored.turn.state != "running":
            if not record.spool.finished:
                _append_terminal(record)  # stopped between the record and the event
            return
        # The process that ran it is gone (bwrap dies with its parent): the turn is lost.
        if not record.spool.finished:
            record.spool.append(
                "notice", message="the target restarted while this turn ran; it was lost"
            )
            record.spool.append("exit", exit_code=125, signal=None)
        record.update(state="lost", exit_code=125, ended_at=now())
        await self._persist(record)
        await self.ledger.append("end", turn=_turn_json(record.turn))
        log.warning("turn %s was running when the target stopped; marked lost", stored.turn.turn_id)

    async def submit(self, request: TurnRequest, idempotency_key: str | None = None) -> Turn:
        """Plan, build and launch a turn; a refusal is a finished turn, not an error."""
        key = _idempotency_digest(request.role, idempotency_key)
        if key is not None and key in self._idempotency:
            return self._turns[self._idempotency[key]].turn
        record = self._new_record(request, key)
        self._check_disk()
        try:
            plan = plan_turn(request, self.settings, record.turn.turn_id)
            await self._launch(record, plan)
        except RefusedError as refused:
            await self._finish(
                record, Outcome(refused.refusal.exit_code, refusal=refused.refusal), request
            )
        return record.turn

    def _new_record(self, request: TurnRequest, key: str | None) -> TurnRecord:
        turn_id = f"t-{uuid.uuid4().hex}"
        turn = Turn(turn_id=turn_id, role=request.role, state="running", created_at=now())
        stored = StoredTurn(turn=turn, idempotency=key)
        record = TurnRecord(stored, EventSpool(self.store.spool_path(turn_id)))
        self._turns[turn_id] = record
        if key is not None:
            self._idempotency[key] = turn_id
        return record

    async def _launch(self, record: TurnRecord, plan: FencePlan) -> None:
        try:
            bwrap = self.bwrap()
        except BackendError as exc:
            raise refusals.backend_unavailable(str(exc)) from exc
        await self._prepare_home(record, plan)
        running = await self._spawn(bwrap, plan, record.spool)
        record.running = running
        record.update(started_at=now(), executable=plan.executable)
        await self._persist(record)
        await self.ledger.append("launch", turn=_turn_json(record.turn), **_launch_facts(plan))
        record.spool.append("started", executable=plan.executable)
        record.task = asyncio.create_task(self._follow(record, plan))

    async def _prepare_home(self, record: TurnRecord, plan: FencePlan) -> None:
        try:
            repaired = await self.identity.prepare_home(
                self.settings.state_root, plan.role, (plan.uid, plan.gid)
            )
        except TargetError as exc:
            raise refusals.backend_unavailable(str(exc)) from exc
        if repaired is not None:
            record.spool.append("notice", message=repaired)

    async def _spawn(self, bwrap: str, plan: FencePlan, spool: EventSpool) -> RunningTurn:
        return await launch_turn(
            bwrap, plan, spool.append, self.limiter, self._inject, self.identity
        )

    async def _follow(self, record: TurnRecord, plan: FencePlan) -> None:
        running = record.running
        if running is None:
            return
        try:
            outcome = await running.wait()
        except Exception:
            log.exception("turn %s: lost track of its process", plan.turn_id)
            running.kill_now()
            outcome = Outcome(125)
        try:
            moved = await self.identity.audit(
                plan.role, (plan.uid, plan.gid), plan.audit, plan.turn_id
            )
        except TargetError as exc:
            log.error("turn %s: the audit after it could not run: %s", plan.turn_id, exc)
            moved = [f"the protected paths could not be checked after the turn: {exc}"]
        for said in moved:
            record.spool.append("notice", message=said)
        await self._finish(record, outcome)

    async def _finish(
        self, record: TurnRecord, outcome: Outcome, request: TurnRequest | None = None
    ) -> None:
        state = "refused" if outcome.refusal is not None else "exited"
        record.update(
            state=state,
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            refusal=outcome.refusal,
            ended_at=now(),
            usage=Usage(wall_s=outcome.wall_s, cpu_s=outcome.cpu_s, max_rss_kb=outcome.max_rss_kb),
            output_truncated=outcome.output_truncated,
        )
        record.running = None
        self._count_health(outcome)
        # Durable first: whoever sees the terminal event can rely on record and ledger.
        await self._persist(record)
        facts = {"request": _request_facts(request)} if request is not None else {}
        await self.ledger.append("end", turn=_turn_json(record.turn), **facts)
        _append_terminal(record)
        log.info(
            "turn %s role=%s ended state=%s exit=%s",
            record.turn.turn_id,
            record.turn.role,
            state,
            outcome.exit_code,
        )

    def _count_health(self, outcome: Outcome) -> None:
        """Target-made failures count towards ``turns-failing``; only a turn that ran clears it."""
        target_failed = outcome.exit_code == 125 or (
            outcome.refusal is not None and outcome.refusal.rule == "backend-unavailable"
        )
        if target_failed:
            self._failures += 1
            if self._failures >= FAILING_AFTER:
                self.board.degrade(
                    "turns-failing", f"the last {self._failures} turns failed in the target itself"
                )
        elif outcome.refusal is None:
            self._failures = 0
            self.board.recover("turns-failing")

    def _check_disk(self) -> None:
        free = shutil.disk_usage(self.settings.state_root).free
        if free < MIN_FREE_BYTES:
            self.board.degrade(
                "disk", f"only {free >> 20} MiB free under {self.settings.state_root}"
            )
        else:
            self.board.recover("disk")

    async def _persist(self, record: TurnRecord) -> None:
        await asyncio.to_thread(self.store.save, record.stored)

    def dry_run(self, request: TurnRequest) -> PlanResult:
        """The fence ``request`` would get, or its refusal; nothing is built or launched."""
        try:
            plan = plan_turn(request, self.settings, f"t-{uuid.uuid4().hex}")
        except RefusedError as refused:
            return PlanResult(refusal=refused.refusal, exit_code=refused.refusal.exit_code)
        return PlanResult(fence=fence_view(plan), exit_code=0)

    def get(self, turn_id: str, roles: frozenset[str]) -> TurnRecord:
        """The turn ``turn_id`` if it belongs to one of ``roles``."""
        record = self._turns.get(turn_id)
        if record is None or record.turn.role not in roles:
            raise UnknownTurn(f"no turn {turn_id} among the turns of this token's roles")
        return record

    async def recent(self, roles: frozenset[str], limit: int) -> list[Turn]:
        """The newest ``limit`` turns of ``roles``, as the ledger last recorded each."""

        def fold() -> list[Turn]:
            latest: dict[str, Turn] = {}
            for entry in self.ledger.records():
                turn = Turn.model_validate(entry["turn"])
                if turn.role in roles:
                    latest[turn.turn_id] = turn
            return sorted(latest.values(), key=lambda t: t.created_at, reverse=True)[:limit]

        return await asyncio.to_thread(fold)

    def signal(self, record: TurnRecord, name: str) -> int:
        if record.running is None:
            raise TurnNotRunning(f"turn {record.turn.turn_id} has ended; it takes no signal")
        return record.running.signal(name)

    async def write_stdin(self, record: TurnRecord, data: bytes, eof: bool) -> None:
        if record.running is None:
            raise TurnNotRunning(f"turn {record.turn.turn_id} has ended; it takes no input")
        try:
            await record.running.write_stdin(data, eof)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise StdinClosed(
                f'turn {record.turn.turn_id} takes no input: start it with stdin "open", '
                "and send nothing after eof"
            ) from exc

    async def sweep(self, at: datetime | None = None) -> int:
        """Remove finished turns older than the retention time; returns how many went."""
        moment = at or datetime.now(UTC)
        retention = self.settings.server.retention_h * 3600
        gone = [
            r
            for r in self._turns.values()
            if r.running is None and expired(r.turn, moment, retention)
        ]
        for record in gone:
            del self._turns[record.turn.turn_id]
            if record.stored.idempotency:
                self._idempotency.pop(record.stored.idempotency, None)
            record.spool.close()
            await asyncio.to_thread(self.store.remove, record.turn.turn_id)
        return len(gone)

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


def fence_view(plan: FencePlan) -> FenceView:
    """The wire view of a plan: mounts with modes, env names (never values), limits."""
    return FenceView(
        backend="bubblewrap",
        argv=list(plan.argv),
        executable=plan.executable,
        cwd=plan.cwd,
        uid=plan.uid,
        gid=plan.gid,
        network=plan.network,
        env_names=sorted(plan.env),
        mounts=[
            PlannedMount(kind=m.kind, source=m.source, dest=m.dest, subject=m.subject)
            for m in plan.mounts
        ],
        limits=plan.limits,
    )


def _append_terminal(record: TurnRecord) -> None:
    turn = record.turn
    if turn.refusal is not None:
        record.spool.append("refused", refusal=turn.refusal, exit_code=turn.exit_code)
    else:
        record.spool.append("exit", exit_code=turn.exit_code, signal=turn.signal)


def _idempotency_digest(role: str, key: str | None) -> str | None:
    # Scoped to the role: the same key from another role is another request.
    return None if key is None else hashlib.sha256(f"{role}\0{key}".encode()).hexdigest()


def _turn_json(turn: Turn) -> dict[str, Any]:
    return turn.model_dump(mode="json", exclude_none=True)


def _launch_facts(plan: FencePlan) -> dict[str, Any]:
    """What the ledger keeps of a launch. Env names only: values may be secrets."""
    return {
        "argv": list(plan.argv),
        "executable": plan.executable.model_dump(),
        "env_names": sorted(plan.env),
        "cwd": plan.cwd,
        "uid": plan.uid,
        "network": plan.network,
        "limits": plan.limits.model_dump(),
    }


def _request_facts(request: TurnRequest) -> dict[str, Any]:
    """What the ledger keeps of a refused request: what it asked to run, and env names only."""
    program: list[str] = request.argv or ["<script>", f"sha256:{request.script_sha256}"]
    return {"argv": program, "cwd": request.cwd, "env_names": sorted(request.env)}
