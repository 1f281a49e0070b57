"""Leases: one live holder per seat, generations that a newer holder supersedes (the lease gate).

First the book itself, on a real state root and ledger with the clock set by
the test (expiry without waiting); then real targets (uvicorn, TLS,
bubblewrap): a zombie's turns refused while its replacement's run, a held
seat, expiry, ``require_lease``, the ledger's records, a restart.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import (
    BUILDER_TOKEN,
    OTHER_TOKEN,
    Target,
    events,
    local_settings,
    make_settings,
    output,
    run,
    running_target,
    sha,
    submit,
    wait_until,
)

from shared.wire import Lease, LeaseRef, Turn
from target_side.config import RoleConfig, Settings
from target_side.errors import LeaseEnded, RefusedError, SeatHeld, UnknownLease
from target_side.service.leases import LEASE_DIR, LeaseBook
from target_side.service.ledger import Ledger, read_records
from target_side.service.server import ServerThread

T0 = datetime(2030, 1, 1, tzinfo=UTC)
BUILDER = frozenset({"builder"})
ENV = ["sh", "-c", 'echo "$PADDOCK_LEASE_SEAT $PADDOCK_LEASE_GENERATION"']


class Clock:
    """The book's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def two_roles(root: Path, **builder: object) -> Settings:
    """``local_settings``' builder, and a role ``other`` sharing its workspace."""
    settings = local_settings(root, **builder)
    shared = settings.roles["builder"].workspaces
    other = RoleConfig(token_sha256=sha(OTHER_TOKEN), workspaces=shared)
    return settings.model_copy(update={"roles": {**settings.roles, "other": other}})


async def _book(settings: Settings, clock: Clock) -> tuple[LeaseBook, Ledger]:
    ledger = Ledger(settings.state_root)
    book = LeaseBook(settings, clock=clock)
    await book.start(ledger, ledger.append, watch=False)
    return book, ledger


def _refusal(book: LeaseBook, lease: LeaseRef | None, role: str = "builder") -> str:
    with pytest.raises(RefusedError) as refused:
        book.admit(role, lease)
    assert refused.value.refusal.rule == "stale-lease"
    assert refused.value.refusal.exit_code == 126
    return f"{refused.value.refusal.subject}: {refused.value.refusal.detail}"


def _lease_events(ledger: Ledger) -> list[tuple[str, int]]:
    return [(r["event"], r["lease"]["generation"]) for r in ledger.records_of("lease")]


# --- the book ---------------------------------------------------------------------------------


async def test_lease_superseded_generation_is_refused_and_the_new_one_admitted(
    tmp_path: Path,
) -> None:
    book, ledger = await _book(two_roles(tmp_path), Clock())
    first = await book.take("builder", "seat-a", 60, supersede=False)
    assert (first.generation, first.state) == (1, "held")
    book.admit("builder", first.ref)
    second = await book.take("builder", "seat-a", 60, supersede=True)
    assert second.generation == 2
    assert "no longer current" in _refusal(book, first.ref)
    book.admit("builder", second.ref)
    assert book.get(first.lease_id, BUILDER).state == "superseded"
    assert book.get(first.lease_id, BUILDER).ended_at == second.granted_at
    assert _lease_events(ledger) == [("grant", 1), ("supersede", 1), ("grant", 2)]


async def test_lease_held_seat_is_refused_without_supersede(tmp_path: Path) -> None:
    book, _ = await _book(two_roles(tmp_path), Clock())
    held = await book.take("builder", "seat-a", 60, supersede=False)
    with pytest.raises(SeatHeld) as taken:
        await book.take("builder", "seat-a", 60, supersede=False)
    assert taken.value.generation == 1
    assert "supersede" in str(taken.value)
    book.admit("builder", held.ref)  # the holder keeps it
    # Another seat, and the same seat name of another role, are other seats.
    assert (await book.take("builder", "seat-b", 60, supersede=False)).generation == 1
    assert (await book.take("other", "seat-a", 60, supersede=False)).generation == 1


