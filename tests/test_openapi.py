"""The OpenAPI document a real target serves says what the target really does.

Fetched from a running target (uvicorn, TLS), never built in-process: what a
client downloads is what is checked.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import httpx
import jsonschema_rs
import pytest
from conftest import Target

from shared.wire import TurnRequest

PROBLEM = {"$ref": "#/components/schemas/Problem"}
REFUSED_PROBLEM = {"$ref": "#/components/schemas/RefusedProblem"}
FILE_ROUTES = {
    ("get", "/v1/files"),
    ("put", "/v1/files"),
    ("get", "/v1/archive"),
    ("put", "/v1/archive"),
}
FILE_STATUSES = {403, 404, 408, 409, 413, 507}
"""What a file route answers with a ``RefusedProblem``: a refusal, or the system's errno."""

ERRORS = {
    ("get", "/v1/health"): set(),
    ("post", "/v1/turns"): {400, 401, 403, 404, 409, 413, 422, 429, 503},
    ("get", "/v1/turns"): {401, 422},
    ("get", "/v1/turns/{turn_id}"): {401, 404},
    ("get", "/v1/turns/{turn_id}/events"): {401, 404, 422},
    ("post", "/v1/turns/{turn_id}/signal"): {400, 401, 404, 409, 413, 422},
    ("post", "/v1/turns/{turn_id}/stdin"): {401, 404, 409, 413, 422},
    ("post", "/v1/turns/{turn_id}/resize"): {400, 401, 404, 409, 413, 422},
    ("post", "/v1/plan"): {400, 401, 403, 413, 422},
    ("get", "/v1/roles"): {401},
    ("get", "/v1/files"): {401, 403, 404, 409, 422, 429, 503},
    ("put", "/v1/files"): {401, 403, 404, 408, 409, 413, 422, 429, 503, 507},
    ("get", "/v1/archive"): {401, 403, 404, 409, 422, 429, 503},
    ("put", "/v1/archive"): {401, 403, 404, 408, 409, 413, 422, 429, 503, 507},
    ("post", "/v1/leases"): {400, 401, 403, 409, 413, 422, 503},
    ("get", "/v1/leases"): {401},
    ("get", "/v1/leases/{lease_id}"): {401, 404},
    ("post", "/v1/leases/{lease_id}/renew"): {400, 401, 404, 409, 413, 422, 503},
    ("delete", "/v1/leases/{lease_id}"): {401, 404, 503},
    ("post", "/v1/sessions"): {400, 401, 403, 413, 422, 429, 503},
    ("get", "/v1/sessions"): {401, 422},
    ("get", "/v1/sessions/{session_id}"): {401, 404},
    ("delete", "/v1/sessions/{session_id}"): {401, 404},
}
"""Every route and the error statuses it can answer, as the handlers and middleware raise them."""


@pytest.fixture(scope="module")
def document(target: Target) -> dict[str, Any]:
    with target.client(token=None) as anonymous:
        response = anonymous.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method, path): operation
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    }


def test_openapi_lists_every_route(document: dict[str, Any]) -> None:
    assert set(operations(document)) == set(ERRORS)


def test_openapi_bearer_scheme_guards_every_route_but_health(document: dict[str, Any]) -> None:
    schemes = document["components"]["securitySchemes"]
    assert schemes == {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": schemes["bearer"]["description"],
        }
    }
    for key, operation in operations(document).items():
        expected = None if key == ("get", "/v1/health") else [{"bearer": []}]
        assert operation.get("security") == expected, key


def test_openapi_token_is_no_header_parameter(document: dict[str, Any]) -> None:
    for key, operation in operations(document).items():
        names = {p["name"].lower() for p in operation.get("parameters", [])}
        assert "authorization" not in names, key


