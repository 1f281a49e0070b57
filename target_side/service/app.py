"""The HTTP API (docs/api.md), built per ``Settings`` by ``create_app``.

Transport failures (bad JSON, unknown turn, auth) are RFC 9457 problem
bodies; a refused turn is a turn, not an HTTP error. No handler waits on a
turn's process, and no traceback ever reaches a client.

The OpenAPI document at ``/openapi.json`` says what each route really does:
the bearer scheme on every route but health, each error status a route can
answer (as ``application/problem+json``), the event stream as
``text/event-stream``. ``/docs`` shows it with Swagger UI, served from the
target itself (no CDN: a target may have no way out).
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi_offline import FastAPIOffline
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from shared import frames
from shared.frames import MEDIA_TYPE as FRAMES_MEDIA_TYPE
from shared.wire import (
    TERMINAL_KINDS,
    Health,
    PlanResult,
    Problem,
    ProblemField,
    Resize,
    RoleList,
    Session,
    SessionRequest,
    SignalRequest,
    Turn,
    TurnRequest,
    is_session_id,
    is_turn_id,
)
from target_side.config import Settings
from target_side.errors import (
    AuthError,
    BackendError,
    NoTerminal,
    RefusedError,
    RoleNotHeld,
    SessionBusy,
    SessionEnded,
    StdinClosed,
    TargetUnavailable,
    TurnCapReached,
    TurnNotRunning,
    UnknownSession,
    UnknownTurn,
)
from target_side.fence import syscall_filter
from target_side.fence.held import FailureHook, no_failure
from target_side.fence.launch import probe
from target_side.policy.plan import host_ids
from target_side.service import files
from target_side.service.auth import TokenRoles, require_role
from target_side.service.body_limit import BodyLimit
from target_side.service.event_stream import EventStreamResponse
from target_side.service.health import HealthBoard
from target_side.service.lease_routes import install_lease_routes
from target_side.service.openapi import (
    API_VERSION,
    BEARER,
    BEARER_ONLY,
    DESCRIPTION,
    EVENT_STREAM,
    MAX_BODY,
    PROBLEM_JSON,
    RAW_BYTES,
    RESIZE_409,
    SESSION_LINKS,
    SUBMITTED_FRAMES,
    TITLE,
    TURN_409,
    TURN_LINKS,
    TURN_REQUEST_BODY,
    UNKNOWN_SESSION,
    SessionId,
    TurnId,
    errors,
    openapi,
)
from target_side.service.sessions import SessionRecord
from target_side.service.state_lock import StateLock
from target_side.service.turns import TurnManager, TurnRecord
from target_side.tools import config_file

log = logging.getLogger("paddock.target")

STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no", "Vary": "Accept"}
"""An event stream is the turn's now: no cache keeps it, no proxy holds it back."""


