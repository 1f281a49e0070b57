"""Leases: one live holder per seat, and a generation for each holder, which a newer one supersedes.

A *seat* is a name within a role (by default the role's first workspace). A
lease on it is granted for ``ttl_s`` seconds and renewed before they pass;
taking a seat another lease holds is refused unless the request supersedes
it, which mints the next generation. A request acting under a lease names it
(``LeaseRef``: id, seat, generation), and ``admit`` refuses it (``stale-lease``)
unless it is its seat's current generation, held and unexpired: an agent
that was replaced, but does not know it yet, can no longer act (the
generation is a fencing token).

Only the seat's *current* lease can be held: an older one is superseded by
the generation alone, whatever else is recorded of it, and neither renews
nor admits anything. Releasing a lease (``DELETE``) gives its seat up if it
held it, and forgets the lease: the seat keeps its generation, and a request
naming that lease is refused as one naming no lease at all.

What is kept, and why both:

    STATE/leases/KEY.json    one seat: role, name, highest generation, latest grants    0600
    STATE/ledger.jsonl       a "lease" record per grant, renewal, release, expiry, supersession

A seat's file is written (atomically) before a grant, renewal or release is
answered; a write the disk refuses answers 503 and changes nothing. The
ledger records every change as well. A target that starts takes both and
keeps the higher of each: the highest generation either has seen, the later
expiry, a lapse either recorded. So generations never go back across a
restart, a lost or torn seat file, or a ledger repaired short of its last
records. Expiries are noticed by the clock (passed in, so tests set it) and
recorded as they come due.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.wire import Lease, LeaseRef, LeaseState
from target_side.config import Settings
from target_side.errors import (
    LeaseEnded,
    RefusedError,
    SeatHeld,
    StorageError,
    TargetUnavailable,
    UnknownLease,
    UnsafeFileError,
)
from target_side.policy import refusals
from target_side.safe_files import read_private, write_atomic
from target_side.service.ledger import Ledger
from target_side.service.tails import stamp

log = logging.getLogger("paddock.target")

LEASE_DIR = "leases"
KEEP_GRANTS = 8
"""Grants remembered per seat (the current one and those before it), for ``GET`` and messages."""
DISK_RETRY_AFTER_S = 10
ENDED_POLL_S = 1.0
"""After a failed expiry round, how long the watch waits before the next."""

Clock = Callable[[], datetime]
Recorder = Callable[..., Awaitable[bool]]
"""``(kind, **fields)``: appends a ledger record (``TurnManager._ledger_append``)."""


def utc_now() -> datetime:
    return datetime.now(UTC)


class Grant(BaseModel):
    """One lease granted on a seat, as the seat's file keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_id: str
    generation: int
    ttl_s: float
    granted_at: datetime
    expires_at: datetime
    lapsed: bool = False
    """Its expiry was recorded: it lapsed at ``expires_at``, unrenewed."""


class Seat(BaseModel):
    """A seat: its highest generation ever granted, and its latest grants, oldest first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str
    name: str
    generation: int = 0
    grants: tuple[Grant, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    @property
    def current(self) -> Grant | None:
        """The grant of the seat's current generation (held, or lapsed); None once released."""
        last = self.grants[-1] if self.grants else None
        return last if last is not None and last.generation == self.generation else None

    def grant(self, lease_id: str) -> Grant | None:
        return next((g for g in self.grants if g.lease_id == lease_id), None)

    def with_grant(self, grant: Grant) -> Seat:
        """This seat with ``grant`` replacing the one of its id, or added as the newest."""
        kept = [g for g in self.grants if g.lease_id != grant.lease_id]
        grants = sorted([*kept, grant], key=lambda g: g.generation)[-KEEP_GRANTS:]
        generation = max(self.generation, grant.generation)
        return self.model_copy(update={"generation": generation, "grants": tuple(grants)})

    def without(self, lease_id: str) -> Seat:
        """This seat with the grant ``lease_id`` forgotten; its generation stays."""
        kept = tuple(g for g in self.grants if g.lease_id != lease_id)
        return self.model_copy(update={"grants": kept})