def test_openapi_documents_each_error_as_a_problem(document: dict[str, Any]) -> None:
    for key, operation in operations(document).items():
        responses = operation["responses"]
        errors = {int(status) for status in responses if status[0] in "45"}
        assert errors == ERRORS[key], key
        for status in errors:
            content = responses[str(status)]["content"]
            refused = key in FILE_ROUTES and status in FILE_STATUSES
            schema = REFUSED_PROBLEM if refused else PROBLEM
            assert content == {"application/problem+json": {"schema": schema}}, (key, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_openapi_retry_and_auth_headers_are_declared(document: dict[str, Any]) -> None:
    submit = operations(document)[("post", "/v1/turns")]["responses"]
    for status in ("429", "503"):
        header = submit[status]["headers"]["Retry-After"]
        assert header["required"] is True and header["schema"]["type"] == "integer"
    assert submit["401"]["headers"]["WWW-Authenticate"]["required"] is True


def test_openapi_events_are_an_event_stream_or_frames(document: dict[str, Any]) -> None:
    ok = operations(document)[("get", "/v1/turns/{turn_id}/events")]["responses"]["200"]
    assert set(ok["content"]) == {"text/event-stream", "application/x-paddock-frames"}
    frames = ok["content"]["application/x-paddock-frames"]["schema"]
    assert (frames["type"], frames["format"]) == ("string", "binary")
    assert "24-byte header" in frames["description"]
    item = ok["content"]["text/event-stream"]["itemSchema"]
    assert item["required"] == ["id", "event", "data"]
    assert item["properties"]["data"]["contentSchema"] == {"$ref": "#/components/schemas/Event"}
    assert "Event" in document["components"]["schemas"]


def test_openapi_last_event_id_is_an_integer_header(document: dict[str, Any]) -> None:
    parameters = operations(document)[("get", "/v1/turns/{turn_id}/events")]["parameters"]
    (header,) = [p for p in parameters if p["in"] == "header"]
    assert header["name"] == "Last-Event-ID"
    assert header["schema"]["type"] == "integer"
    assert header["schema"]["minimum"] == 0


def test_openapi_parameters_are_never_null(document: dict[str, Any]) -> None:
    # A parameter is text on the wire: a client could only send "null" as four letters.
    for key, operation in operations(document).items():
        for parameter in operation.get("parameters", []):
            assert "null" not in str(parameter["schema"]), (key, parameter["name"])


def test_openapi_turn_body_is_a_turn_request(document: dict[str, Any]) -> None:
    # The route reads its body itself; the document still says what it must be.
    body = operations(document)[("post", "/v1/turns")]["requestBody"]
    assert body["required"] is True
    assert body["content"] == {
        "application/json": {"schema": {"$ref": "#/components/schemas/TurnRequest"}}
    }


def test_openapi_stdin_takes_raw_bytes(document: dict[str, Any]) -> None:
    body = operations(document)[("post", "/v1/turns/{turn_id}/stdin")]["requestBody"]
    assert set(body["content"]) == {"application/octet-stream"}


def test_openapi_file_bodies_are_binary(document: dict[str, Any]) -> None:
    binary = {"schema": {"type": "string", "format": "binary"}}
    ops = operations(document)
    assert ops[("put", "/v1/files")]["requestBody"]["content"] == {
        "application/octet-stream": binary
    }
    assert ops[("put", "/v1/archive")]["requestBody"]["content"] == {"application/x-tar": binary}
    read = ops[("get", "/v1/files")]["responses"]["200"]["content"]
    assert read["application/octet-stream"] == binary
    assert read["application/json"]["schema"] == {"$ref": "#/components/schemas/FileListing"}
    archive = ops[("get", "/v1/archive")]["responses"]["200"]["content"]
    assert archive == {"application/x-tar": binary}


def test_openapi_file_refusals_carry_the_refusal_schema(document: dict[str, Any]) -> None:
    refused = document["components"]["schemas"]["RefusedProblem"]["properties"]
    assert {"$ref": "#/components/schemas/Refusal"} in refused["refusal"]["anyOf"]


def test_openapi_new_lease_links_to_its_next_steps(document: dict[str, Any]) -> None:
    links = operations(document)[("post", "/v1/leases")]["responses"]["201"]["links"]
    assert set(links) == {"getLease", "renewLease", "releaseLease"}
    for link in links.values():
        assert link["parameters"] == {"lease_id": "$response.body#/lease_id"}


def test_openapi_new_turn_links_to_its_next_steps(document: dict[str, Any]) -> None:
    links = operations(document)[("post", "/v1/turns")]["responses"]["201"]["links"]
    ids = {op["operationId"] for op in operations(document).values()}
    assert set(links) == {"getTurn", "turnEvents", "signalTurn", "writeStdin", "resizeTurn"}
    for link in links.values():
        assert link["operationId"] in ids
        assert link["parameters"] == {"turn_id": "$response.body#/turn_id"}


def test_openapi_new_session_links_to_its_next_steps(document: dict[str, Any]) -> None:
    links = operations(document)[("post", "/v1/sessions")]["responses"]["201"]["links"]
    assert set(links) == {"getSession", "endSession"}
    for link in links.values():
        assert link["parameters"] == {"session_id": "$response.body#/session_id"}


SCRIPT = "echo hi\n"
DIGEST = hashlib.sha256(SCRIPT.encode()).hexdigest()
SESSION = "s-" + "0" * 32
REQUESTS = [
    {"role": "b", "argv": ["make", "test"]},
    {"role": "b", "argv": ["make", ""]},
    {"role": "b", "argv": ["make"], "script": None, "script_sha256": None},
    {"role": "b", "script": SCRIPT, "script_sha256": DIGEST},
    {"role": "b", "script": SCRIPT, "script_sha256": DIGEST, "argv": None},
    {"role": "b"},
    {"role": "b", "argv": None},
    {"role": "b", "argv": []},
    {"role": "b", "argv": [""]},
    {"role": "b", "argv": ["a\0b"]},
    {"role": "b", "argv": ["make"], "script": SCRIPT, "script_sha256": DIGEST},
    {"role": "b", "script": SCRIPT},
    {"role": "b", "script": SCRIPT, "script_sha256": "ABC"},
    {"role": "b", "argv": ["make"], "script_sha256": DIGEST},
    {"role": "b", "argv": ["make"], "cwd": "relative"},
    {"role": "b", "argv": ["make"], "cwd": "/srv/work"},
    {"role": "b", "argv": ["make"], "secrets": ["/run/key:/key"]},
    {"role": "b", "argv": ["make"], "secrets": ["/run/key"]},
    {"role": "b", "argv": ["make"], "secrets": ["/run/key:key"]},
    {"role": "b", "argv": ["make"], "secrets": ["run/key"]},
    {"role": "b", "argv": ["make"], "fs": {"read": ["/data"], "write": ["out"]}},
    {"role": "b", "argv": ["make"], "unknown": 1},
    {"role": "b", "argv": ["make"], "session": SESSION},
    {"role": "b", "argv": ["make"], "session": "s-1"},
    {"role": "b", "argv": ["make"], "session": SESSION, "cwd": "/srv"},
    {"role": "b", "argv": ["make"], "session": SESSION, "cwd": None, "env": {}},
    {"role": "b", "argv": ["make"], "session": SESSION, "env": {"A": "1"}},
    {"role": "b", "argv": ["make"], "session": SESSION, "fs": {"read": [], "write": []}},
    {"role": "b", "argv": ["make"], "session": SESSION, "fs": {"write": ["/srv"]}},
    {"role": "b", "argv": ["make"], "session": SESSION, "secrets": ["/k"]},
    {"role": "b", "argv": ["make"], "session": SESSION, "network": "none"},
    {"role": "b", "argv": ["make"], "session": SESSION, "network": "host"},
    {"role": "b", "argv": ["make"], "session": SESSION, "limits": {"wall_s": 3, "output_mb": 1}},
    {"role": "b", "argv": ["make"], "session": SESSION, "limits": {"memory_mb": 3}},
    {"role": "b", "argv": ["make"], "session": SESSION, "limits": {"pids": None}},
    {"role": "b", "argv": ["make"], "session": None, "limits": {"pids": 3}},
    {"role": "b", "argv": ["make"], "tty": {"rows": 24, "cols": 80}},
    {"role": "b", "argv": ["make"], "tty": {"rows": 0, "cols": 80}},
    {"role": "b", "argv": ["make"], "tty": {"rows": 24, "cols": 80, "term": "xterm-256color"}},
    {"role": "b", "argv": ["make"], "tty": {"rows": 24, "cols": 80, "term": "a b"}},
]


@pytest.mark.parametrize("body", REQUESTS, ids=lambda b: re.sub(r"\W+", "-", str(b))[:60])
def test_openapi_turn_request_schema_decides_as_the_model(
    document: dict[str, Any], body: dict[str, Any]
) -> None:
    """The schema accepts exactly what the target accepts: argv or script, and the rest."""
    schema = {"$ref": "#/components/schemas/TurnRequest", "components": document["components"]}
    validator = jsonschema_rs.Draft202012Validator(schema)
    try:
        TurnRequest.model_validate(body)
        taken = True
    except ValueError:
        taken = False
    assert validator.is_valid(body) == taken


def test_openapi_turn_request_states_one_program(document: dict[str, Any]) -> None:
    rule = document["components"]["schemas"]["TurnRequest"]["oneOf"]
    assert [branch["required"] for branch in rule] == [["argv"], ["script", "script_sha256"]]


def test_undeclared_method_is_405_with_allow(client: httpx.Client) -> None:
    health = client.request("TRACE", "/v1/health")
    assert health.status_code == 405
    assert health.headers["content-type"] == "application/problem+json"
    assert health.headers["allow"] == "GET"
    # Two routes share /v1/turns: Allow names the methods of both.
    turns = client.request("DELETE", "/v1/turns")
    assert turns.status_code == 405
    assert turns.headers["allow"] == "GET, POST"


def test_docs_page_loads_nothing_from_elsewhere(target: Target) -> None:
    with target.client(token=None) as anonymous:
        page = anonymous.get("/docs")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "/openapi.json" in page.text
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
        assert assets, page.text
        for asset in assets:
            assert not re.match(r"(https?:)?//", asset), f"{asset}: loaded from elsewhere"
            fetched = anonymous.get(asset)
            assert fetched.status_code == 200, asset
            assert len(fetched.content) > 0
