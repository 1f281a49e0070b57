"""What the OpenAPI document says beyond what FastAPI infers from the routes.

FastAPI describes a route from its signature: parameters, body, the success
model. Everything else a client relies on is declared here, once, for
``app.py`` to attach: the bearer scheme, the error statuses each route can
answer (every one a ``Problem`` as ``application/problem+json``), the event
stream as ``text/event-stream`` or frames, the raw stdin body, the links from a new turn
to what a client does with it next. ``tests/test_openapi.py`` holds the
document to each of these, and ``tests/test_schemathesis.py`` holds the server
to the document.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi import Path as PathParam
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer

from shared.frames import MEDIA_TYPE as FRAMES_MEDIA_TYPE
from shared.wire import EVENTS, Problem

PROBLEM_JSON = "application/problem+json"
MAX_BODY = 1 << 20
"""Bytes a request body may have; a longer one is answered 413 before anything parses it."""
TITLE = "paddock target"
API_VERSION = "1"
DESCRIPTION = (
    "Runs turns (one command, or one script) inside a fence the target builds from its own "
    "configuration. Every route but `/v1/health` needs a role's bearer token. A refused turn "
    "is a turn (state `refused`, exit status 126 or 127), never an HTTP error; HTTP errors are "
    "RFC 9457 problem bodies (`application/problem+json`) for requests the target did not "
    "take. A session (`/v1/sessions`) is one fence with one shell for many turns, each "
    "naming it; a turn with `tty` runs on a terminal. docs/api.md in the paddock repository "
    "says the same in prose."
)

BEARER = HTTPBearer(
    scheme_name="bearer",
    description="A role's token (`paddock-target token mint ROLE`); the target keeps only its "
    "sha256. One token may hold several roles.",
    auto_error=False,
)
"""For the schema only: the app reads the header itself, so every auth failure is its own 401."""

_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before asking again",
        "required": True,
        "schema": {"type": "integer", "minimum": 0},
    }
}
_ERRORS: dict[int, dict[str, Any]] = {
    400: {"description": "The body is not valid JSON."},
    401: {
        "description": "No bearer token, or one that matches no role on this target.",
        "headers": {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    },
    403: {"description": "The token does not hold the role the request names."},
    404: {"description": "No turn with that id among the turns of the token's roles."},
    409: {"description": "The turn has ended, or it takes no input (not started with stdin open)."},
    413: {"description": f"The body is over {MAX_BODY} bytes."},
    422: {"description": "The request does not fit its schema; `errors` names every field."},
    429: {
        "description": "A cap on running turns is reached (`cap` names its configuration key, "
        "`limit` its value); nothing was started.",
        "headers": _RETRY_AFTER,
    },
    503: {
        "description": "The target takes no new turn for now: its state disk is full "
        "(`reason: disk`) or it is stopping (`reason: stopping`).",
        "headers": _RETRY_AFTER,
    },
}


def errors(*statuses: int, say: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """A route's error responses: each a ``Problem`` (``openapi`` gives them their media type).

    ``say`` replaces the description of a status where the route means something else by it.
    """
    said = say or {}
    return {
        status: {"model": Problem, **_ERRORS[status], **_described(said.get(status))}
        for status in statuses
    }


def _described(description: str | None) -> dict[str, str]:
    return {} if description is None else {"description": description}


UNKNOWN_SESSION = "No session with that id among the sessions of the token's roles."
TURN_409 = (
    "The session the turn names runs another turn (`turn_id` names it: one at a time), or has "
    "ended; nothing was started."
)
RESIZE_409 = "The turn has ended, or runs on no terminal (not started with `tty`)."


TurnId = Annotated[
    str,
    PathParam(
        description="a turn id (`t-` and 32 hex digits); any other text is answered 404, "
        "as an unknown turn is",
        json_schema_extra={"pattern": r"^t-[0-9a-f]{32}$"},
    ),
]

SessionId = Annotated[
    str,
    PathParam(
        description="a session id (`s-` and 32 hex digits); any other text is answered 404, "
        "as an unknown session is",
        json_schema_extra={"pattern": r"^s-[0-9a-f]{32}$"},
    ),
]

_REFS = "#/components/schemas/{model}"
EVENT_STREAM: dict[str, Any] = {
    "description": "Server-Sent Events, one per turn event: `id: SEQ`, `event: KIND`, "
    "`data: <the Event as JSON>`, then a blank line; `: ping` comment lines while the turn "
    "is quiet. With `Accept: application/x-paddock-frames`, frames instead (docs/api.md, "
    '"Frames"). The stream ends after the terminal event (`exit` or `refused`), or after '
    "`wait` seconds without one.",
    "content": {
        "text/event-stream": {
            # One event of the stream (``itemSchema``, as FastAPI's own SSE routes say it).
            "itemSchema": {
                "type": "object",
                "required": ["id", "event", "data"],
                "properties": {
                    "id": {"type": "string", "pattern": "^[1-9][0-9]*$", "description": "seq"},
                    "event": {
                        "type": "string",
                        "enum": ["started", "stdout", "stderr", "exit", "refused", "notice"],
                    },
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"$ref": _REFS.format(model="Event")},
                    },
                },
            },
            "example": 'id: 1\nevent: started\ndata: {"seq":1,"kind":"started",...}\n\n',
        },
        FRAMES_MEDIA_TYPE: {
            "schema": {
                "type": "string",
                "format": "binary",
                "description": "Frames, answered when `Accept` names this type: per event a "
                "24-byte header (kind u8, 3 zero bytes, payload length u32, seq u64, time "
                "u64 in microseconds since the epoch; big-endian), then the payload: the "
                "output's own bytes for `stdout` and `stderr` (kinds 2 and 3), the Event as "
                "JSON for `started` (1), `exit` (4), `refused` (5) and `notice` (6); the "
                "terminal event also carries the ended `turn`. Kind 0 is a heartbeat (no "
                "payload) while the turn is quiet.",
            }
        },
    },
}
SUBMITTED_FRAMES: dict[str, Any] = {
    "schema": {
        "type": "string",
        "format": "binary",
        "description": "With `Accept: application/x-paddock-frames`: the new turn's frames from "
        "its first event to its terminal one, as `GET /v1/turns/{turn_id}/events` would "
        "answer them, in the same response (`Location` names the turn). A client whose "
        "stream breaks goes on with that route after the last seq it got.",
    }
}
"""The second answer of ``201``: one round trip for a turn, start to end."""
RAW_BYTES: dict[str, Any] = {
    "required": False,
    "description": "bytes for the turn's stdin, as they are (none: only `eof` acts)",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}
TURN_REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TurnRequest"}}},
}
"""The body of ``POST /v1/turns``, which the route reads itself."""
BEARER_ONLY: list[dict[str, list[str]]] = [{"bearer": []}]
"""The security of a route that reads the token itself, without a dependency to say so."""
TURN_LINKS = {
    operation: {"operationId": operation, "parameters": {"turn_id": "$response.body#/turn_id"}}
    for operation in ("getTurn", "turnEvents", "signalTurn", "writeStdin", "resizeTurn")
}
"""What a client does next with the turn it started: the links of ``201``."""
SESSION_LINKS = {
    operation: {
        "operationId": operation,
        "parameters": {"session_id": "$response.body#/session_id"},
    }
    for operation in ("getSession", "endSession")
}
"""What a client does next with the session it started."""

LeaseId = Annotated[
    str,
    PathParam(
        description="a lease id (`l-` and 32 hex digits); any other text is answered 404, "
        "as an unknown lease is",
        json_schema_extra={"pattern": r"^l-[0-9a-f]{32}$"},
    ),
]
LEASE_LINKS = {
    operation: {"operationId": operation, "parameters": {"lease_id": "$response.body#/lease_id"}}
    for operation in ("getLease", "renewLease", "releaseLease")
}
"""What a client does next with the lease it took: the links of ``201``."""


_FASTAPI_422 = "#/components/schemas/HTTPValidationError"


def openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with every error response as ``application/problem+json``.

    FastAPI files an extra response under the route's own media type; the
    target answers every error with a problem body, so the document says that.
    FastAPI also guesses a 422 of its own shape for every route with
    parameters; each route that can answer 422 declares it (a ``Problem``),
    so a guessed one is a status the route never answers, and goes.
    """
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for operations in schema["paths"].values():
            for operation in operations.values():
                for parameter in operation.get("parameters", []):
                    _never_null(parameter["schema"])
                responses = operation.get("responses", {})
                for status, response in list(responses.items()):
                    content = response.get("content", {})
                    if content.get("application/json", {}).get("schema") == {"$ref": _FASTAPI_422}:
                        del responses[status]
                    elif status[0] in "45" and "application/json" in content:
                        content[PROBLEM_JSON] = content.pop("application/json")
        components = schema["components"]["schemas"]
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        event = EVENTS.json_schema(ref_template=_REFS, mode="serialization")
        for name, model in event.pop("$defs", {}).items():
            components.setdefault(name, model)
        components["Event"] = event
        app.openapi_schema = schema
    return app.openapi_schema


def _never_null(schema: dict[str, Any]) -> None:
    """A parameter is text on the wire, absent or present, never null: FastAPI's optional
    parameters say ``anyOf [T, null]``, which a client could only send as the text "null"."""
    branches = schema.get("anyOf")
    if not branches or {"type": "null"} not in branches:
        return
    rest = [branch for branch in branches if branch != {"type": "null"}]
    del schema["anyOf"]
    if len(rest) == 1:
        schema.update(rest[0])
    else:
        schema["anyOf"] = rest
