"""The agent's leases: what ``paddock lease`` took, and a lease held while Python code works.

    $XDG_STATE_HOME/paddock/            (else ~/.local/state/paddock)    0700
      leases/ID.json                    {"lease_id", "role", "seat", "generation", "expires_at",
                                         "ttl_s", "target"}                            0600

``paddock lease take`` writes the lease it took there, so that ``paddock run
--lease ID`` (in another process, later) can name it; ``renew`` rewrites it,
``release`` removes it. A lease id is no secret from whoever holds its role's
token (``GET /v1/leases`` lists them), but it is what an agent acts under,
so the file is as private as the cursors beside it.

``HeldLease`` is a lease this process holds: a thread renews it every third
of its ``ttl_s`` until it is closed, which releases it. ``Target.lease()``
makes one, and every turn that ``Target`` runs meanwhile carries it. A
renewal the target answers with "superseded" (or lapsed, or unknown) stops
the renewing and sets ``lost``; the target refuses that lease's turns from
then on, whatever this process does.

This module is imported by ``paddock run --lease``: the standard library and
paddock's light modules only, at import.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from agent_side.errors import AgentError, LeaseLost, UsageError
from agent_side.user_files import private_dir, read_text, state_dir, write_private

if TYPE_CHECKING:
    from agent_side.client import TargetClient
    from shared.wire import Lease, LeaseRef

LEASE_ID = re.compile(r"l-[0-9a-f]{32}")
RENEW_SHARE = 3
"""A held lease is renewed this many times per ``ttl_s``: two renewals may fail before it lapses."""
RETRY_S = 1.0
"""After a renewal that could not reach the target, how long until the next try (at most)."""


# --- the files of the leases paddock took ---------------------------------------------------


def lease_dir(environ: Mapping[str, str]) -> Path:
    return state_dir(environ) / "leases"


def checked_id(lease_id: str) -> str:
    if not LEASE_ID.fullmatch(lease_id):
        raise UsageError(f"{lease_id!r} is not a lease id (l- and 32 hex digits)")
    return lease_id


def save(lease: Lease, target: str, environ: Mapping[str, str]) -> Path:
    """Keep ``lease`` (taken from ``target``) for later commands; returns its file."""
    directory = private_dir(lease_dir(environ))
    path = directory / f"{checked_id(lease.lease_id)}.json"
    record = {**lease.model_dump(mode="json"), "target": target}
    write_private(path, json.dumps(record, indent=2) + "\n")
    return path


def stored(lease_id: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """The lease ``lease_id`` as ``paddock lease`` last saw it; a ``UsageError`` if it has none."""
    path = lease_dir(environ) / f"{checked_id(lease_id)}.json"
    try:
        text = read_text(path)
        record = json.loads(text) if text is not None else None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the lease file {path}: {exc}") from exc
    if not isinstance(record, dict):
        raise UsageError(
            f"no lease {lease_id} taken here ({path} does not exist); take one with "
            "paddock lease take"
        )
    return record


def stored_ref(lease_id: str, environ: Mapping[str, str]) -> tuple[str, str, int]:
    """(lease id, seat, generation) of a lease ``paddock lease take`` kept: what a run names."""
    record = stored(lease_id, environ)
    seat, generation = record.get("seat"), record.get("generation")
    if not isinstance(seat, str) or not isinstance(generation, int):
        raise UsageError(f"the lease file of {lease_id} has no seat or generation; take it again")
    return lease_id, seat, generation


def forget(lease_id: str, environ: Mapping[str, str]) -> None:
    (lease_dir(environ) / f"{checked_id(lease_id)}.json").unlink(missing_ok=True)


def describe(lease: Lease) -> str:
    """One line for a person: id, generation, seat, state and until when."""
    until = "until" if lease.state == "held" else "since"
    moment = lease.expires_at if lease.state in ("held", "expired") else lease.ended_at
    when = moment.isoformat(timespec="seconds") if moment is not None else "?"
    return (
        f"{lease.lease_id}  generation {lease.generation}  seat {lease.seat}  "
        f"role {lease.role}  {lease.state} {until} {when}"
    )


# --- a lease held while code runs -----------------------------------------------------------


class HeldLease:
    """A lease renewed in the background while held; ``close()`` stops that and releases it."""

    def __init__(
        self,
        client: TargetClient,
        lease: Lease,
        *,
        renew_every_s: float | None = None,
        on_close: Callable[[HeldLease], None] | None = None,
    ) -> None:
        self._client = client
        self._lease = lease
        self._every_s = renew_every_s or lease.ttl_s / RENEW_SHARE
        self._on_close = on_close
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._renew_forever, daemon=True, name=f"paddock-lease-{lease.lease_id}"
        )
        self.lost: AgentError | None = None
        """Why the lease no longer holds its seat (superseded, lapsed), once a renewal said so."""
        self.renewals = 0

    @property
    def lease(self) -> Lease:
        """The lease as its last renewal answered it."""
        with self._guard:
            return self._lease

    @property
    def ref(self) -> LeaseRef:
        """What a request names to act under this lease."""
        return self.lease.ref

    @property
    def held(self) -> bool:
        """Renewing, and no renewal has said the lease was lost."""
        return self.lost is None and not self._stop.is_set()

    def start(self) -> HeldLease:
        self._thread.start()
        return self

    def close(self, *, release: bool = True) -> None:
        """Stop renewing, then (by default) release the lease: its seat is free at once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            if release and self.lost is None:
                # A release that fails leaves the lease to lapse by itself, which is its end too.
                with contextlib.suppress(AgentError, RuntimeError):
                    self._client.release_lease(self._lease.lease_id)
        finally:
            if self._on_close is not None:
                self._on_close(self)

    def __enter__(self) -> HeldLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> HeldLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.close)  # the release is a request: not on the event loop

    def __repr__(self) -> str:
        lease = self.lease
        state = "lost" if self.lost is not None else "held" if self.held else "closed"
        return f"HeldLease({lease.lease_id}, seat={lease.seat!r}, gen={lease.generation}, {state})"

    def _renew_forever(self) -> None:
        wait = self._every_s
        while not self._stop.wait(wait):
            try:
                renewed = self._client.renew_lease(self._lease.lease_id)
            except LeaseLost as exc:
                self.lost = exc
                return
            except AgentError:
                wait = min(self._every_s, RETRY_S)  # the target was not reached: soon again
                continue
            except RuntimeError:
                return  # the client was closed under it
            with self._guard:
                self._lease = renewed
            self.renewals += 1
            wait = self._every_s
