"""The turns a target knows: submit (plan, build, launch), follow, signal, finish, recover.

A turn's life is its own task on the server's event loop; no request handler
waits for it, so a client that goes away changes nothing for the turn. Every
turn is on disk (``store``) and in the ledger, so a restarted target can say
what became of each: finished, or lost with the process that ran it.

Admission: a turn is admitted only under both caps on running turns (the
target's ``max_turns``, its role's ``turns``), while the state disk takes
writes, and while the target is not stopping; otherwise the request is
answered (429 or 503, with Retry-After) and nothing is made.

A full disk: a turn whose output the spool cannot take is killed and ends 125
with a notice naming the disk; every write the disk refused (a record, a ledger
record, the target's closing events) is held in memory and written when a
probe finds the disk writable again, which is also what clears the ``disk``
health cause. Followers get every turn's closing events either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from shared.exit_status import ExitStatus, for_signal
from shared.wire import (
    Event,
    ExitEvent,
    FenceView,
    PlannedMount,
    PlanResult,
    RefusedEvent,
    Turn,
    TurnRequest,
    Usage,
)
from target_side.config import Settings
from target_side.errors import (
    BackendError,
    LimitError,
    NoTerminal,
    RefusedError,
    StdinClosed,
    StorageError,
    TargetError,
    TargetUnavailable,
    TurnCapReached,
    TurnNotRunning,
    UnknownTurn,
)
from target_side.fence.etc import CuratedEtc, RoleEntry
from target_side.fence.held import FailureHook, no_failure
from target_side.fence.home import looks_ready, open_state_root
from target_side.fence.identity import InProcess, for_settings
from target_side.fence.identity import warm as warm_spawning
from target_side.fence.launch import (
    StartingTurn,
    env_default_signal,
    find_bwrap,
    launch_turn,
    start_turn,
)
from target_side.fence.launcher_client import ViaLauncher
from target_side.fence.limits import Limiter, Totals, TurnLimits
from target_side.fence.nursery import Slot, send_away
from target_side.fence.runner import Outcome, RunningTurn
from target_side.fence.session_fence import SessionTurn
from target_side.policy import refusals
from target_side.policy.forbidden import curated_etc_root, home_place
from target_side.policy.mounts import ETC_ENTRIES
from target_side.policy.plan import FencePlan, plan_turn
from target_side.service.health import HealthBoard
from target_side.service.leases import LeaseBook
from target_side.service.ledger import Latest, Ledger
from target_side.service.listing import newest_turns
from target_side.service.sessions import SessionManager
from target_side.service.spool import EventSpool, SpoolAtRest, now
from target_side.service.state_lock import StateLock
from target_side.service.store import (
    Found,
    StoredTurn,
    TurnStore,
    Unrecorded,
    expired,
    turn_id_of,
)

log = logging.getLogger("paddock.target")
T = TypeVar("T")

FAILING_AFTER = 3
"""Consecutive turns the target itself failed before health says ``turns-failing``."""
MIN_FREE_BYTES = 256 << 20
MIN_FREE_SHARE = 0.05
"""Below the smaller of these (bytes, share of the filesystem) free, health says ``disk``."""
PROBE_BYTES = 64 << 10
"""What the disk probe writes (and removes) to see the state disk takes writes again."""
DISK_POLL_S = 1.0
"""How often a failing disk is probed; a healthy one is looked at every ``DISK_CHECK_S``."""
DISK_CHECK_S = 10.0
CAP_RETRY_AFTER_S = 1
DISK_RETRY_AFTER_S = 10
STOP_RETRY_AFTER_S = 5
STOP_POLL_S = 0.05
KILL_WAIT_S = 10.0
"""After the grace time: how long killed turns get to be reaped and recorded."""
LAUNCH_FAILED = "the target failed to launch this turn; the target's log says why"
BLOCKING_THREADS = 64
"""Threads for the blocking steps of turns (mostly waiting on the kernel, not on Python)."""
BOOKKEEPING_WAIT_S = 1.0
"""How long a started turn's bookkeeping on the loop waits for the turns being planned."""
PLANNING_THREADS = 8
"""Threads that make and plan new turns: a burst's turns go through a few at a time, first
come first launched, rather than all at once on the blocking pool (``_planning``)."""
AWAKE_ENDED = 64
"""Ended turns kept whole in memory, the latest to end or to be asked for; the others wait
out their retention time at rest (``Resting``), in under a quarter of the memory."""
Resting = tuple[str, float, str | None, bytes, SpoolAtRest]
"""An ended turn at rest: its role, when it ended (epoch seconds), its idempotency digest, its
``StoredTurn`` as JSON, and its spool at rest. A plain tuple of plain values, which the
collector stops tracking, where a whole ``TurnRecord`` is some thirty objects it walks on
every full collection."""


@dataclass
class TurnRecord:
    """A turn, its event spool, and (while it runs) its process."""

    stored: StoredTurn
    spool: EventSpool
    running: RunningTurn | SessionTurn | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    admitted: bool = False
    """Counted against the caps on running turns until it ends."""
    stopped: str | None = None
    """Why the target, stopping, killed it (not anything of its own); said in a notice."""

    @property
    def turn(self) -> Turn:
        return self.stored.turn

    def update(self, **changes: Any) -> None:
        self.stored = self.stored.model_copy(update={"turn": self.turn.model_copy(update=changes)})


@dataclass(frozen=True)
class StartedElsewhere:
    """A turn whose process something else runs (a session's shell), ready to begin."""

    running: SessionTurn
    plan: FencePlan
    """The fence it runs in: what the audit after it checks."""
    facts: dict[str, Any]
    """What the ledger's launch record says of it."""
    begin: Callable[[], Awaitable[None]]
    """Hand it its command: called once its ``started`` event is spooled."""
    ended: Callable[[], Awaitable[None]]
    """Called once it is recorded as ended."""


