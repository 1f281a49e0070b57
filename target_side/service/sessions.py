"""Sessions: one long-lived fence with one shell, and the turns that run in it one at a time.

A session is planned exactly as a turn with the same fields would be
(``policy.sessions``), launched the same way (the role's uid, the launcher
where there is one, the same limits, now for the whole session), and its
fence runs the session host (``fence.session_host``), which keeps a bash.
The session is ``open`` once that shell is ready; ``refused`` when the fence
refused it (nothing ran); ``closed`` once it ended (by request, its shell
exiting, its own time or idle limit, or the target stopping); ``lost`` when
the target restarted while it was open.

Each turn in a session is a turn like any other (``TurnManager``): its own
id, record, spool, ledger records, idempotency, stdin, signals and limits;
only its process is the session's shell, so it gets exactly the session's
fence and nothing its own request could widen (the wire model rejects those
fields). One turn at a time: another is answered 409 while one runs.

Protected names are audited after each turn and when the session ends. An
open session counts as one running turn against the caps (``[server]
max_turns``, the role's ``turns``): it holds a fence, whether a turn runs in
it or not. A stopping target ends idle sessions at once and the others once
their turn has ended or the grace time is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import shlex
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from shared.wire import LeaseRef, Refusal, Session, SessionRequest, Turn, TurnRequest
from target_side.errors import (
    BackendError,
    RefusedError,
    SessionBusy,
    SessionEnded,
    StorageError,
    TargetError,
    UnknownSession,
)
from target_side.fence.launch import launch_turn
from target_side.fence.session_fence import SessionFence, SessionTurn
from target_side.policy import refusals
from target_side.policy.sessions import SessionPlan, plan_session
from target_side.service.session_store import SessionStore, StoredSession
from target_side.service.spool import now

if TYPE_CHECKING:
    from target_side.fence.runner import Outcome
    from target_side.service.turns import StartedElsewhere, TurnManager, TurnRecord

log = logging.getLogger("paddock.target")

HELLO_WAIT_S = 30.0
"""How long a new session's shell may take to be ready before the session is refused."""
ENDED_BY_REQUEST = "the session was ended on request"