async def test_lease_expiry_by_the_clock_frees_the_seat(tmp_path: Path) -> None:
    clock = Clock()
    book, ledger = await _book(two_roles(tmp_path), clock)
    old = await book.take("builder", "seat-a", 10, supersede=False)
    clock.advance(9)
    book.admit("builder", old.ref)
    clock.advance(1)
    assert "lapsed" in _refusal(book, old.ref)
    assert book.get(old.lease_id, BUILDER).state == "expired"
    assert await book.expire_due() is None
    new = await book.take("builder", "seat-a", 10, supersede=False)
    assert new.generation == 2
    with pytest.raises(LeaseEnded) as ended:
        await book.renew(old.lease_id, BUILDER, None)
    assert ended.value.state == "superseded"
    assert _lease_events(ledger) == [("grant", 1), ("expire", 1), ("grant", 2)]


async def test_lease_renewal_moves_the_expiry_and_is_recorded(tmp_path: Path) -> None:
    clock = Clock()
    book, ledger = await _book(two_roles(tmp_path), clock)
    lease = await book.take("builder", "seat-a", 10, supersede=False)
    clock.advance(8)
    renewed = await book.renew(lease.lease_id, BUILDER, None)
    assert renewed.expires_at == clock.now + timedelta(seconds=10)
    clock.advance(8)
    book.admit("builder", lease.ref)  # 16 s after the grant, alive thanks to the renewal
    longer = await book.renew(lease.lease_id, BUILDER, 100)
    assert longer.ttl_s == 100
    clock.advance(101)
    with pytest.raises(LeaseEnded) as lapsed:
        await book.renew(lease.lease_id, BUILDER, None)
    assert lapsed.value.state == "expired"
    assert _lease_events(ledger) == [("grant", 1), ("renew", 1), ("renew", 1), ("expire", 1)]


async def test_lease_superseded_is_never_renewed(tmp_path: Path) -> None:
    book, _ = await _book(two_roles(tmp_path), Clock())
    old = await book.take("builder", "seat-a", 60, supersede=False)
    await book.take("builder", "seat-a", 60, supersede=True)
    with pytest.raises(LeaseEnded) as ended:
        await book.renew(old.lease_id, BUILDER, None)
    assert ended.value.state == "superseded"
    assert book.get(old.lease_id, BUILDER).state == "superseded"


async def test_lease_release_frees_the_seat_and_ends_the_lease(tmp_path: Path) -> None:
    book, ledger = await _book(two_roles(tmp_path), Clock())
    lease = await book.take("builder", "seat-a", 60, supersede=False)
    released = await book.release(lease.lease_id, BUILDER)
    assert released.state == "released"
    assert "released" in _refusal(book, lease.ref)
    with pytest.raises(UnknownLease):  # forgotten: the seat keeps only its generation
        await book.release(lease.lease_id, BUILDER)
    assert book.listed(BUILDER) == []
    again = await book.take("builder", "seat-a", 60, supersede=False)
    assert again.generation == 2
    # A superseded lease released by its zombie leaves the current holder be.
    newer = await book.take("builder", "seat-a", 60, supersede=True)
    assert (await book.release(again.lease_id, BUILDER)).state == "superseded"
    book.admit("builder", newer.ref)
    assert [lease.lease_id for lease in book.listed(BUILDER)] == [newer.lease_id]
    assert _lease_events(ledger) == [
        ("grant", 1),
        ("release", 1),
        ("grant", 2),
        ("supersede", 2),
        ("grant", 3),
        ("release", 2),
    ]


async def test_lease_of_another_role_or_seat_or_generation_is_refused(tmp_path: Path) -> None:
    book, _ = await _book(two_roles(tmp_path), Clock())
    theirs = await book.take("other", "seat-a", 60, supersede=False)
    assert "of role 'builder'" in _refusal(book, theirs.ref, role="builder")
    book.admit("other", theirs.ref)
    mine = await book.take("builder", "seat-a", 60, supersede=False)
    wrong_seat = mine.ref.model_copy(update={"seat": "seat-b"})
    assert _refusal(book, wrong_seat).startswith("lease.seat")
    for generation in (2, 7):  # a guessed generation is no token
        forged = mine.ref.model_copy(update={"generation": generation})
        assert _refusal(book, forged).startswith("lease.generation")
    unknown = LeaseRef(lease_id="l-" + "0" * 32, seat="seat-a", generation=1)
    assert _refusal(book, unknown).startswith("lease.lease_id")
    with pytest.raises(UnknownLease):
        book.get(theirs.lease_id, BUILDER)
    with pytest.raises(UnknownLease):
        await book.renew(theirs.lease_id, BUILDER, None)
    with pytest.raises(UnknownLease):
        await book.release(theirs.lease_id, BUILDER)
    assert [lease.role for lease in book.listed(BUILDER)] == ["builder"]