@dataclass
class Planned:
    """A turn's plan, whether its role's home was made on the thread that planned it, and
    the cgroups made there for it."""

    plan: FencePlan
    home_ready: bool = False
    repaired: str | None = None
    """With ``home_ready``: what had to be repaired in the home, if anything."""
    limits: TurnLimits | None = None
    """The turn's cgroups, until its launch takes them over (``drop`` them if it never does)."""
    starting: StartingTurn | None = None
    """Its bubblewrap, started on the thread that planned it (which then took the cgroups
    over), where nothing had to be asked on the event loop first: ``_start_here``."""

    def drop(self) -> None:
        """The turn will not be launched: its cgroups go (blocking, briefly)."""
        if self.limits is not None:
            self.limits.remove_now()
            self.limits = None


class TurnManager:
    """Every turn of one target, keyed by id (and, through ``sessions``, every session)."""

    def __init__(
        self,
        settings: Settings,
        board: HealthBoard,
        inject: FailureHook = no_failure,
        state_lock: StateLock | None = None,
    ) -> None:
        self.settings = settings
        self.board = board
        self.store = TurnStore(settings.state_root)
        self._inject = inject
        self._turns: dict[str, TurnRecord] = {}
        """Turns running, and the ``AWAKE_ENDED`` latest ended (``_ended``)."""
        self._resting: dict[str, Resting] = {}
        """The other ended turns, until the retention sweep."""
        self._ended: deque[str] = deque()
        self._idempotency: dict[str, str] = {}
        self._bwrap: str | None = None
        server = settings.server
        totals = Totals(server.memory_mb or default_memory_mb(), server.pids)
        self.limiter = Limiter.detect(totals=totals)
        self.etc = CuratedEtc(curated_etc_root(settings), ETC_ENTRIES, role_entries(settings))
        self.identity = for_settings(settings)
        self.leases = LeaseBook(settings)
        self._ledger: Ledger | None = None
        self._failures = 0
        self._lock = state_lock
        self._own_lock = False
        self._running = 0
        self._running_by_role: Counter[str] = Counter()
        self._disk_failure: str | None = None
        self._disk_low: str | None = None
        """Why free space is below the low-water mark, while it is: no new turn either."""
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None
        self._disk_news = asyncio.Event()
        self._planning = ThreadPoolExecutor(PLANNING_THREADS, thread_name_prefix="paddock-plan")
        self._planning_now = 0
        """Turns handed to the planning threads and not yet back."""
        self._planning_idle = asyncio.Event()
        self._planning_idle.set()
        self._starting: set[asyncio.Task[Any]] = set()
        """Turns and sessions being started, each in a task its caller's cancellation does
        not reach."""
        self.sessions = SessionManager(self)

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
        """Lock the state root, open the ledger, take back every turn on disk, reap what's left.

        The lock comes first: nothing in the state root is read or repaired by a
        server that does not hold it.
        """
        root = self.settings.state_root
        # Every turn does blocking work on threads (planning, placing, recording, auditing):
        # the default pool (cores + 4 threads) would make a burst of turns wait in line.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="paddock-blocking")
        )
        await asyncio.to_thread(open_state_root, root)
        if self._lock is None:
            listen = self.settings.server.listen
            self._lock = await asyncio.to_thread(StateLock.acquire, root, listen)
            self._own_lock = True
        try:
            found = await asyncio.to_thread(lambda: list(self.store.load_all()))
            self._ledger = await asyncio.to_thread(Ledger, root)
            ids = {turn_id_of(f) for f in found}
            latest = await asyncio.to_thread(self.ledger.latest_turns, ids)
            for item in found:
                await self._take_back(item, latest)
            await self.leases.start(self.ledger, self._ledger_append, self._storage_failed)
            await self.sessions.start()
            # Helpers probed once with a child process: off the event loop, before any turn.
            await asyncio.to_thread(env_default_signal)
            await asyncio.to_thread(warm_spawning)
            if isinstance(self.identity, InProcess):
                self.limiter.start_nursery(asyncio.get_running_loop())
            elif isinstance(self.identity, ViaLauncher) and self.limiter.hierarchies:
                loop = asyncio.get_running_loop()
                parents = self.limiter.turn_parents()
                self.limiter.keep_slots(self.identity.prepared_launches(loop, parents))
            # The fence's /etc copied now, not by the first turn (a copy takes a while).
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.etc.current)
        except BaseException:
            self._release_lock()
            raise
        if self.ledger.held:
            self._storage_failed(StorageError(f"{self.ledger.path}: records wait for the disk"))
        self._check_low_water()
        self._watch = asyncio.create_task(self._watch_disk())

    async def _take_back(self, item: Found, latest: dict[str, Latest]) -> None:
        turn_id = turn_id_of(item)
        known = latest.get(turn_id)
        spool = EventSpool(self.store.spool_path(item), self._storage_failed)
        if spool.cut is not None:
            where = spool.path.parent.relative_to(self.settings.state_root)
            cut = spool.cut.facts() | {"file": str(where / spool.cut.file)}
            await self._ledger_append("recovery", turn_id=turn_id, cut=cut)
        if isinstance(item, StoredTurn):
            # A record an earlier version wrote: believed as far as the ledger agrees.
            if known is not None and known.kind == "end" and not item.turn.finished:
                # Its end is in the ledger, the commit point; the record, written after, missed it.
                item = item.model_copy(update={"turn": Turn.model_validate(known.turn)})
            await self._recover(item, spool, known)
            return
        if isinstance(item, Unrecorded) and known is not None and known.kind == "end":
            # The usual: the ledger's end line is the turn as it ended; nothing to recover.
            await self._recover(_from_ledger(known), spool, known)
            return
        facts: dict[str, Any] = (
            {"reason": "no end in the ledger"}
            if isinstance(item, Unrecorded)
            else {"reason": item.reason, "kept": item.kept}
        )
        if known is not None:
            stored, facts["rebuilt_from"] = _from_ledger(known), "ledger"
        elif (ended := _turn_of(await spool.terminal())) is not None:
            # Its lines were cut from the ledger (a repair): its last event says how it ended.
            stored, facts["rebuilt_from"] = StoredTurn(turn=ended), "spool"
        else:
            # Never launched (a crash while it was being built): nothing to rebuild it from.
            spool.close()
            moved = await asyncio.to_thread(self.store.move_to_lost_and_found, turn_id)
            facts["moved_to"] = str(moved.relative_to(self.settings.state_root))
            await self._ledger_append("recovery", turn_id=turn_id, record=facts)
            return
        await self._ledger_append("recovery", turn_id=turn_id, record=facts)
        await self._recover(stored, spool, known)

    async def _recover(self, stored: StoredTurn, spool: EventSpool, known: Latest | None) -> None:
        turn_id = stored.turn.turn_id
        record = TurnRecord(stored, spool)
        self._turns[turn_id] = record
        if stored.idempotency:
            self._idempotency[stored.idempotency] = turn_id
        interrupted = stored.turn.state == "running"
        if interrupted:
            await self._end_interrupted(record)
        elif not spool.finished:
            _append_terminal(record)  # stopped between the ledger's end and the event
        # An end the ledger lacks (held when the disk was full, or cut by a repair) is recorded.
        if interrupted or known is None or known.kind != "end":
            await self._ledger_append("end", turn=_turn_json(record.turn))
        self._ended_now(record)

    async def _end_interrupted(self, record: TurnRecord) -> None:
        """A turn running when the target stopped: ended as its spool says, else lost."""
        terminal = await record.spool.terminal()
        ended = _turn_of(terminal)
        if ended is not None:
            # It ended, and only the ledger missed it: its last event is the turn as it ended.
            record.stored = record.stored.model_copy(update={"turn": ended})
            return
        if isinstance(terminal, ExitEvent):
            # The same, said by an older target's terminal event, which lacks the turn.
            record.update(
                state="exited",
                exit_code=terminal.exit_code,
                signal=terminal.signal,
                ended_at=terminal.at,
            )
            return
        if isinstance(terminal, RefusedEvent):
            record.update(
                state="refused",
                exit_code=terminal.exit_code,
                refusal=terminal.refusal,
                ended_at=terminal.at,
            )
            return
        # The process that ran it is gone (bwrap dies with its parent): the turn is lost.
        record.spool.append_kept(
            "notice", message="the target restarted while this turn ran; it was lost"
        )
        record.update(state="lost", exit_code=ExitStatus.PADDOCK_FAILED, ended_at=now())
        _append_terminal(record)
        log.warning("turn %s was running when the target stopped; marked lost", record.turn.turn_id)

    async def submit(self, request: TurnRequest, idempotency_key: str | None = None) -> Turn:
        """Plan, build and launch a turn; a refusal is a finished turn, not an error.

        Raises ``TurnCapReached`` or ``TargetUnavailable`` (nothing made) when
        the turn cannot be admitted now.
        """
        key = _idempotency_digest(request.role, idempotency_key)
        if key is not None and key in self._idempotency:
            return self._turn(self._idempotency[key])
        self._check_low_water()
        self._admit(request.role)
        record = self._new_record(request, key)
        record.admitted = True
        return await self.started_whoever_waits(self._start(record, request))

    async def started_whoever_waits(self, start: Coroutine[Any, Any, T]) -> T:
        """``start`` (of a turn or a session) run to its end in a task of its own, whether
        its caller waits or not.

        A caller cancelled (an in-process client that timed out, a request ended by
        a stopping server) would otherwise leave a turn half started: its fence
        running with nobody to end it at its wall time, its record running for ever,
        its seat under the caps taken. The turn it submitted runs and is recorded
        like any other; a caller that retries with its idempotency key finds it.
        """
        task = asyncio.create_task(start)
        self._starting.add(task)
        task.add_done_callback(self._started)
        return await asyncio.shield(task)

    def _started(self, task: asyncio.Task[Any]) -> None:
        self._starting.discard(task)
        if not task.cancelled():
            task.exception()  # said to the caller if it still waits; nobody else needs it

    async def _start(self, record: TurnRecord, request: TurnRequest) -> Turn:
        no_lease: RefusedError | None = None
        try:
            self.leases.admit(request.role, request.lease)
        except RefusedError as exc:
            no_lease = exc  # refused all the same, once its spool is there to say so
        # Taken here (the nursery is the event loop's), used on the planning thread.
        slot = self.limiter.take_ready_slot()
        loop = asyncio.get_running_loop()
        try:
            # Off the event loop: the spool is made, planning walks paths and searches
            # writable mounts, the turn's cgroups are made, and its bubblewrap started.
            planned = await self._planned(record, request, no_lease, slot, loop)
        except StorageError as exc:
            # The turn's spool could not be made: nothing was, and the disk says why.
            self._forget(record)
            self._release(request.role)
            self._storage_failed(exc)
            raise self._disk_unavailable() from None
        except RefusedError as refused:
            await self._refused(record, refused, request)
            return record.turn
        except Exception:
            # Its bubblewrap may have been starting there: as a launch that failed.
            await self._failed_launch(record, request, "plan or start")
            return record.turn
        try:
            await self._launch(record, planned, request)
        except RefusedError as refused:
            await self._refused(record, refused, request)
        except Exception:
            await self._failed_launch(record, request, "launch")
        return record.turn

    async def _refused(
        self, record: TurnRecord, refused: RefusedError, request: TurnRequest | None
    ) -> None:
        await self._finish(
            record, Outcome(refused.refusal.exit_code, refusal=refused.refusal), request
        )

    async def _failed_launch(
        self, record: TurnRecord, request: TurnRequest | None, what: str
    ) -> None:
        """In an ``except`` block: never a turn without an end (its followers would wait for
        ever), so a fault of the target's own ends it as a launch that failed."""
        log.exception("turn %s: the target failed to %s it", record.turn.turn_id, what)
        failed = Outcome(ExitStatus.PADDOCK_FAILED, failure=LAUNCH_FAILED)
        await self._finish(record, failed, request)

    def _admit(self, role: str) -> None:
        """Count a new turn against the caps, or say why it cannot run now."""
        if self._stopping:
            raise self._stopping_now()
        if self._disk_failure is not None or self._disk_low is not None:
            raise self._disk_unavailable()
        role_cap = self.settings.roles[role].limits.turns if role in self.settings.roles else None
        if role_cap is not None and self._running_by_role[role] >= role_cap:
            raise TurnCapReached(
                f"role {role} already runs {self._running_by_role[role]} turns, its cap "
                f"([roles.{role}.limits] turns = {role_cap}); submit again when one has ended",
                f"roles.{role}.limits.turns",
                role_cap,
                CAP_RETRY_AFTER_S,
            )
        cap = self.settings.server.max_turns
        if self._running >= cap:
            raise TurnCapReached(
                f"the target already runs {self._running} turns, its cap "
                f"([server] max_turns = {cap}); submit again when one has ended",
                "server.max_turns",
                cap,
                CAP_RETRY_AFTER_S,
            )
        self._running += 1
        self._running_by_role[role] += 1

    def _release(self, role: str) -> None:
        self._running -= 1
        self._running_by_role[role] -= 1

    # --- what sessions and file operations use ---------------------------------------------------

    @property
    def inject(self) -> FailureHook:
        return self._inject

    def admit(self, role: str) -> None:
        """Count one more fence (a session's, a file operation's) against the caps, or say why
        there is no room; ``release`` when it has ended."""
        self._check_low_water()
        self._admit(role)

    def release(self, role: str) -> None:
        self._release(role)

    def known(self, role: str, idempotency_key: str | None) -> Turn | None:
        """The turn an earlier POST of ``role`` with this key made, if there was one."""
        key = _idempotency_digest(role, idempotency_key)
        if key is not None and key in self._idempotency:
            return self._turn(self._idempotency[key])
        return None

    async def record_in_ledger(self, kind: str, **fields: Any) -> bool:
        """Append one ledger record; False (and ``disk``) if the disk refused it for now."""
        return await self._ledger_append(kind, **fields)

    def storage_failed(self, exc: StorageError) -> None:
        self._storage_failed(exc)

    def launch_facts(self, plan: FencePlan) -> dict[str, Any]:
        return _launch_facts(plan)

    async def submit_elsewhere(
        self,
        request: TurnRequest,
        idempotency_key: str | None,
        start: Callable[[TurnRecord], Awaitable[StartedElsewhere]],
    ) -> Turn:
        """A turn whose process is ``start``'s to run (a session's shell): a turn all the same.

        It has its own record, spool, ledger records, idempotency and end; it is
        not counted against the caps (its fence already is). ``start`` may raise
        ``RefusedError``: the turn is then refused, like any other.
        """
        known = self.known(request.role, idempotency_key)
        if known is not None:
            return known
        self._check_low_water()
        if self._stopping:
            raise self._stopping_now()
        if self._disk_failure is not None:
            raise self._disk_unavailable()
        record = self._new_record(request, _idempotency_digest(request.role, idempotency_key))
        return await self.started_whoever_waits(self._start_elsewhere(record, request, start))

    async def _start_elsewhere(
        self,
        record: TurnRecord,
        request: TurnRequest,
        start: Callable[[TurnRecord], Awaitable[StartedElsewhere]],
    ) -> Turn:
        try:
            await asyncio.to_thread(record.spool.create, report=False)
        except StorageError as exc:
            # The turn's spool could not be made: nothing was, and the disk says why.
            self._forget(record)
            self._storage_failed(exc)
            raise self._disk_unavailable() from None
        try:
            started = await start(record)
            record.running = started.running
            record.update(started_at=now())
            facts = started.facts | _key_facts(record)
            await self._ledger_append("launch", turn=_turn_json(record.turn), **facts)
            record.spool.append_kept("started")
            await started.begin()
            record.task = asyncio.create_task(self._follow(record, started.plan, started.ended))
        except RefusedError as refused:
            await self._refused(record, refused, request)
        except Exception:
            await self._failed_launch(record, request, "start")
        return record.turn

    def _stopping_now(self) -> TargetUnavailable:
        return TargetUnavailable(
            "the target is stopping and takes no new turn; submit again once it is back",
            "stopping",
            STOP_RETRY_AFTER_S,
        )

    def _disk_unavailable(self) -> TargetUnavailable:
        return TargetUnavailable(
            f"the target's state disk ({self.settings.state_root}) is full or failing "
            f"({self._disk_failure or self._disk_low}); it takes no new turn until it can "
            "write again",
            "disk",
            DISK_RETRY_AFTER_S,
        )

    def _new_record(self, request: TurnRequest, key: str | None) -> TurnRecord:
        """The turn, known (and its key) at once; ``_make_and_plan`` makes its spool on disk."""
        turn_id = f"t-{uuid.uuid4().hex}"
        turn = Turn(
            turn_id=turn_id,
            role=request.role,
            state="running",
            created_at=now(),
            session_id=request.session,
            tty=request.tty is not None,
        )
        stored = StoredTurn(turn=turn, idempotency=key)
        spool = EventSpool.new(self.store.new_spool_path(turn_id), self._storage_failed)
        record = TurnRecord(stored, spool)
        self._turns[turn_id] = record
        if key is not None:
            self._idempotency[key] = turn_id
        return record

    def _forget(self, record: TurnRecord) -> None:
        del self._turns[record.turn.turn_id]
        if record.stored.idempotency is not None:
            self._idempotency.pop(record.stored.idempotency, None)

    async def _planned(
        self,
        record: TurnRecord,
        request: TurnRequest,
        refused: RefusedError | None,
        slot: Slot | None,
        loop: asyncio.AbstractEventLoop,
    ) -> Planned:
        """``_make_and_plan`` on a planning thread, counted while it is there."""
        self._planning_now += 1
        self._planning_idle.clear()
        try:
            return await loop.run_in_executor(
                self._planning, self._make_and_plan, record, request, loop, refused, slot
            )
        finally:
            self._planning_now -= 1
            if not self._planning_now:
                self._planning_idle.set()

    async def _after_planning(self) -> None:
        """Until no turn is being planned (at most ``BOOKKEEPING_WAIT_S``).

        A turn started on its planning thread runs already; what the loop does
        for it next (its pipes connected, its start recorded and streamed) can
        wait for the turns behind it to be started too. In a burst, all of that
        work is what the last turn's start would otherwise wait behind.
        """
        if self._planning_now and not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BOOKKEEPING_WAIT_S):
                    await self._planning_idle.wait()

    def _make_and_plan(
        self,
        record: TurnRecord,
        request: TurnRequest,
        loop: asyncio.AbstractEventLoop,
        refused: RefusedError | None = None,
        slot: Slot | None = None,
    ) -> Planned:
        """The turn's spool made on disk, its fence planned, its role's home made where that
        needs no one else, its cgroups made (blocking; with ``slot`` if one was
        taken, which is sent away if the turn goes no further), and its bubblewrap started
        where that needs nothing of ``loop``'s (``_start_here``); ``refused`` (decided
        before) is raised once the spool is there."""
        try:
            record.spool.create(report=False)
            if refused is not None:
                raise refused
            planned = self._planned_with_home(self.plan(request, record.turn.turn_id))
        except BaseException:
            if slot is not None:
                send_away(slot)
            raise
        try:
            planned.limits = self.limiter.make_for_turn(
                planned.plan.turn_id, planned.plan.limits, slot
            )
        except LimitError as exc:
            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc
        self._start_here(record, planned, request, loop)
        return planned

    def _start_here(
        self,
        record: TurnRecord,
        planned: Planned,
        request: TurnRequest,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Start the turn's bubblewrap on this (planning) thread, if nothing of the event
        loop's is needed first: the role's home made here, no lease to check again at launch
        (the lease book is the loop's), a server that starts its fences itself.

        A burst's turns wait for the loop (a few hundred of them, for hundreds of
        milliseconds); started here, each turn's command runs while the loop catches up,
        and its output waits in its pipes until the loop connects them.
        """
        spawn_here = self.identity.spawn_here(loop)
        limits = planned.limits
        if spawn_here is None or limits is None or not planned.home_ready or request.lease:
            return
        try:
            bwrap = self._bwrap_or_refuse()
        except RefusedError:
            planned.drop()
            raise
        planned.limits = None  # the launch's from here
        planned.starting = start_turn(
            bwrap, planned.plan, record.spool.append, limits, spawn_here, self._inject
        )

    def _planned_with_home(self, plan: FencePlan) -> Planned:
        make_home = self.identity.home_here(
            self.settings.state_root, plan.role, (plan.uid, plan.gid)
        )
        if make_home is None:
            # Made by the launcher, as root, but looked at here first: the usual turn finds
            # it as it should be, and asks the launcher one thing fewer.
            state_root, ids = self.settings.state_root, (plan.uid, plan.gid)
            return Planned(plan, home_ready=looks_ready(state_root, plan.role, *ids))
        try:
            return Planned(plan, home_ready=True, repaired=make_home())
        except TargetError as exc:
            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc

    async def _launch(self, record: TurnRecord, planned: Planned, request: TurnRequest) -> None:
        plan = planned.plan
        if planned.starting is not None:
            await self._after_planning()
            if planned.repaired is not None:
                record.spool.append_kept("notice", message=planned.repaired)
            await self._launched(record, plan, await planned.starting.running())
            return
        try:
            # Again at launch: a seat taken over while the turn was planned refuses it.
            self.leases.admit(request.role, request.lease)
            bwrap = self._bwrap_or_refuse()
            repaired = planned.repaired if planned.home_ready else await self._home_awaited(plan)
        except BaseException:
            planned.drop()
            raise
        if repaired is not None:
            record.spool.append_kept("notice", message=repaired)
        limits, planned.limits = planned.limits, None  # the launch's from here
        await self._launched(record, plan, await self._spawn(bwrap, plan, record.spool, limits))

    async def _launched(self, record: TurnRecord, plan: FencePlan, running: RunningTurn) -> None:
        """Its process started: the turn's start recorded, and the turn followed."""
        record.running = running
        # When it began, not when the loop got here: under load that can be a second later.
        record.update(started_at=_on_the_clock(running.started_at), executable=plan.executable)
        # The commit point of the turn's start (while bubblewrap sets up). No file is written
        # for the turn besides its spool: this line, and its end line, say all one would.
        facts = _launch_facts(plan) | _key_facts(record)
        await self._ledger_append("launch", turn=_turn_json(record.turn), **facts)
        record.spool.append_kept("started", executable=plan.executable)
        record.task = asyncio.create_task(self._follow(record, plan))

    async def _home_awaited(self, plan: FencePlan) -> str | None:
        """The role's home made or repaired where it was not on the planning thread (by the
        launcher); what had to be repaired, if anything."""
        try:
            return await self.identity.prepare_home(
                self.settings.state_root, plan.role, (plan.uid, plan.gid)
            )
        except TargetError as exc:
            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc

    def _bwrap_or_refuse(self) -> str:
        try:
            return self.bwrap()
        except BackendError as exc:
            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc

    async def _spawn(
        self, bwrap: str, plan: FencePlan, spool: EventSpool, limits: TurnLimits | None = None
    ) -> RunningTurn:
        return await launch_turn(
            bwrap, plan, spool.append, self.limiter, self._inject, self.identity, limits=limits
        )

    async def _follow(
        self,
        record: TurnRecord,
        plan: FencePlan,
        ended: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        running = record.running
        if running is None:
            return
        try:
            outcome = await running.wait()
        except Exception:
            log.exception("turn %s: lost track of its process", plan.turn_id)
            running.kill_now()
            outcome = Outcome(ExitStatus.PADDOCK_FAILED)
        try:
            await self._finish(record, outcome, fence=plan)
        finally:
            if ended is not None:
                await ended()
        try:
            # After its end is out: removing cgroups waits for their last task to go.
            await running.cleanup()
        except Exception:
            log.exception("turn %s: cleaning up after it failed", plan.turn_id)

    async def _finish(
        self,
        record: TurnRecord,
        outcome: Outcome,
        request: TurnRequest | None = None,
        fence: FencePlan | None = None,
    ) -> None:
        """The turn's end: recorded (after the audit of ``fence``, if it ran in one), then told."""
        notices = [] if outcome.failure is None else [outcome.failure]
        if record.stopped is not None and outcome.exit_code == for_signal(signal.SIGKILL):
            notices.append(record.stopped)
            outcome = replace(outcome, exit_code=ExitStatus.PADDOCK_FAILED, signal=None)
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
        try:
            facts = {"request": _request_facts(request)} if request is not None else {}
            # Looked at as it was reaped and found as planned: no audit is left to ask for.
            audited = None if outcome.clean else fence
            await self._record_end(record, _End(_turn_json(record.turn), facts, notices), audited)
            _append_terminal(record)
            # After the followers the terminal event woke: resting one is not on their way.
            asyncio.get_running_loop().call_soon(self._ended_now, record)
        finally:
            # Counted until recorded: a stopping target waits for exactly this.
            if record.admitted:
                record.admitted = False
                self._release(record.turn.role)
        log.info(
            "turn %s role=%s ended state=%s exit=%s",
            record.turn.turn_id,
            record.turn.role,
            state,
            outcome.exit_code,
        )

    async def _record_end(self, record: TurnRecord, end: _End, fence: FencePlan | None) -> None:
        """The audit after ``fence``, what it and ``end`` say in the spool, then the end's line.

        Durable first: whoever sees the terminal event can rely on the ledger,
        the turn's commit point, and on its output, synced before the line that
        vouches for it (on a full disk, on the restart that takes the spool's
        word for it). Where the audit runs on a thread here and there is nothing
        to say, the line is written on that same thread: one hop off the event
        loop for the whole end, not three.
        """
        here = None
        if fence is not None and not end.notices:
            here = self.identity.audit_here(
                fence.role, (fence.uid, fence.gid), fence.audit, fence.turn_id
            )
        if here is not None:
            moved, written = await asyncio.to_thread(self._audit_then_end, here, record, end)
            if written is not None:
                self._ledger_written(written)
                return
        else:
            moved = await self._audit(record, fence) if fence is not None else []
        for said in (*moved, *end.notices):
            record.spool.append_kept("notice", message=said)
        await self._ledger_append("end", turn=end.turn, before=record.spool.sync, **end.facts)

    def _audit_then_end(
        self, audit: Callable[[], list[str]], record: TurnRecord, end: _End
    ) -> tuple[list[str], bool | None]:
        """On a thread: the audit, then, if it moved nothing, the end's ledger line (whether
        it was written; None when it was left for the event loop, after the notices)."""
        moved = _audited(audit, record.turn.turn_id)
        if moved:
            return moved, None
        return [], self.ledger.append_here(
            "end", turn=end.turn, before=record.spool.sync, **end.facts
        )

    async def _audit(self, record: TurnRecord, fence: FencePlan) -> list[str]:
        """The audit through the identity; the output onto the disk meanwhile (the end's ledger
        line syncs the spool again, at no cost when nothing came since)."""
        synced = asyncio.ensure_future(asyncio.to_thread(record.spool.sync))
        try:
            return await self.identity.audit(
                fence.role, (fence.uid, fence.gid), fence.audit, fence.turn_id
            )
        except TargetError as exc:
            return _audit_failed(fence.turn_id, exc)
        finally:
            await synced

    def _count_health(self, outcome: Outcome) -> None:
        """Target-made failures count towards ``turns-failing``; only a turn that ran clears it."""
        target_failed = outcome.exit_code == ExitStatus.PADDOCK_FAILED or (
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

    # --- the state disk ------------------------------------------------------------------------

    async def _ledger_append(
        self, kind: str, *, before: Callable[[], object] | None = None, **fields: Any
    ) -> bool:
        written = await self.ledger.append(kind, before=before, **fields)
        self._ledger_written(written)
        return written

    def _ledger_written(self, written: bool) -> None:
        """A record the disk refused (held for it) is a disk failing: say so."""
        if not written:
            self._storage_failed(
                StorageError(f"{self.ledger.path}: {self.ledger.held} record(s) wait for the disk")
            )

    def _storage_failed(self, exc: StorageError) -> None:
        """A write under the state root failed: say so, refuse new turns, probe until it passes."""
        if self._disk_failure is None:
            log.error("state disk: %s; new turns are refused until writes succeed again", exc)
        self._disk_failure = str(exc)
        self._disk_news.set()
        self.board.degrade(
            "disk",
            f"writes under {self.settings.state_root} fail ({exc}); "
            "new turns are refused until they succeed again",
        )

    async def _watch_disk(self) -> None:
        """Probe a failing disk until it takes writes, then write what waited; else watch space."""
        while True:
            if self._disk_failure is None:
                self._disk_news.clear()
                with contextlib.suppress(TimeoutError):
                    # A failure wakes the watch at once; its probing starts a poll later.
                    await asyncio.wait_for(self._disk_news.wait(), DISK_CHECK_S)
            await asyncio.sleep(DISK_POLL_S)
            try:
                if self._disk_failure is not None:
                    await self._retry_storage()
                else:
                    self._check_low_water()
            except Exception:
                log.exception("watching the state disk failed; trying again")

    async def _retry_storage(self) -> None:
        """The ``disk`` cause's recovery: a probe write passes and everything held is written."""
        if not await asyncio.to_thread(self._disk_takes_writes):
            return
        written = await self.ledger.flush()
        for record in list(self._turns.values()):
            if record.spool.held:
                written = record.spool.flush_held() and written
        written = await self.sessions.flush() and written
        if written:
            log.warning("state disk takes writes again; what waited is written")
            self._disk_failure = None
            self._check_low_water()

    def _disk_takes_writes(self) -> bool:
        root = self.settings.state_root
        try:
            usage = shutil.disk_usage(root)
            if usage.free < low_water(usage.total):
                return False
            probe = root / ".disk-probe"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"\0" * PROBE_BYTES)
                os.fsync(fd)
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
        except OSError:
            return False
        return True

    def _check_low_water(self) -> None:
        """``disk`` while free space is low; a write failure holds it until its own recovery."""
        if self._disk_failure is not None:
            return
        try:
            usage = shutil.disk_usage(self.settings.state_root)
        except OSError as exc:
            self.board.degrade("disk", f"cannot read free space of the state root: {exc}")
            return
        if usage.free < low_water(usage.total):
            # A turn admitted now would only find the disk full: refused until space returns.
            self._disk_low = f"only {usage.free >> 20} MiB free under {self.settings.state_root}"
            self.board.degrade("disk", self._disk_low)
        else:
            self._disk_low = None
            self.board.recover("disk")

    def plan(self, request: TurnRequest, turn_id: str) -> FencePlan:
        """The turn's fence (blocking: call off the event loop), with the curated ``/etc``."""
        try:
            etc = str(self.etc.current())
        except OSError as exc:
            raise RefusedError(
                refusals.backend_unavailable(f"could not copy the fence's /etc: {exc}")
            ) from exc
        return plan_turn(request, self.settings, turn_id, etc_dir=etc)

    def dry_run(self, request: TurnRequest) -> PlanResult:
        """The fence ``request`` would get, or its refusal; nothing is built or launched."""
        try:
            self.leases.admit(request.role, request.lease)
            plan = self.plan(request, f"t-{uuid.uuid4().hex}")
        except RefusedError as refused:
            return PlanResult(refusal=refused.refusal, exit_code=refused.refusal.exit_code)
        return PlanResult(fence=fence_view(plan), exit_code=0)

    def get(self, turn_id: str, roles: frozenset[str]) -> TurnRecord:
        """The turn ``turn_id`` if it belongs to one of ``roles`` (woken, if it was at rest)."""
        record = self._turns.get(turn_id)
        resting = self._resting.get(turn_id) if record is None else None
        role = record.turn.role if record is not None else resting[0] if resting else None
        if role is None or role not in roles:
            raise UnknownTurn(f"no turn {turn_id} among the turns of this token's roles")
        return record or self._woken(turn_id)

    def _turn(self, turn_id: str) -> Turn:
        """The turn ``turn_id`` as it stands, awake or at rest (left at rest)."""
        record = self._turns.get(turn_id)
        if record is not None:
            return record.turn
        return StoredTurn.model_validate_json(self._resting[turn_id][3]).turn

    def _ended_now(self, record: TurnRecord) -> None:
        """``record`` has ended, or was asked for: it is among the latest, and the oldest ended
        beyond ``AWAKE_ENDED`` go to rest."""
        self._ended.append(record.turn.turn_id)
        while len(self._ended) > AWAKE_ENDED:
            self._rest(self._ended.popleft())

    def _rest(self, turn_id: str) -> None:
        """Put an ended turn to rest; one whose spool holds events the disk refused stays."""
        record = self._turns.get(turn_id)
        if record is None or record.running is not None or record.turn.ended_at is None:
            return  # swept already, or (never) still running
        spool = record.spool.at_rest()
        if spool is None:
            return
        del self._turns[turn_id]
        stored = record.stored.model_dump_json().encode()
        ended = record.turn.ended_at.timestamp()
        self._resting[turn_id] = (record.turn.role, ended, record.stored.idempotency, stored, spool)

    def _woken(self, turn_id: str) -> TurnRecord:
        """The resting turn ``turn_id``, whole again (its spool's file is not read)."""
        _, _, _, stored, spool = self._resting.pop(turn_id)
        record = TurnRecord(StoredTurn.model_validate_json(stored), EventSpool.woken(spool))
        self._turns[turn_id] = record
        self._ended_now(record)
        return record

    async def recent(self, roles: frozenset[str], limit: int) -> list[Turn]:
        """The newest ``limit`` turns of ``roles``, as the ledger last recorded each."""
        records = self.ledger.records_newest_first()
        return await asyncio.to_thread(newest_turns, records, roles, limit)

    def signal(self, record: TurnRecord, name: str) -> int:
        if record.running is None:
            raise TurnNotRunning(f"turn {record.turn.turn_id} has ended; it takes no signal")
        return record.running.signal(name)

    def resize(self, record: TurnRecord, rows: int, cols: int) -> None:
        if record.running is None:
            raise TurnNotRunning(f"turn {record.turn.turn_id} has ended; it has no terminal now")
        if not record.turn.tty:
            raise NoTerminal(
                f"turn {record.turn.turn_id} runs on no terminal, so it has no size; "
                'start it with "tty" to have one'
            )
        try:
            record.running.resize(rows, cols)
        except OSError as exc:
            raise TurnNotRunning(f"turn {record.turn.turn_id}: its terminal is gone") from exc

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
            if r.running is None and not r.spool.held and expired(r.turn, moment, retention)
        ]
        for record in gone:
            del self._turns[record.turn.turn_id]
            if record.stored.idempotency:
                self._idempotency.pop(record.stored.idempotency, None)
            record.spool.close()
        oldest = moment.timestamp() - retention
        resting = [(turn_id, r[2]) for turn_id, r in self._resting.items() if r[1] < oldest]
        for turn_id, idempotency in resting:
            del self._resting[turn_id]
            if idempotency:
                self._idempotency.pop(idempotency, None)
        removed = [r.turn.turn_id for r in gone] + [turn_id for turn_id, _ in resting]
        if removed:
            await asyncio.to_thread(self.store.remove, removed)
        await self.sessions.sweep(moment, retention)
        return len(removed)

    async def stop(self, grace_s: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """Take no new turn; give running turns ``grace_s`` to end, then end and record the rest.

        ``hurry`` (a second signal) cuts the wait short. Returns once every turn
        is recorded as ended, or ``KILL_WAIT_S`` after the kill at most.
        """
        self._stopping = True
        self._planning_idle.set()  # nothing started waits to be followed, and killed
        loop = asyncio.get_running_loop()
        if self._running:
            log.info("stopping: %d turn(s) running, waiting up to %g s", self._running, grace_s)
        began = loop.time()
        while self._running and loop.time() < began + grace_s and not hurry():
            # A session with no turn running will not end by itself: it ends now.
            await self.sessions.stop(idle_only=True)
            await asyncio.sleep(STOP_POLL_S)
        await self.sessions.stop(idle_only=False)
        why = (
            f"the target was stopped and ended this turn after waiting {loop.time() - began:.0f} s "
            f"for it ([server] stop_grace_s = {grace_s:g} s)"
        )
        deadline = loop.time() + KILL_WAIT_S
        while self._running and loop.time() < deadline:
            for record in self._turns.values():
                if record.running is not None and record.stopped is None:
                    record.stopped = why
                    record.running.kill()
            await asyncio.sleep(STOP_POLL_S)

    async def shutdown(self) -> None:
        """Kill every running turn, wait for each to be recorded, then give up the state root."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        self.leases.stop()
        self._planning_idle.set()
        if self._starting:
            # Started and followed first, so that they are killed and recorded with the rest.
            await asyncio.wait(set(self._starting), timeout=KILL_WAIT_S)
        tasks = []
        for record in self._turns.values():
            if record.running is not None:
                record.stopped = record.stopped or "the target stopped and ended this turn"
                record.running.kill_now()
            if record.task is not None:
                tasks.append(record.task)
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks)
        await self.sessions.shutdown()
        if self._ledger is not None and self._disk_failure is not None:
            with contextlib.suppress(Exception):
                await self._retry_storage()
        if self._ledger is not None:
            with contextlib.suppress(Exception):
                await self._ledger.close()
        for record in self._turns.values():
            record.spool.close()
        await asyncio.to_thread(self.limiter.close)
        self._planning.shutdown(wait=False)
        self._release_lock()

    def _release_lock(self) -> None:
        if self._own_lock and self._lock is not None:
            self._lock.release()


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


@dataclass(frozen=True)
class _End:
    """What a turn's end records: the turn as it ended, the ledger's facts, and notices."""

    turn: dict[str, Any]
    facts: dict[str, Any]
    notices: list[str]


def _audited(audit: Callable[[], list[str]], turn_id: str) -> list[str]:
    try:
        return audit()
    except TargetError as exc:
        return _audit_failed(turn_id, exc)


def _audit_failed(turn_id: str, exc: TargetError) -> list[str]:
    log.error("turn %s: the audit after it could not run: %s", turn_id, exc)
    return [f"the protected paths could not be checked after the turn: {exc}"]


def _append_terminal(record: TurnRecord) -> None:
    """The turn's terminal event, carrying the turn as it ended: a follower needs no GET."""
    turn = record.turn
    if turn.refusal is not None:
        record.spool.append_kept(
            "refused", refusal=turn.refusal, exit_code=turn.exit_code, turn=turn
        )
    else:
        record.spool.append_kept("exit", exit_code=turn.exit_code, signal=turn.signal, turn=turn)


def role_entries(settings: Settings) -> list[RoleEntry]:
    """What the fence's ``passwd`` says of each role (nothing when turns run as the server)."""
    if settings.fence.identity == "server":
        return []
    return [
        RoleEntry(name, *settings.role_ids(name), home_place(settings, name))
        for name in settings.roles
    ]


def low_water(total: int) -> int:
    """Free bytes below which health says ``disk``, on a filesystem of ``total`` bytes."""
    return min(MIN_FREE_BYTES, int(total * MIN_FREE_SHARE))


def default_memory_mb() -> int:
    """Three quarters of the machine's memory: what all turns together may use by default."""
    return max(1, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 4 >> 20)


def _idempotency_digest(role: str, key: str | None) -> str | None:
    # Scoped to the role: the same key from another role is another request.
    return None if key is None else hashlib.sha256(f"{role}\0{key}".encode()).hexdigest()


def _turn_json(turn: Turn) -> dict[str, Any]:
    return turn.model_dump(mode="json", exclude_none=True)


def _key_facts(record: TurnRecord) -> dict[str, str]:
    """What a launch line keeps for a retried request to find the turn after a restart."""
    key = record.stored.idempotency
    return {"idempotency": key} if key else {}


def _on_the_clock(monotonic_at: float) -> datetime:
    """A ``time.monotonic`` instant of the recent past as a time of day."""
    return now() - timedelta(seconds=max(0.0, time.monotonic() - monotonic_at))


def _turn_of(terminal: Event | None) -> Turn | None:
    """The turn as its terminal event says it ended; None without one (or from an older
    target, which wrote it without the turn)."""
    if isinstance(terminal, ExitEvent | RefusedEvent):
        return terminal.turn
    return None


def _from_ledger(known: Latest) -> StoredTurn:
    """The turn as the ledger last said it, with the key its launch line kept."""
    return StoredTurn(turn=Turn.model_validate(known.turn), idempotency=known.idempotency)


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