def seat_file_name(role: str, name: str) -> str:
    """The seat's file: a digest, since a seat's name is free text (a path, say)."""
    return hashlib.sha256(f"{role}\0{name}".encode()).hexdigest()[:32] + ".json"


@dataclass(frozen=True)
class Loaded:
    """What ``LeaseBook.start`` found: seats, and what it had to rebuild or set aside."""

    seats: dict[tuple[str, str], Seat]
    set_aside: list[str]
    rebuilt: int


class LeaseBook:
    """Every seat of one target and its leases; ``admit`` is the lease gate for requests."""

    def __init__(self, settings: Settings, *, clock: Clock = utc_now) -> None:
        self._settings = settings
        self._dir = settings.state_root / LEASE_DIR
        self._clock = clock
        self._seats: dict[tuple[str, str], Seat] = {}
        self._by_id: dict[str, tuple[str, str]] = {}
        self._due: list[tuple[datetime, str]] = []
        """(expires_at, lease_id) of grants that may lapse, soonest first; stale ones skipped."""
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._record: Recorder | None = None
        self._storage_failed: Callable[[StorageError], None] = lambda _exc: None
        self._watch: asyncio.Task[None] | None = None

    # --- start and stop ---------------------------------------------------------------------

    async def start(
        self,
        ledger: Ledger,
        record: Recorder,
        storage_failed: Callable[[StorageError], None] | None = None,
        *,
        watch: bool = True,
    ) -> None:
        """Load every seat (files and ledger together), then watch for leases that lapse."""
        self._record = record
        if storage_failed is not None:
            self._storage_failed = storage_failed
        loaded = await asyncio.to_thread(self._load, ledger)
        for seat in loaded.seats.values():
            self._install(seat)
        if loaded.set_aside or loaded.rebuilt:
            await record(
                "recovery",
                leases={"set_aside": loaded.set_aside, "rebuilt_from_ledger": loaded.rebuilt},
            )
        if watch:
            self._watch = asyncio.create_task(self._expire_forever())

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def _load(self, ledger: Ledger) -> Loaded:
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        from_files, set_aside = _read_seat_files(self._dir)
        from_ledger = _fold_ledger(ledger.records_of("lease"))
        seats: dict[tuple[str, str], Seat] = {}
        rebuilt = 0
        for key in from_files.keys() | from_ledger.keys():
            merged = _merge(from_files.get(key), from_ledger.get(key))
            seats[key] = merged
            if merged != from_files.get(key):
                # The file was lost, torn or behind: what the ledger adds is written back.
                rebuilt += 1
                try:
                    self._write(merged)
                except OSError as exc:
                    log.warning("lease seat %r: could not write it back (%s)", key, exc)
        return Loaded(seats, set_aside, rebuilt)

    # --- the gate -----------------------------------------------------------------------------

    def admit(self, role: str, lease: LeaseRef | None) -> None:
        """Let a request of ``role`` act under ``lease``, or raise ``stale-lease``.

        The one place the rule is decided: the lease must be the role's, name
        its own seat, and be that seat's current generation, held and unexpired.
        """
        config = self._settings.roles.get(role)
        if lease is None:
            if config is not None and config.require_lease:
                raise RefusedError(
                    refusals.stale_lease(
                        "lease",
                        f"role {role!r} acts only under a lease ([roles.{role}] require_lease); "
                        "take one (POST /v1/leases; paddock lease take) and name it "
                        "(paddock run --lease ID)",
                    )
                )
            return
        key = self._by_id.get(lease.lease_id)
        seat = self._seats.get(key) if key is not None else None
        grant = seat.grant(lease.lease_id) if seat is not None else None
        if seat is None or grant is None or seat.role != role:
            raise RefusedError(
                refusals.stale_lease(
                    "lease.lease_id",
                    f"no lease {lease.lease_id} of role {role!r} on this target (never granted "
                    "here, or released); take one (paddock lease take) and name it",
                )
            )
        if lease.seat != seat.name:
            raise RefusedError(
                refusals.stale_lease(
                    "lease.seat",
                    f"lease {lease.lease_id} is on seat {seat.name!r}, not {lease.seat!r}; "
                    "name the lease as it was granted",
                )
            )
        if not lease.generation == grant.generation == seat.generation:
            raise RefusedError(
                refusals.stale_lease(
                    "lease.generation",
                    f"generation {lease.generation} of seat {seat.name!r} is no longer current: "
                    f"the seat is at generation {seat.generation}, taken over by a newer holder; "
                    "stop acting for this seat, or take it back (supersede)",
                )
            )
        if grant.lapsed or grant.expires_at <= self._clock():
            raise RefusedError(
                refusals.stale_lease(
                    "lease",
                    f"lease {lease.lease_id} on seat {seat.name!r} lapsed at "
                    f"{_iso(grant.expires_at)}; take the seat again, and renew a lease before its "
                    "ttl_s passes",
                )
            )

    # --- take, renew, release, look -------------------------------------------------------------

    async def take(self, role: str, name: str | None, ttl_s: float, supersede: bool) -> Lease:
        """A new lease on the seat; ``SeatHeld`` while another holds it, unless ``supersede``."""
        config = self._settings.roles[role]
        name = name if name is not None else config.workspaces[0]
        async with self._lock:
            now = self._clock()
            seat = self._seats.get((role, name)) or Seat(role=role, name=name)
            current = seat.current
            ending: list[tuple[str, Grant]] = []
            if current is not None and not current.lapsed:
                if current.expires_at > now and not supersede:
                    raise SeatHeld(
                        f"seat {name!r} of role {role!r} is held by generation "
                        f"{seat.generation} until {_iso(current.expires_at)}; wait for it "
                        'to be released or to lapse, or take it over ("supersede": true)',
                        name,
                        seat.generation,
                        _iso(current.expires_at),
                    )
                if current.expires_at > now:
                    ending.append(("supersede", current))
                else:
                    seat = seat.with_grant(current.model_copy(update={"lapsed": True}))
                    ending.append(("expire", current))
            grant = Grant(
                lease_id=f"l-{uuid.uuid4().hex}",
                generation=seat.generation + 1,
                ttl_s=ttl_s,
                granted_at=now,
                expires_at=now + timedelta(seconds=ttl_s),
            )
            seat = seat.with_grant(grant)
            await self._save(seat)
            for event, ended in ending:
                extra = {"by_generation": grant.generation} if event == "supersede" else {}
                await self._note(event, seat, ended, **extra)
            await self._note("grant", seat, grant)
            return view(seat, grant, now)

    async def renew(self, lease_id: str, roles: frozenset[str], ttl_s: float | None) -> Lease:
        """Extend a held lease to ``ttl_s`` (else its own) from now; ``LeaseEnded`` if it is not."""
        async with self._lock:
            seat, grant = self._visible(lease_id, roles)
            now = self._clock()
            if grant.generation != seat.generation:
                raise LeaseEnded(
                    f"lease {lease_id} was superseded: seat {seat.name!r} is at generation "
                    f"{seat.generation}; a superseded lease is never renewed",
                    "superseded",
                )
            if grant.expires_at <= now:
                if not grant.lapsed:
                    await self._lapse(seat, grant)
                raise LeaseEnded(
                    f"lease {lease_id} on seat {seat.name!r} lapsed at {_iso(grant.expires_at)}; "
                    "take the seat again",
                    "expired",
                )
            ttl = grant.ttl_s if ttl_s is None else ttl_s
            renewed = grant.model_copy(
                update={"ttl_s": ttl, "expires_at": now + timedelta(seconds=ttl)}
            )
            seat = seat.with_grant(renewed)
            await self._save(seat)
            await self._note("renew", seat, renewed)
            return view(seat, renewed, now)

    async def release(self, lease_id: str, roles: frozenset[str]) -> Lease:
        """Give the seat up if this lease holds it, and forget the lease; answers its last state.

        A superseded or lapsed lease is forgotten the same way, and its seat
        (held by another, or free) is left as it is.
        """
        async with self._lock:
            seat, grant = self._visible(lease_id, roles)
            now = self._clock()
            was = view(seat, grant, now)
            await self._save(seat.without(lease_id))
            await self._note("release", seat, grant, was=was.state)
            if was.state == "held":
                return was.model_copy(update={"state": "released", "ended_at": now})
            return was

    def get(self, lease_id: str, roles: frozenset[str]) -> Lease:
        seat, grant = self._visible(lease_id, roles)
        return view(seat, grant, self._clock())

    def listed(self, roles: frozenset[str]) -> list[Lease]:
        """The current lease of every seat of ``roles`` (held, or lapsed), by role and seat."""
        now = self._clock()
        return [
            view(seat, current, now)
            for key, seat in sorted(self._seats.items())
            if key[0] in roles and (current := seat.current) is not None
        ]

    def _visible(self, lease_id: str, roles: frozenset[str]) -> tuple[Seat, Grant]:
        key = self._by_id.get(lease_id)
        seat = self._seats.get(key) if key is not None else None
        grant = seat.grant(lease_id) if seat is not None else None
        if seat is None or grant is None or seat.role not in roles:
            raise UnknownLease(f"no lease {lease_id} among the leases of this token's roles")
        return seat, grant

    # --- expiry ---------------------------------------------------------------------------------

    async def expire_due(self) -> float | None:
        """Record every current lease whose time has passed; seconds until the next may lapse."""
        async with self._lock:
            now = self._clock()
            while self._due and self._due[0][0] <= now:
                _, lease_id = heapq.heappop(self._due)
                key = self._by_id.get(lease_id)
                seat = self._seats.get(key) if key is not None else None
                current = seat.current if seat is not None else None
                if seat is None or current is None or current.lease_id != lease_id:
                    continue  # superseded or released: nothing lapses
                if not current.lapsed and current.expires_at <= now:
                    await self._lapse(seat, current, durable=False)
            if not self._due:
                return None
            return max((self._due[0][0] - now).total_seconds(), 0.0)

    async def _expire_forever(self) -> None:
        while True:
            self._changed.clear()
            try:
                wait = await self.expire_due()
            except Exception:
                log.exception("recording lapsed leases failed; trying again")
                wait = ENDED_POLL_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)

    # --- keeping ----------------------------------------------------------------------------------

    async def _lapse(self, seat: Seat, grant: Grant, *, durable: bool = True) -> None:
        """Record that ``grant`` lapsed; one the disk refuses is still recorded in memory."""
        changed = seat.with_grant(grant.model_copy(update={"lapsed": True}))
        try:
            await self._save(changed)
        except TargetUnavailable:
            if durable:
                raise
            # The clock says it lapsed, whatever the file says; the next start finds it so too.
            self._install(changed)
        await self._note("expire", changed, grant)

    async def _save(self, seat: Seat) -> None:
        """Write the seat's file, then make it the seat; a refused write changes nothing (503)."""
        try:
            await asyncio.to_thread(self._write, seat)
        except OSError as exc:
            why = exc.strerror or str(exc)
            self._storage_failed(StorageError(f"{self._dir}: a lease could not be written ({why})"))
            raise TargetUnavailable(
                f"the target's state disk refused the lease ({why}); nothing was changed: "
                "ask again once it takes writes",
                "disk",
                DISK_RETRY_AFTER_S,
            ) from exc
        self._install(seat)

    def _write(self, seat: Seat) -> None:
        path = self._dir / seat_file_name(seat.role, seat.name)
        write_atomic(path, seat.model_dump_json().encode())

    def _install(self, seat: Seat) -> None:
        old = self._seats.get(seat.key)
        # New ids first, then the forgotten ones go: a lookup in between finds every kept one.
        for grant in seat.grants:
            self._by_id[grant.lease_id] = seat.key
        self._seats[seat.key] = seat
        kept = {grant.lease_id for grant in seat.grants}
        for gone in old.grants if old is not None else ():
            if gone.lease_id not in kept:
                self._by_id.pop(gone.lease_id, None)
        current = seat.current
        if current is not None and not current.lapsed:
            heapq.heappush(self._due, (current.expires_at, current.lease_id))
            self._changed.set()

    async def _note(self, event: str, seat: Seat, grant: Grant, **extra: Any) -> None:
        if self._record is None:
            return
        facts = {
            "lease_id": grant.lease_id,
            "role": seat.role,
            "seat": seat.name,
            "generation": grant.generation,
            "ttl_s": grant.ttl_s,
            "granted_at": _iso(grant.granted_at),
            "expires_at": _iso(grant.expires_at),
        }
        await self._record("lease", event=event, lease=facts, **extra)