async def test_lease_required_by_the_role_refuses_a_request_without_one(tmp_path: Path) -> None:
    book, _ = await _book(two_roles(tmp_path, require_lease=True), Clock())
    assert "require_lease" in _refusal(book, None)
    lease = await book.take("builder", None, 60, supersede=False)
    assert lease.seat == str(tmp_path / "ws")  # by default, the role's first workspace
    book.admit("builder", lease.ref)


async def test_lease_generations_survive_a_restart_and_a_lost_seat_file(tmp_path: Path) -> None:
    settings = two_roles(tmp_path)
    clock = Clock()
    book, _ = await _book(settings, clock)
    await book.take("builder", "seat-a", 60, supersede=False)
    held = await book.take("builder", "seat-a", 60, supersede=True)
    again, _ = await _book(settings, clock)  # a restart: the seat is still held
    again.admit("builder", held.ref)
    with pytest.raises(SeatHeld):
        await again.take("builder", "seat-a", 60, supersede=False)
    # The seat's file lost, then a torn one: the ledger still knows generation 2.
    seat_files = list((settings.state_root / LEASE_DIR).glob("*.json"))
    assert len(seat_files) == 1
    seat_files[0].unlink()
    rebuilt, ledger = await _book(settings, clock)
    rebuilt.admit("builder", held.ref)
    assert (await rebuilt.take("builder", "seat-a", 60, supersede=True)).generation == 3
    seat_files[0].write_text("{torn")
    torn, ledger = await _book(settings, clock)
    assert (await torn.take("builder", "seat-a", 60, supersede=True)).generation == 4
    recoveries = [r for r in ledger.records() if r["kind"] == "recovery"]
    assert recoveries[-1]["leases"]["set_aside"], recoveries
    # The ledger lost instead (moved away whole): the seat's file keeps the count.
    for name in ("ledger.jsonl", "ledger.head"):
        (settings.state_root / name).rename(settings.state_root / f"{name}.old")
    fresh, _ = await _book(settings, clock)
    assert (await fresh.take("builder", "seat-a", 60, supersede=True)).generation == 5


async def test_lease_expiry_is_recorded_once_when_it_comes_due(tmp_path: Path) -> None:
    clock = Clock()
    book, ledger = await _book(two_roles(tmp_path), clock)
    lease = await book.take("builder", "seat-a", 5, supersede=False)
    assert await book.expire_due() == 5.0
    clock.advance(6)
    assert await book.expire_due() is None
    assert await book.expire_due() is None
    assert _lease_events(ledger) == [("grant", 1), ("expire", 1)]
    assert book.get(lease.lease_id, BUILDER).state == "expired"
    restarted, ledger = await _book(two_roles(tmp_path), clock)
    assert await restarted.expire_due() is None
    assert _lease_events(ledger) == [("grant", 1), ("expire", 1)]  # not recorded twice


# --- real targets -----------------------------------------------------------------------------


def _take(client: httpx.Client, seat: str, **body: object) -> httpx.Response:
    return client.post("/v1/leases", json={"role": "builder", "seat": seat, **body})


def _lease(response: httpx.Response) -> Lease:
    assert response.status_code in (200, 201), response.text
    return Lease.model_validate(response.json())


def _ref(lease: Lease) -> dict[str, object]:
    return lease.ref.model_dump()