@dataclass
class SessionRecord:
    """A session, its fence while it lives, and the turn running in it, if any."""

    stored: StoredSession
    plan: SessionPlan | None = None
    fence: SessionFence | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    watch: asyncio.Task[None] | None = field(default=None, repr=False)
    busy: str | None = None
    """The turn running in it ("" while one is being started)."""
    woken: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set when a turn starts or ends: the idle watch looks again."""
    idle_since: float = 0.0
    """When (on the loop's clock) its last turn ended, or it opened."""
    admitted: bool = False
    lease: LeaseRef | None = None
    """The lease it was started under: each of its turns naming none acts under it."""
    notices: list[str] = field(default_factory=list)
    dirty: bool = False
    writing: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held through each write of its record: writes on threads would otherwise land in any
    order, and an older state written last stays on disk."""

    @property
    def session(self) -> Session:
        return self.stored.session

    def update(self, **changes: Any) -> None:
        session = self.session.model_copy(update=changes)
        self.stored = self.stored.model_copy(update={"session": session})


class SessionManager:
    """Every session of one target, keyed by id; it lives inside the ``TurnManager``."""

    def __init__(self, turns: TurnManager) -> None:
        self.turns = turns
        self.store = SessionStore(turns.settings.state_root)
        self._sessions: dict[str, SessionRecord] = {}
        self._idempotency: dict[str, str] = {}

    # --- life of the target -----------------------------------------------------------------

    async def start(self) -> None:
        """Take back every session on disk: one that was open is lost (its processes died)."""
        found = await asyncio.to_thread(lambda: list(self.store.load_all()))
        for stored in found:
            record = SessionRecord(stored)
            self._sessions[stored.session.session_id] = record
            if stored.idempotency:
                self._idempotency[stored.idempotency] = stored.session.session_id
            if stored.session.state == "open":
                record.update(
                    state="lost",
                    ended_at=now(),
                    turn_id=None,
                    ended="the target restarted while the session was open; everything "
                    "running in it ended with the target",
                )
                await self._persist(record)
                await self.turns.record_in_ledger("session-end", session=_json(record.session))
                log.warning("session %s was open when the target stopped; marked lost", _id(record))

    async def stop(self, *, idle_only: bool) -> None:
        """The target is stopping: end idle sessions (``idle_only``), or every one left."""
        for record in list(self._sessions.values()):
            if record.session.state == "open" and (record.busy is None or not idle_only):
                await self._end(record, "the target stopped, and ended the session")

    async def shutdown(self) -> None:
        """Kill every fence left and wait until each session is recorded as ended."""
        tasks = []
        for record in self._sessions.values():
            if record.fence is not None and record.task is not None and not record.task.done():
                record.fence.ending = record.fence.ending or "the target stopped"
                record.fence.kill_now()
                tasks.append(record.task)
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks)

    async def sweep(self, moment: datetime, retention_s: float) -> int:
        """Remove ended sessions older than the retention time; the ledger keeps them."""
        gone = [
            r
            for r in self._sessions.values()
            if r.session.finished
            and not r.dirty
            and r.session.ended_at is not None
            and (moment - r.session.ended_at).total_seconds() > retention_s
        ]
        for record in gone:
            del self._sessions[_id(record)]
            if record.stored.idempotency:
                self._idempotency.pop(record.stored.idempotency, None)
            await asyncio.to_thread(self.store.remove, _id(record))
        return len(gone)

    async def flush(self) -> bool:
        """Write the records the disk refused before; True when none is left."""
        written = True
        for record in self._sessions.values():
            if record.dirty:
                written = await self._persist(record) and written
        return written

    # --- the routes ---------------------------------------------------------------------------

    def get(self, session_id: str, roles: frozenset[str]) -> SessionRecord:
        """The session ``session_id`` if it belongs to one of ``roles``."""
        record = self._sessions.get(session_id)
        if record is None or record.session.role not in roles:
            raise UnknownSession(
                f"no session {session_id} among the sessions of this token's roles"
            )
        return record

    def listed(self, roles: frozenset[str], limit: int) -> list[Session]:
        """The newest ``limit`` sessions of ``roles``, newest first."""
        mine = [r.session for r in self._sessions.values() if r.session.role in roles]
        return sorted(mine, key=lambda s: s.created_at, reverse=True)[:limit]

    async def create(self, request: SessionRequest, idempotency_key: str | None = None) -> Session:
        """Plan and start a session; a refusal is a session too (``refused``), not an error.

        Answers once the session's shell is ready (or the session was refused).
        Raises ``TurnCapReached`` or ``TargetUnavailable`` (nothing made) when the
        caps or the disk leave no room for another fence.
        """
        key = _digest(request.role, idempotency_key)
        if key is not None and key in self._idempotency:
            return self._sessions[self._idempotency[key]].session
        self.turns.admit(request.role)
        session_id = f"s-{uuid.uuid4().hex}"
        created = Session(session_id=session_id, role=request.role, state="open", created_at=now())
        record = SessionRecord(StoredSession(session=created, idempotency=key), admitted=True)
        self._sessions[session_id] = record
        if key is not None:
            self._idempotency[key] = session_id
        # Opened, refused or failed to its end, whether the caller still waits or not.
        return await self.turns.started_whoever_waits(self._start(record, request))

    async def _start(self, record: SessionRecord, request: SessionRequest) -> Session:
        session_id = _id(record)
        try:
            leases = self.turns.leases
            leases.admit(request.role, request.lease)
            record.lease = request.lease
            plan = await asyncio.to_thread(self._plan, request, session_id)
            record.plan = plan
            # Again at launch: a seat taken over while it was planned refuses it.
            leases.admit(request.role, request.lease)
            await self._launch(record, plan)
        except RefusedError as refused:
            await self._refused(record, refused.refusal, request)
        except Exception:
            log.exception("session %s: the target failed to start it", session_id)
            why = "the target failed to start the session; the target's log says why"
            await self._refused(record, refusals.backend_unavailable(why), request)
        return record.session

    async def end(self, record: SessionRecord) -> Session:
        """End the session (``DELETE``): everything in it is killed, its scratch goes with it."""
        if record.session.state == "open":
            await self._end(record, ENDED_BY_REQUEST)
        return record.session

    async def submit_turn(self, request: TurnRequest, idempotency_key: str | None = None) -> Turn:
        """Run ``request`` in its session's shell: a turn like any other, one at a time.

        404 if the session is not one of the request's role; 409 when it has
        ended or already runs a turn (a retried POST with the same key gets its turn).
        """
        session_id = request.session or ""
        record = self.get(session_id, frozenset({request.role}))
        known = self.turns.known(request.role, idempotency_key)
        if known is not None:
            return known
        if record.session.state != "open" or record.fence is None:
            refusal = record.session.refusal
            why = record.session.ended or (refusal.detail if refusal else record.session.state)
            raise SessionEnded(
                f"session {session_id} is {record.session.state} ({why}); "
                "start another session, or run the turn without one"
            )
        if record.busy is not None:
            running = f"turn {record.busy}" if record.busy else "another turn"
            raise SessionBusy(
                f"session {session_id} is running {running}; a session runs one turn at a "
                "time: wait for it to end (or signal it), then submit again",
                record.busy or None,
            )
        record.busy = ""
        try:
            start = functools.partial(self._start_turn, record, request)
            turn = await self.turns.submit_elsewhere(request, idempotency_key, start)
        except BaseException:
            self._turn_over(record)
            raise
        if turn.finished:
            self._turn_over(record)
        return turn

    # --- starting a session ------------------------------------------------------------------

    def _plan(self, request: SessionRequest, session_id: str) -> SessionPlan:
        try:
            etc = str(self.turns.etc.current())
        except OSError as exc:
            raise RefusedError(
                refusals.backend_unavailable(f"could not copy the fence's /etc: {exc}")
            ) from exc
        return plan_session(request, self.turns.settings, session_id, etc_dir=etc)

    async def _launch(self, record: SessionRecord, plan: SessionPlan) -> None:
        fence_plan = plan.fence
        try:
            bwrap = self.turns.bwrap()
        except BackendError as exc:
            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc
        try:
            repaired = await self.turns.identity.prepare_home(
                self.turns.settings.state_root, fence_plan.role, (fence_plan.uid, fence_plan.gid)
            )
        except TargetError as exc:
            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc
        if repaired is not None:
            record.notices.append(repaired)
        launched = await launch_turn(
            bwrap,
            fence_plan,
            self._fence_notice(record),
            self.turns.limiter,
            self.turns.inject,
            self.turns.identity,
            kind=SessionFence,
        )
        fence = cast(SessionFence, launched)
        record.fence = fence
        record.task = asyncio.create_task(self._follow(record))
        try:
            await asyncio.wait_for(asyncio.shield(fence.hello), HELLO_WAIT_S)
        except (TimeoutError, BrokenPipeError):
            fence.ending = fence.ending or "the session's shell did not start"
            fence.kill()
            await record.task  # records it as refused
            return
        record.update(
            started_at=now(),
            last_active_at=now(),
            cwd=fence_plan.cwd,
            limits=plan.times,
        )
        await self._persist(record)
        facts = self.turns.launch_facts(fence_plan)
        await self.turns.record_in_ledger("session-start", session=_json(record.session), **facts)
        record.idle_since = asyncio.get_running_loop().time()
        record.watch = asyncio.create_task(self._watch_idle(record))
        log.info("session %s role=%s open", _id(record), record.session.role)

    def _fence_notice(self, record: SessionRecord) -> Callable[..., object]:
        def emit(kind: str, **fields: object) -> None:
            if kind == "notice":
                record.notices.append(str(fields.get("message", "")))

        return emit

    async def _refused(
        self, record: SessionRecord, refusal: Refusal, request: SessionRequest | None
    ) -> None:
        record.update(state="refused", refusal=refusal, ended_at=now())
        self._release(record)
        await self._persist(record)
        facts: dict[str, Any] = {}
        if request is not None:
            facts["request"] = {"cwd": request.cwd, "env_names": sorted(request.env)}
        await self.turns.record_in_ledger("session-end", session=_json(record.session), **facts)
        log.info("session %s role=%s refused: %s", _id(record), record.session.role, refusal.rule)

    # --- a session's end ---------------------------------------------------------------------

    async def _end(self, record: SessionRecord, why: str) -> None:
        fence, task = record.fence, record.task
        if fence is None or task is None:
            return
        fence.ending = fence.ending or why
        fence.kill()
        await asyncio.shield(task)

    async def _follow(self, record: SessionRecord) -> None:
        """Wait for the fence to end, then audit and record the session's end."""
        fence, plan = record.fence, record.plan
        if fence is None or plan is None:
            return
        try:
            await self._follow_to_end(record, fence, plan)
        finally:
            # After the end is out: removing cgroups waits for their last task to go.
            try:
                await fence.cleanup()
            except Exception:
                log.exception("session %s: cleaning up after it failed", _id(record))

    async def _follow_to_end(
        self, record: SessionRecord, fence: SessionFence, plan: SessionPlan
    ) -> None:
        try:
            outcome = await fence.wait()
        except Exception:
            log.exception("session %s: lost track of its fence", _id(record))
            fence.kill_now()
            outcome = None
        if record.watch is not None:
            record.watch.cancel()
        fence_plan = plan.fence
        try:
            moved = await self.turns.identity.audit(
                fence_plan.role, (fence_plan.uid, fence_plan.gid), fence_plan.audit, _id(record)
            )
        except TargetError as exc:
            log.error("session %s: the audit after it could not run: %s", _id(record), exc)
            moved = [f"the protected paths could not be checked after the session: {exc}"]
        record.notices += moved
        if not fence.hello.done() or record.session.started_at is None:
            refusal = outcome.refusal if outcome is not None else None
            if refusal is None:
                why = fence.last_words or "it ended before it was ready"
                refusal = refusals.no_session_host("python3", f"the session host failed: {why}")
            await self._refused(record, refusal, None)
            return
        record.update(
            state="closed",
            ended_at=now(),
            turn_id=None,
            ended=self._why_ended(record, fence, outcome),
            exit_code=fence.shell_status,
        )
        self._release(record)
        await self._persist(record)
        facts = {"notices": record.notices} if record.notices else {}
        await self.turns.record_in_ledger("session-end", session=_json(record.session), **facts)
        log.info("session %s role=%s closed: %s", _id(record), record.session.role, _ended(record))

    def _why_ended(
        self, record: SessionRecord, fence: SessionFence, outcome: Outcome | None
    ) -> str:
        limits = record.session.limits
        if fence.ending is not None:
            why = fence.ending
        elif fence.timed_out and limits is not None:
            why = f"the session reached its time limit (session_s = {limits.session_s:g} s)"
        elif fence.shell_reason:
            why = fence.shell_reason
        else:
            code = outcome.exit_code if outcome is not None else "unknown"
            why = f"the session's fence ended (status {code})"
            if fence.last_words:
                why += f"; its host's last words: {fence.last_words}"
        notes = [n for n in record.notices if n]
        return "; ".join([why, *notes])

    def _release(self, record: SessionRecord) -> None:
        if record.admitted:
            record.admitted = False
            self.turns.release(record.session.role)

    async def _watch_idle(self, record: SessionRecord) -> None:
        """End the session once it has gone ``session_idle_s`` without a turn."""
        limits = record.session.limits
        if limits is None:
            return
        loop = asyncio.get_running_loop()
        while record.session.state == "open":
            record.woken.clear()
            if record.busy is not None:
                await record.woken.wait()
                continue
            left = record.idle_since + limits.session_idle_s - loop.time()
            if left <= 0:
                await self._end(
                    record,
                    f"the session was idle for {limits.session_idle_s:g} s (session_idle_s), "
                    "so the target ended it",
                )
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.woken.wait(), left)

    # --- a turn in a session -----------------------------------------------------------------

    async def _start_turn(
        self, record: SessionRecord, request: TurnRequest, turn: TurnRecord
    ) -> StartedElsewhere:
        from target_side.service.turns import StartedElsewhere

        fence, plan = record.fence, record.plan
        if fence is None or plan is None or record.session.state != "open":
            raise SessionEnded(f"session {_id(record)} has ended")
        # A zombie holding a session's id acts no longer than its lease: each turn is checked.
        self.turns.leases.admit(request.role, request.lease or record.lease)
        turn_id = turn.turn.turn_id
        record.busy = turn_id
        record.update(turn_id=turn_id)
        record.woken.set()
        times = plan.times
        wall_s = _within("wall_s", request.limits.wall_s, times.wall_s)
        output_mb = _within("output_mb", request.limits.output_mb, times.output_mb)
        source = _source(request)
        running = SessionTurn(
            fence,
            turn_id,
            turn.spool.append,
            wall_s,
            int(output_mb) << 20,
            stdin_open=request.stdin == "open",
            tty=request.tty,
        )
        facts = {
            "session_id": _id(record),
            "argv": request.argv or ["<script>", f"sha256:{request.script_sha256}"],
            "tty": request.tty is not None,
            "limits": {"wall_s": wall_s, "output_mb": output_mb},
        }

        async def begin() -> None:
            # After the turn's "started" event: nothing it prints can come before it.
            try:
                await running.start(source)
            except (BrokenPipeError, ConnectionError):
                running.session_gone(fence.ending or "the session ended", fence.timed_out)

        audit_plan = replace(plan.fence, turn_id=turn_id)
        return StartedElsewhere(running, audit_plan, facts, begin, self._on_turn_end(record))

    def _on_turn_end(self, record: SessionRecord) -> Callable[[], Awaitable[None]]:
        async def over() -> None:
            # Once the turn is recorded (and audited): only then may the next one start.
            record.update(turns=record.session.turns + 1, last_active_at=now())
            self._turn_over(record)
            if record.session.state == "open":
                await self._persist(record)

        return over

    def _turn_over(self, record: SessionRecord) -> None:
        record.busy = None
        record.idle_since = asyncio.get_running_loop().time()
        if record.session.turn_id is not None:
            record.update(turn_id=None)
        record.woken.set()

    # --- the disk ----------------------------------------------------------------------------

    async def _persist(self, record: SessionRecord) -> bool:
        try:
            async with record.writing:
                # The state as it is once the last write is down, not as it was when asked.
                await asyncio.to_thread(self.store.save, record.stored)
        except OSError as exc:
            record.dirty = True
            self.turns.storage_failed(
                StorageError(f"the record of session {_id(record)}: {exc.strerror or exc}")
            )
            return False
        record.dirty = False
        return True


def _source(request: TurnRequest) -> str:
    """What the shell sources for a turn: its script, or its argv quoted as one command."""
    if request.script is not None:
        actual = hashlib.sha256(request.script.encode()).hexdigest()
        if actual != request.script_sha256:
            raise RefusedError(refusals.digest_mismatch(str(request.script_sha256), actual))
        return request.script
    return shlex.join(request.argv or []) + "\n"


def _within(name: str, asked: float | None, most: float) -> float:
    # A turn may ask the session for less time or output, never more.
    if asked is not None and asked > most:
        raise RefusedError(refusals.limit_exceeds_session(name, asked, most))
    return most if asked is None else asked


def _digest(role: str, key: str | None) -> str | None:
    # Scoped to the role, and apart from turns' keys: the same key may start a turn too.
    return None if key is None else hashlib.sha256(f"session\0{role}\0{key}".encode()).hexdigest()


def _id(record: SessionRecord) -> str:
    return record.session.session_id


def _ended(record: SessionRecord) -> str:
    return record.session.ended or record.session.state


def _json(session: Session) -> dict[str, Any]:
    return session.model_dump(mode="json", exclude_none=True)