def view(seat: Seat, grant: Grant, now: datetime) -> Lease:
    """The wire ``Lease``: its state as of ``now``."""
    state: LeaseState = "held"
    ended_at = None
    if grant.lapsed:
        state, ended_at = "expired", grant.expires_at
    elif grant.generation != seat.generation:
        state = "superseded"
        after = [g.granted_at for g in seat.grants if g.generation > grant.generation]
        ended_at = min(after) if after else None
    elif grant.expires_at <= now:
        state, ended_at = "expired", grant.expires_at
    return Lease(
        lease_id=grant.lease_id,
        role=seat.role,
        seat=seat.name,
        generation=grant.generation,
        state=state,
        ttl_s=grant.ttl_s,
        granted_at=grant.granted_at,
        expires_at=grant.expires_at,
        ended_at=ended_at,
    )


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def _read_seat_files(directory: Path) -> tuple[dict[tuple[str, str], Seat], list[str]]:
    """Every seat file that parses; one that does not is kept aside, named in the second list."""
    seats: dict[tuple[str, str], Seat] = {}
    set_aside: list[str] = []
    for path in sorted(directory.glob("*.json")):
        try:
            seat = Seat.model_validate_json(read_private(path))
        except (OSError, UnsafeFileError, ValidationError) as exc:
            kept = path.with_name(f"{path.name}.torn-{stamp()}")
            with contextlib.suppress(OSError):
                path.rename(kept)
            log.warning(
                "lease seat file %s unreadable (%s); kept aside as %s", path, exc, kept.name
            )
            set_aside.append(kept.name)
            continue
        seats[seat.key] = seat
    for leftover in directory.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            leftover.unlink()  # a replacement a crash cut short: never acknowledged
    return seats, set_aside