def test_lease_zombie_turn_is_refused_while_its_replacement_runs(target: Target) -> None:
    seat = "zombie-seat"
    with target.client() as zombie, target.client() as replacement:
        first = _lease(_take(zombie, seat, ttl_s=120))
        assert first.generation == 1
        turn, evs = run(zombie, ENV, lease=_ref(first))
        assert (turn.state, turn.exit_code) == ("exited", 0)
        assert output(evs) == f"{seat} 1\n"
        second = _lease(_take(replacement, seat, ttl_s=120, supersede=True))
        assert second.generation == 2
        running = submit(
            replacement,
            argv=["sh", "-c", 'sleep 2; echo "gen $PADDOCK_LEASE_GENERATION"'],
            lease=_ref(second),
        )
        assert running.state == "running"
        refused, evs = run(zombie, ["true"], lease=_ref(first))
        assert (refused.state, refused.exit_code) == ("refused", 126)
        assert refused.refusal is not None and refused.refusal.rule == "stale-lease"
        assert refused.refusal.subject == "lease.generation"
        assert evs[-1].kind == "refused"
        live = Turn.model_validate(replacement.get(f"/v1/turns/{running.turn_id}").json())
        assert live.state == "running"  # refused while the current generation's turn runs
        done = events(replacement, running.turn_id)
        assert output(done) == "gen 2\n" and done[-1].kind == "exit"
        assert done[-1].exit_code == 0  # type: ignore[union-attr]
        # The zombie can neither renew nor take the seat back quietly.
        renewed = zombie.post(f"/v1/leases/{first.lease_id}/renew")
        assert renewed.status_code == 409
        assert renewed.headers["content-type"] == "application/problem+json"
        assert renewed.json()["state"] == "superseded"
        assert _take(zombie, seat).status_code == 409
        plan = zombie.post(
            "/v1/plan", json={"role": "builder", "argv": ["true"], "lease": _ref(first)}
        )
        assert plan.json()["refusal"]["rule"] == "stale-lease"
        assert _lease(zombie.delete(f"/v1/leases/{first.lease_id}")).state == "superseded"
        assert zombie.get(f"/v1/leases/{first.lease_id}").status_code == 404
        assert _lease(replacement.get(f"/v1/leases/{second.lease_id}")).state == "held"


def test_lease_held_seat_is_409_naming_the_holder(target: Target) -> None:
    with target.client() as c:
        held = _lease(_take(c, "busy-seat", ttl_s=120))
        again = _take(c, "busy-seat")
        assert again.status_code == 409
        assert again.headers["content-type"] == "application/problem+json"
        body = again.json()
        assert (body["title"], body["seat"], body["generation"]) == ("Seat held", "busy-seat", 1)
        assert body["expires_at"] == held.expires_at.isoformat()
        assert held.lease_id not in again.text  # the holder's id is not handed out
        assert _lease(c.delete(f"/v1/leases/{held.lease_id}")).state == "released"
        assert c.get(f"/v1/leases/{held.lease_id}").status_code == 404
        assert c.delete(f"/v1/leases/{held.lease_id}").status_code == 404
        assert _lease(_take(c, "busy-seat")).generation == 2


def test_lease_routes_answer_only_the_leases_own_role(target: Target) -> None:
    with target.client() as builder, target.client(OTHER_TOKEN) as other:
        theirs = _lease(other.post("/v1/leases", json={"role": "other", "seat": "s"}))
        for response in (
            builder.get(f"/v1/leases/{theirs.lease_id}"),
            builder.post(f"/v1/leases/{theirs.lease_id}/renew", json={}),
            builder.delete(f"/v1/leases/{theirs.lease_id}"),
            builder.get("/v1/leases/not-a-lease"),
        ):
            assert response.status_code == 404, response.text
            assert response.json()["title"] == "Unknown lease"
        assert _take(builder, "s").status_code == 201  # builder's seat "s" is another seat
        assert builder.post("/v1/leases", json={"role": "other", "seat": "s"}).status_code == 403
        assert theirs.lease_id not in builder.get("/v1/leases").text
        turn, _ = run(builder, ["true"], lease=_ref(theirs))
        assert turn.refusal is not None and turn.refusal.subject == "lease.lease_id"
        listed = [Lease.model_validate(x) for x in other.get("/v1/leases").json()]
        assert theirs.lease_id in {lease.lease_id for lease in listed}


def test_lease_with_a_short_ttl_lapses_and_frees_the_seat(target: Target) -> None:
    with target.client() as c:
        brief = _lease(_take(c, "brief-seat", ttl_s=0.5))
        assert wait_until(lambda: _take(c, "brief-seat", ttl_s=60).status_code == 201)
        assert _lease(c.get(f"/v1/leases/{brief.lease_id}")).state == "expired"
        turn, _ = run(c, ["true"], lease=_ref(brief))
        assert turn.refusal is not None and turn.refusal.rule == "stale-lease"