def create_app(
    settings: Settings, inject: FailureHook = no_failure, state_lock: StateLock | None = None
) -> FastAPI:
    """A FastAPI app serving the target described by ``settings``; no module state.

    ``inject`` is the failure-injection seam of the scratch build (tests only).
    ``state_lock``: the state root's lock, already taken by whoever serves the
    app; without one, the app takes it when it starts and gives it up last.
    """
    board = HealthBoard("bubblewrap")
    manager = TurnManager(settings, board, inject, state_lock)
    file_service = files.FileService(manager)
    tokens = TokenRoles(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        await _check_backend(manager, board)
        _check_limits(manager, board)
        await _check_config(manager)
        sweeper = asyncio.create_task(_sweep_forever(manager))
        yield
        sweeper.cancel()
        await file_service.stop()
        await manager.shutdown()

    # FastAPIOffline: FastAPI's own Swagger UI page, its scripts served from the package.
    app = FastAPIOffline(
        title=TITLE,
        version=API_VERSION,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        description=DESCRIPTION,
    )
    app.openapi = lambda: openapi(app)  # type: ignore[method-assign]
    app.state.manager = manager
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY)
    _install_problem_handlers(app)

    # Async, though they never wait: a sync dependency costs a hop to a worker thread.
    async def caller_roles(
        request: Request, _scheme: Annotated[object, Security(BEARER)]
    ) -> frozenset[str]:
        return tokens.roles_for(request.headers.get("authorization"))

    Roles = Annotated[frozenset[str], Depends(caller_roles)]

    async def visible_turn(turn_id: TurnId, roles: Roles) -> TurnRecord:
        if not is_turn_id(turn_id):
            raise UnknownTurn(f"{turn_id!r} is not a turn id (t- and 32 hex digits)")
        return manager.get(turn_id, roles)

    Visible = Annotated[TurnRecord, Depends(visible_turn)]

    def visible_session(session_id: SessionId, roles: Roles) -> SessionRecord:
        if not is_session_id(session_id):
            raise UnknownSession(f"{session_id!r} is not a session id (s- and 32 hex digits)")
        return manager.sessions.get(session_id, roles)

    VisibleSession = Annotated[SessionRecord, Depends(visible_session)]
    IdempotencyKey = Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            max_length=200,
            description="a retried POST with the same key (and role) returns the same one",
        ),
    ]

    @app.get("/v1/health", operation_id="health", summary="The target's health")
    async def health() -> Health:
        """Whether the target is armed, and every active cause if it is degraded. No token."""
        return board.snapshot()

    @app.post(
        "/v1/turns",
        status_code=201,
        operation_id="submitTurn",
        summary="Start a turn",
        response_model=Turn,
        response_description="The new turn: running, or already refused",
        responses={
            201: {
                "links": TURN_LINKS,
                "headers": {"Location": {"description": "the turn: /v1/turns/{turn_id}"}},
                "content": {FRAMES_MEDIA_TYPE: SUBMITTED_FRAMES},
            },
            **errors(
                400,
                401,
                403,
                404,
                409,
                413,
                422,
                429,
                503,
                say={404: UNKNOWN_SESSION + " (with `session`)", 409: TURN_409},
            ),
        },
        openapi_extra={"requestBody": TURN_REQUEST_BODY, "security": BEARER_ONLY},
    )
    async def submit(
        response: Response, http: Request, idempotency_key: IdempotencyKey = None
    ) -> Turn | StreamingResponse:
        """Start a turn (in a session's shell with ``session``). A refused turn is a turn too.

        Asked for frames (``Accept``), the answer is the turn's event stream, from its first
        event: a client needs no second request to follow it.
        """
        # The token and the body read here, not by dependencies: every turn starts here, and
        # FastAPI's way (its security scheme, a dict of the JSON, then the model) cost the
        # event loop a twentieth of its time per turn. The document says the same as before.
        roles = tokens.roles_for(http.headers.get("authorization"))
        request = _turn_request(http.headers.get("content-type"), await http.body())
        require_role(roles, request.role)
        if request.session is not None:
            turn = await manager.sessions.submit_turn(request, idempotency_key)
        else:
            turn = await manager.submit(request, idempotency_key)
        location = f"/v1/turns/{turn.turn_id}"
        if not _asks_for_frames(http.headers.get("accept", "")):
            response.headers["Location"] = location
            return turn
        stream = _frames(manager.get(turn.turn_id, roles), 0, None, settings.server.heartbeat_s)
        return EventStreamResponse(
            stream,
            status_code=201,
            media_type=FRAMES_MEDIA_TYPE,
            headers={**STREAM_HEADERS, "Location": location},
        )

    @app.get(
        "/v1/turns/{turn_id}",
        operation_id="getTurn",
        summary="A turn",
        responses=errors(401, 404),
    )
    async def get_turn(record: Visible) -> Turn:
        """The turn as the target knows it now."""
        return record.turn

    @app.get(
        "/v1/turns/{turn_id}/events",
        operation_id="turnEvents",
        summary="Follow a turn's events",
        response_class=StreamingResponse,
        responses={200: EVENT_STREAM, **errors(401, 404, 422)},
    )
    async def events(
        request: Request,
        record: Visible,
        after: Annotated[int, Query(ge=0, description="only events with a greater seq")] = 0,
        wait: Annotated[
            float | None,
            Query(gt=0, description="end the stream after this many seconds without an event"),
        ] = None,
        last_event_id: Annotated[
            int | None,
            Header(ge=0, alias="Last-Event-ID", description="as `after` (SSE reconnection)"),
        ] = None,
    ) -> StreamingResponse:
        """The turn's events after a seq, as Server-Sent Events (or frames, when asked for
        with ``Accept``), until its terminal event."""
        start = max(after, last_event_id or 0)
        heartbeat = settings.server.heartbeat_s
        if _asks_for_frames(request.headers.get("accept", "")):
            stream, media_type = _frames(record, start, wait, heartbeat), FRAMES_MEDIA_TYPE
        else:
            stream, media_type = _sse(record, start, wait, heartbeat), "text/event-stream"
        return EventStreamResponse(
            stream,
            media_type=media_type,
            headers=STREAM_HEADERS,
        )

    @app.post(
        "/v1/turns/{turn_id}/signal",
        status_code=202,
        operation_id="signalTurn",
        summary="Signal a turn",
        responses=errors(400, 401, 404, 409, 413, 422),
    )
    async def send_signal(body: SignalRequest, record: Visible) -> Turn:
        """Send a signal to every process of a running turn."""
        manager.signal(record, body.signal)
        return record.turn

    @app.post(
        "/v1/turns/{turn_id}/stdin",
        status_code=202,
        operation_id="writeStdin",
        summary="Write to a turn's stdin",
        responses=errors(401, 404, 409, 413, 422),
        openapi_extra={"requestBody": RAW_BYTES},
    )
    async def send_stdin(
        request: Request,
        record: Visible,
        eof: Annotated[bool, Query(description="close the turn's stdin after these bytes")] = False,
    ) -> Turn:
        """Write the body's bytes to the turn's stdin (it must have been started with it open)."""
        data = await request.body()
        await manager.write_stdin(record, data, eof)
        return record.turn

    @app.post(
        "/v1/turns/{turn_id}/resize",
        status_code=202,
        operation_id="resizeTurn",
        summary="Resize a turn's terminal",
        responses=errors(400, 401, 404, 409, 413, 422, say={409: RESIZE_409}),
    )
    async def resize(body: Resize, record: Visible) -> Turn:
        """Set the size of a terminal turn's terminal; its foreground job is told (SIGWINCH)."""
        manager.resize(record, body.rows, body.cols)
        return record.turn

    @app.post(
        "/v1/sessions",
        status_code=201,
        operation_id="startSession",
        summary="Start a session",
        response_description="The new session: open (its shell is ready), or refused",
        responses={
            201: {"links": SESSION_LINKS},
            **errors(400, 401, 403, 413, 422, 429, 503),
        },
    )
    async def start_session(
        request: SessionRequest, roles: Roles, idempotency_key: IdempotencyKey = None
    ) -> Session:
        """Start a session: one fence and one shell for the turns that name it."""
        require_role(roles, request.role)
        return await manager.sessions.create(request, idempotency_key)

    @app.get(
        "/v1/sessions",
        operation_id="listSessions",
        summary="Sessions",
        responses=errors(401, 422),
    )
    async def list_sessions(
        roles: Roles,
        limit: Annotated[int, Query(ge=1, le=1000, description="at most this many")] = 50,
    ) -> list[Session]:
        """The newest sessions of the token's roles, newest first."""
        return manager.sessions.listed(roles, limit)

    @app.get(
        "/v1/sessions/{session_id}",
        operation_id="getSession",
        summary="A session",
        responses=errors(401, 404, say={404: UNKNOWN_SESSION}),
    )
    async def get_session(record: VisibleSession) -> Session:
        """The session as the target knows it now."""
        return record.session

    @app.delete(
        "/v1/sessions/{session_id}",
        operation_id="endSession",
        summary="End a session",
        responses=errors(401, 404, say={404: UNKNOWN_SESSION}),
    )
    async def end_session(record: VisibleSession) -> Session:
        """End the session: everything in it is killed, its scratch goes with it."""
        return await manager.sessions.end(record)

    @app.post(
        "/v1/plan",
        operation_id="planTurn",
        summary="Plan a turn (dry run)",
        responses=errors(400, 401, 403, 413, 422),
    )
    async def dry_run(request: TurnRequest, roles: Roles) -> PlanResult:
        """The fence this request would get, or its refusal; nothing is built or run."""
        require_role(roles, request.role)
        return await asyncio.to_thread(manager.dry_run, request)

    @app.get(
        "/v1/roles", operation_id="heldRoles", summary="The token's roles", responses=errors(401)
    )
    async def held_roles(roles: Roles) -> RoleList:
        """The roles this token holds: a client with one needs no ``role`` named."""
        return RoleList(roles=sorted(roles))

    @app.get(
        "/v1/turns", operation_id="listTurns", summary="Recent turns", responses=errors(401, 422)
    )
    async def list_turns(
        roles: Roles,
        limit: Annotated[int, Query(ge=1, le=1000, description="at most this many")] = 50,
    ) -> list[Turn]:
        """The newest turns of the token's roles, newest first."""
        return await manager.recent(roles, limit)

    files.install(app, file_service, Roles)
    install_lease_routes(app, manager.leases, caller_roles, _problem)
    return app


