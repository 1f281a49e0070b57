"""The lease routes of the API (docs/api.md, "Leases"): take, list, look at, renew, release.

The seats and the rule are ``leases.LeaseBook``'s; this module only maps HTTP
onto it. A lease is visible to a token that holds its role, and to no other:
any other lease id is 404, exactly as one that does not exist.
"""

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from shared.wire import Lease, LeaseRequest, RenewRequest, is_lease_id
from target_side.errors import LeaseEnded, SeatHeld, UnknownLease
from target_side.service.auth import require_role
from target_side.service.leases import LeaseBook
from target_side.service.openapi import LEASE_LINKS, LeaseId, errors

Problem = Callable[..., JSONResponse]
"""``app._problem``: a problem+json response from a status, a title, a detail and extras."""

_UNKNOWN = "No lease with that id among the leases of the token's roles."
_TAKEN = (
    "The seat is held by another lease (`generation` and `expires_at` say whose and until "
    "when); send `supersede: true` to take it over."
)
_ENDED = "The lease no longer holds its seat (`state`: superseded, released or expired)."
_DISK = "The target's state disk refused the lease (`reason: disk`); nothing was changed."


def install_lease_routes(
    app: FastAPI,
    book: LeaseBook,
    caller_roles: Callable[..., Awaitable[frozenset[str]]],
    problem: Problem,
) -> None:
    """Add the lease routes and their error answers to ``app``."""
    Roles = Annotated[frozenset[str], Depends(caller_roles)]

    def lease_id(lease_id: LeaseId) -> str:
        if not is_lease_id(lease_id):
            raise UnknownLease(f"{lease_id!r} is not a lease id (l- and 32 hex digits)")
        return lease_id

    Id = Annotated[str, Depends(lease_id)]

    @app.post(
        "/v1/leases",
        status_code=201,
        operation_id="takeLease",
        summary="Take a seat",
        response_description="The new lease: the seat's next generation",
        responses={
            201: {"links": LEASE_LINKS},
            **errors(400, 401, 403, 409, 413, 422, 503, say={409: _TAKEN, 503: _DISK}),
        },
    )
    async def take(body: LeaseRequest, roles: Roles) -> Lease:
        """Take a lease on a seat (default: the role's first workspace) for ``ttl_s`` seconds."""
        require_role(roles, body.role)
        return await book.take(body.role, body.seat, body.ttl_s, body.supersede)

    @app.get(
        "/v1/leases",
        operation_id="listLeases",
        summary="Seats and their leases",
        responses=errors(401),
    )
    async def listed(roles: Roles) -> list[Lease]:
        """The latest lease of every seat of the token's roles, by role and seat."""
        return book.listed(roles)

    @app.get(
        "/v1/leases/{lease_id}",
        operation_id="getLease",
        summary="A lease",
        responses=errors(401, 404, say={404: _UNKNOWN}),
    )
    async def get(lease: Id, roles: Roles) -> Lease:
        """The lease as the target knows it now (``state`` says whether it still holds)."""
        return book.get(lease, roles)

    @app.post(
        "/v1/leases/{lease_id}/renew",
        operation_id="renewLease",
        summary="Renew a lease",
        responses=errors(
            400, 401, 404, 409, 413, 422, 503, say={404: _UNKNOWN, 409: _ENDED, 503: _DISK}
        ),
    )
    async def renew(
        lease: Id, roles: Roles, body: Annotated[RenewRequest | None, Body()] = None
    ) -> Lease:
        """Extend a held lease to ``ttl_s`` seconds from now (default: its own ``ttl_s``)."""
        return await book.renew(lease, roles, body.ttl_s if body is not None else None)

    @app.delete(
        "/v1/leases/{lease_id}",
        operation_id="releaseLease",
        summary="Release a lease",
        responses=errors(401, 404, 503, say={404: _UNKNOWN, 503: _DISK}),
    )
    async def release(lease: Id, roles: Roles) -> Lease:
        """Give the seat up now; a lease that no longer holds it is answered as it is."""
        return await book.release(lease, roles)

    @app.exception_handler(UnknownLease)
    async def unknown(_request: Request, exc: UnknownLease) -> JSONResponse:
        return problem(404, "Unknown lease", str(exc))

    @app.exception_handler(SeatHeld)
    async def held(_request: Request, exc: SeatHeld) -> JSONResponse:
        facts: dict[str, Any] = {
            "seat": exc.seat,
            "generation": exc.generation,
            "expires_at": exc.expires_at,
        }
        return problem(409, "Seat held", str(exc), **facts)

    @app.exception_handler(LeaseEnded)
    async def ended(_request: Request, exc: LeaseEnded) -> JSONResponse:
        return problem(409, "Lease ended", str(exc), state=exc.state)