def test_lease_bad_requests_are_422_naming_the_field(target: Target) -> None:
    with target.client() as c:
        for body, field in (
            ({"role": "builder", "seat": "a\nb"}, "seat"),
            ({"role": "builder", "seat": ""}, "seat"),
            ({"role": "builder", "ttl_s": 0}, "ttl_s"),
            ({"role": "builder", "ttl_s": 86401}, "ttl_s"),
            ({"role": "builder", "holder": "me"}, "holder"),
        ):
            answer = c.post("/v1/leases", json=body)
            assert answer.status_code == 422, body
            assert [e["field"] for e in answer.json()["errors"]] == [field], answer.text
        turn = c.post(
            "/v1/turns",
            json={"role": "builder", "argv": ["true"], "lease": {"lease_id": "x", "seat": "s"}},
        )
        assert turn.status_code == 422
        assert {e["field"] for e in turn.json()["errors"]} == {
            "lease.lease_id",
            "lease.generation",
        }


@pytest.fixture(scope="module")
def leased(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    """A target whose builder role acts only under a lease."""
    root = Path(tmp_path_factory.mktemp("leased"))
    yield from running_target(root, ca, require_lease=True)


def test_lease_required_by_the_role_refuses_a_turn_without_one(leased: Target) -> None:
    with leased.client() as c:
        bare, _ = run(c, ["true"])
        assert (bare.state, bare.exit_code) == ("refused", 126)
        assert bare.refusal is not None and bare.refusal.rule == "stale-lease"
        assert "require_lease" in bare.refusal.detail
        lease = _lease(c.post("/v1/leases", json={"role": "builder"}))
        assert lease.seat == leased.settings.roles["builder"].workspaces[0]
        turn, evs = run(c, ENV, lease=_ref(lease))
        assert turn.exit_code == 0 and output(evs) == f"{lease.seat} 1\n"
    with leased.client(OTHER_TOKEN) as other:  # a role that requires none
        # The lease gate comes before planning: reaching the workspace rule means it passed.
        refusal = run(other, ["true"], role="other", cwd="/")[0].refusal
        assert refusal is not None and refusal.rule == "outside-workspace", refusal


def test_lease_required_by_the_role_refuses_a_session_without_one(leased: Target) -> None:
    with leased.client() as c:
        bare = c.post("/v1/sessions", json={"role": "builder"})
        assert bare.status_code == 201, bare.text
        assert bare.json()["state"] == "refused"
        assert bare.json()["refusal"]["rule"] == "stale-lease"
        lease = _lease(_take(c, "session-seat", ttl_s=120))
        opened = c.post("/v1/sessions", json={"role": "builder", "lease": _ref(lease)})
        assert opened.json()["state"] == "open", opened.text
        session = opened.json()["session_id"]
        try:
            turn, evs = run(c, ENV, session=session)  # names no lease: acts under the session's
            assert turn.exit_code == 0 and output(evs) == "session-seat 1\n"
        finally:
            c.delete(f"/v1/sessions/{session}")


def test_lease_superseded_refuses_the_zombies_session_turns(target: Target) -> None:
    with target.client() as zombie, target.client() as replacement:
        first = _lease(_take(zombie, "session-zombie", ttl_s=120))
        opened = zombie.post("/v1/sessions", json={"role": "builder", "lease": _ref(first)})
        assert opened.json()["state"] == "open", opened.text
        session = opened.json()["session_id"]
        try:
            assert run(zombie, ["true"], session=session)[0].exit_code == 0
            _lease(_take(replacement, "session-zombie", ttl_s=120, supersede=True))
            refused, evs = run(zombie, ["true"], session=session)
            assert (refused.state, refused.exit_code) == ("refused", 126)
            assert refused.refusal is not None and refused.refusal.rule == "stale-lease"
            assert evs[-1].kind == "refused"
            # A refused turn leaves the session free: the next one is refused the same way.
            again, _ = run(zombie, ["true"], session=session, lease=_ref(first))
            assert again.refusal is not None and again.refusal.rule == "stale-lease"
        finally:
            zombie.delete(f"/v1/sessions/{session}")


def _lease_query(lease: Lease) -> dict[str, str]:
    return {
        "lease_id": lease.lease_id,
        "lease_seat": lease.seat,
        "lease_generation": str(lease.generation),
    }


def _role_dir(target: Target) -> Path:
    place = target.workspace / f"files-{uuid.uuid4().hex[:12]}"
    place.mkdir()
    os.chown(place, *target.settings.role_ids("builder"))
    return place


def test_lease_required_by_the_role_refuses_a_file_operation_without_one(leased: Target) -> None:
    place = _role_dir(leased)
    with leased.client() as c:
        query = {"role": "builder", "path": str(place / "f")}
        bare = c.put("/v1/files", params=query, content=b"zombie")
        assert bare.status_code == 403, bare.text
        assert bare.json()["refusal"]["rule"] == "stale-lease"
        assert not (place / "f").exists()
        lease = _lease(_take(c, "files-seat", ttl_s=120))
        put = c.put("/v1/files", params=query | _lease_query(lease), content=b"holder")
        assert put.status_code == 200, put.text
        got = c.get("/v1/files", params=query | _lease_query(lease))
        assert got.content == b"holder"
        partial = c.get("/v1/files", params=query | {"lease_id": lease.lease_id})
        assert partial.status_code == 403, partial.text
        refusal = partial.json()["refusal"]
        assert (refusal["rule"], refusal["subject"]) == ("stale-lease", "lease_seat")
        assert "lease_seat, lease_generation missing" in refusal["detail"]


def test_lease_superseded_refuses_the_zombies_file_writes(target: Target) -> None:
    place = _role_dir(target)
    with target.client() as zombie, target.client() as replacement:
        first = _lease(_take(zombie, "files-zombie", ttl_s=120))
        query = {"role": "builder", "path": str(place / "f")} | _lease_query(first)
        assert zombie.put("/v1/files", params=query, content=b"one").status_code == 200
        _lease(_take(replacement, "files-zombie", ttl_s=120, supersede=True))
        late = zombie.put("/v1/files", params=query, content=b"two")
        assert late.status_code == 403, late.text
        assert late.json()["refusal"]["rule"] == "stale-lease"
        assert (place / "f").read_bytes() == b"one"
        archive = zombie.put("/v1/archive", params=query | {"path": str(place / "d")}, content=b"")
        assert archive.json()["refusal"]["rule"] == "stale-lease"


def test_lease_records_are_in_the_ledger_and_generations_survive_a_restart(
    tmp_path: Path, ca: trustme.CA
) -> None:
    settings = make_settings(tmp_path, ca)
    cacert = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(cacert))

    def client(server: ServerThread) -> httpx.Client:
        return Target(server.url, str(cacert), settings, tmp_path / "ws").client(BUILDER_TOKEN)

    with ServerThread(settings) as server, client(server) as c:
        first = _lease(_take(c, "kept", ttl_s=120))
        _lease(c.post(f"/v1/leases/{first.lease_id}/renew", json={"ttl_s": 300}))
        second = _lease(_take(c, "kept", ttl_s=120, supersede=True))
        _lease(c.delete(f"/v1/leases/{second.lease_id}"))
        third = _lease(_take(c, "kept", ttl_s=0.2))
        assert wait_until(lambda: _lease(c.get(f"/v1/leases/{third.lease_id}")).state == "expired")
        fourth = _lease(_take(c, "kept", ttl_s=120))
    with ServerThread(settings) as server, client(server) as c:
        # Still held after the restart, and the next holder is generation 5, not 1.
        assert _lease(c.get(f"/v1/leases/{fourth.lease_id}")).state == "held"
        assert _take(c, "kept").status_code == 409
        assert _lease(_take(c, "kept", supersede=True)).generation == 5
        assert run(c, ["true"], lease=_ref(fourth))[0].refusal is not None
        assert c.get("/v1/turns").status_code == 200  # lease records are no turns to list
    records = list(read_records(settings.state_root))
    leases = [(r["event"], r["lease"]["generation"]) for r in records if r["kind"] == "lease"]
    assert leases == [
        ("grant", 1),
        ("renew", 1),
        ("supersede", 1),
        ("grant", 2),
        ("release", 2),
        ("grant", 3),
        ("expire", 3),
        ("grant", 4),
        ("supersede", 4),
        ("grant", 5),
    ]
    grant = next(r for r in records if r["kind"] == "lease")
    assert grant["lease"]["seat"] == "kept" and grant["lease"]["role"] == "builder"
    assert BUILDER_TOKEN not in (settings.state_root / "ledger.jsonl").read_text()