class _Facts(BaseModel):
    """The ``lease`` of a ledger record, as ``LeaseBook._note`` writes it."""

    model_config = ConfigDict(extra="ignore")

    lease_id: str
    role: str
    seat: str
    generation: int
    ttl_s: float
    granted_at: datetime
    expires_at: datetime


def _fold_ledger(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], Seat]:
    """Seats as the ledger's ``lease`` records leave them."""
    seats: dict[tuple[str, str], Seat] = {}
    for record in records:
        try:
            facts = _Facts.model_validate(record.get("lease"))
        except ValidationError:
            log.warning(
                "ledger record %s is not a lease record this target reads", record.get("seq")
            )
            continue
        event = record.get("event")
        grant = Grant(
            lease_id=facts.lease_id,
            generation=facts.generation,
            ttl_s=facts.ttl_s,
            granted_at=facts.granted_at,
            expires_at=facts.expires_at,
            lapsed=event == "expire",
        )
        told = Seat(role=facts.role, name=facts.seat, generation=grant.generation, grants=(grant,))
        seat = _merge(seats.get(told.key), told)
        seats[told.key] = seat.without(grant.lease_id) if event == "release" else seat
    return seats


def _merge(first: Seat | None, second: Seat | None) -> Seat:
    """One seat from two accounts of it: the higher generation, each grant's latest word."""
    if first is None or second is None:
        found = first or second
        if found is None:
            raise ValueError("nothing to merge")
        return found
    grants: dict[str, Grant] = {g.lease_id: g for g in first.grants}
    for other in second.grants:
        mine = grants.get(other.lease_id)
        grants[other.lease_id] = other if mine is None else _later(mine, other)
    kept = sorted(grants.values(), key=lambda g: g.generation)[-KEEP_GRANTS:]
    generation = max(first.generation, second.generation)
    return first.model_copy(update={"generation": generation, "grants": tuple(kept)})


def _later(a: Grant, b: Grant) -> Grant:
    """The later of two records of one grant: the later expiry, lapsed if either says so."""
    later = a if a.expires_at >= b.expires_at else b
    return later.model_copy(update={"lapsed": a.lapsed or b.lapsed})