async def _sweep_forever(manager: TurnManager) -> None:
    """Apply the retention time every few minutes (a tenth of it, at most five minutes)."""
    interval = min(manager.settings.server.retention_h * 360, 300.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await manager.sweep()
            await _check_config(manager)
            await _check_backend(manager, manager.board)  # a launcher may come (back) later
        except Exception:
            log.exception("retention sweep failed; trying again later")


async def _check_config(manager: TurnManager) -> None:
    """``config`` is active while the config (or what it names) has a problem; clean clears it."""
    settings = manager.settings
    if settings.config_path:
        _, problems = await asyncio.to_thread(config_file.check, Path(settings.config_path))
    else:
        problems = await asyncio.to_thread(config_file.filesystem_problems, settings)
    if problems:
        manager.board.degrade("config", "; ".join(problems))
    else:
        manager.board.recover("config")


async def _check_backend(manager: TurnManager, board: HealthBoard) -> None:
    settings = manager.settings
    if settings.fence.identity == "server":
        board.degrade(
            "identity",
            'turns run as the server\'s own uid ([fence] identity = "server"): '
            "only the fence stands between a turn and the server's files",
        )
    try:
        role = next(iter(settings.roles))
        failure = await probe(manager.bwrap(), role, host_ids(settings, role), manager.identity)
    except BackendError as exc:
        failure = str(exc)
    except RefusedError as exc:
        failure = exc.refusal.detail
    if failure is not None:
        board.degrade("backend", f"bubblewrap does not work here: {failure}")
        return
    unfiltered = syscall_filter.unavailable_reason()
    if unfiltered is not None:
        board.degrade("backend", f"turns run without the seccomp filter: {unfiltered}")
    else:
        board.recover("backend")


def _check_limits(manager: TurnManager, board: HealthBoard) -> None:
    """Which of memory, pids and cpu fall short of a per-turn cgroup here, and why."""
    degraded = manager.limiter.degraded()
    if degraded is None:
        board.recover("limits")
    else:
        board.degrade("limits", degraded)


async def _sse(
    record: TurnRecord, after: int, wait: float | None, heartbeat: float
) -> AsyncIterator[bytes]:
    """Events after ``after`` from the spool, then live; ends at the terminal event.

    ``wait`` bounds silence; heartbeat comments keep idle proxies from cutting the stream.
    """
    loop = asyncio.get_running_loop()
    seq, quiet_since = after, loop.time()
    while True:
        batch = await record.spool.raw_after(seq)
        for seq, kind, line in batch:
            if kind in TERMINAL_KINDS:
                yield b"id: %d\nevent: %s\ndata: %s\n\n" % (seq, kind.encode(), _sse_end(line))
                return
            yield b"id: %d\nevent: %s\ndata: %s\n\n" % (seq, kind.encode(), line)
        if batch:
            quiet_since = loop.time()
            continue
        if record.spool.finished:
            return  # resumed at or past the terminal event: nothing more will come
        budget = heartbeat if wait is None else min(heartbeat, wait - (loop.time() - quiet_since))
        if budget <= 0:
            return
        if not await record.spool.wait_beyond(seq, budget):
            yield b": ping\n\n"


def _turn_request(content_type: str | None, body: bytes) -> TurnRequest:
    """The body as a ``TurnRequest``, or the error FastAPI would have raised for it (its
    problem says which field, or that the body was not sent as JSON)."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if not media_type.startswith("application/") or not media_type.endswith(("/json", "+json")):
        said = f"sent as {media_type!r}" if media_type else "sent with no Content-Type"
        raise RequestValidationError(
            [{"type": "content_type", "loc": ("body",), "msg": f"{said}: send application/json"}]
        )
    try:
        return TurnRequest.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()], body=body
        ) from None


def _asks_for_frames(accept: str) -> bool:
    """Whether ``Accept`` names the frame stream (with a quality above zero)."""
    for item in accept.split(","):
        media_type, _, params = item.partition(";")
        if media_type.strip().lower() != FRAMES_MEDIA_TYPE:
            continue
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


async def _frames(
    record: TurnRecord, after: int, wait: float | None, heartbeat: float
) -> AsyncIterator[bytes]:
    """``_sse``'s stream as frames: the spool's bytes as they lie on disk, block by block."""
    loop = asyncio.get_running_loop()
    seq, quiet_since = after, loop.time()
    while True:
        seq, kind, block = await record.spool.frames_after(seq)
        if block:
            yield block
            if kind in TERMINAL_KINDS:
                return
            quiet_since = loop.time()
            continue
        if record.spool.finished:
            return
        budget = heartbeat if wait is None else min(heartbeat, wait - (loop.time() - quiet_since))
        if budget <= 0:
            return
        if not await record.spool.wait_beyond(seq, budget):
            yield frames.heartbeat()


def _sse_end(line: bytes) -> bytes:
    """A terminal event as the event stream has always sent it: without the ended turn.

    Clients that know of ``turn`` get it from the frame stream; event-stream
    clients, which may reject a field they do not know, ask ``GET`` for it.
    """
    if b'"turn":' not in line:
        return line
    event = json.loads(line)
    event.pop("turn", None)
    return json.dumps(event, separators=(",", ":")).encode()


def _problem(
    status: int,
    title: str,
    detail: str | None = None,
    errors: list[ProblemField] | None = None,
    **extra: Any,
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, errors=errors or [], **extra)
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM_JSON
    )


def _install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_field_problem(e) for e in exc.errors()]
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            return _problem(400, "Malformed JSON", "the request body is not valid JSON", errors)
        detail = "; ".join(f"{e.field}: {e.message}" for e in errors)
        return _problem(422, "Invalid request", detail, errors)

    @app.exception_handler(AuthError)
    async def unauthenticated(_request: Request, exc: AuthError) -> JSONResponse:
        response = _problem(401, "Unauthenticated", str(exc))
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(RoleNotHeld)
    async def forbidden(_request: Request, exc: RoleNotHeld) -> JSONResponse:
        return _problem(403, "Role not held", str(exc))

    @app.exception_handler(UnknownTurn)
    async def unknown(_request: Request, exc: UnknownTurn) -> JSONResponse:
        return _problem(404, "Unknown turn", str(exc))

    @app.exception_handler(UnknownSession)
    async def unknown_session(_request: Request, exc: UnknownSession) -> JSONResponse:
        return _problem(404, "Unknown session", str(exc))

    @app.exception_handler(SessionBusy)
    async def session_busy(_request: Request, exc: SessionBusy) -> JSONResponse:
        extra = {"turn_id": exc.turn_id} if exc.turn_id else {}
        return _problem(409, "Session busy", str(exc), None, **extra)

    @app.exception_handler(SessionEnded)
    async def session_ended(_request: Request, exc: SessionEnded) -> JSONResponse:
        return _problem(409, "Session has ended", str(exc))

    @app.exception_handler(NoTerminal)
    async def no_terminal(_request: Request, exc: NoTerminal) -> JSONResponse:
        return _problem(409, "Turn has no terminal", str(exc))

    @app.exception_handler(TurnNotRunning)
    async def ended(_request: Request, exc: TurnNotRunning) -> JSONResponse:
        return _problem(409, "Turn has ended", str(exc))

    @app.exception_handler(StdinClosed)
    async def no_stdin(_request: Request, exc: StdinClosed) -> JSONResponse:
        return _problem(409, "Turn takes no input", str(exc))

    @app.exception_handler(TurnCapReached)
    async def over_cap(_request: Request, exc: TurnCapReached) -> JSONResponse:
        response = _problem(429, "Too many running turns", str(exc), cap=exc.cap, limit=exc.limit)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(TargetUnavailable)
    async def unavailable(_request: Request, exc: TargetUnavailable) -> JSONResponse:
        title = "Target disk full" if exc.reason == "disk" else "Target stopping"
        response = _problem(503, title, str(exc), reason=exc.reason)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _problem(exc.status_code, str(exc.detail))
        if exc.status_code == 405:
            response.headers["Allow"] = _allowed_methods(request)
        return response

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # The details go to the server log, never to the client.
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return _problem(500, "Internal error", "the target failed; its log has the details")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (RFC 9110: what the resource supports).

    Starlette names only the methods of the first route matching the path, and
    ``/v1/turns`` has two routes (GET and POST).
    """
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _field_problem(error: Mapping[str, Any]) -> ProblemField:
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return ProblemField(field=".".join(loc) or "body", message=message)
