"""The API client (agent_side.client) against a scripted server and against real listeners.

The scripted server (tests/scripted_server.py) writes each answer the test
names: wrong statuses, bodies and streams, dropped connections. The scheme
tests talk to real paddock targets, one over TLS and one over plain HTTP.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import BUILDER_TOKEN, Target, make_settings
from scripted_server import (
    ERR_B64,
    EXIT,
    OUT,
    STARTED,
    TOKEN,
    TURN_ID,
    Handler,
    Scripted,
    Seen,
    client_for,
    closed_port,
    frame,
    problem,
    reply,
    reply_events,
    reply_json,
    script_turn,
    scripted_stream,
    turn_json,
)

from agent_side.client import URLS_KEPT, TargetClient
from agent_side.errors import (
    AuthRejected,
    ConnectionDropped,
    ProtocolError,
    RequestRejected,
    TargetUnreachable,
    TlsFailure,
    TurnLost,
    UnknownTurn,
    UsageError,
    WrongScheme,
)
from shared.walk import canonical_path
from shared.wire import TurnRequest
from target_side.service.server import ServerThread

# -- settings the client refuses ----------------------------------------------------------


def test_client_refuses_plain_http_to_a_remote_host() -> None:
    with pytest.raises(UsageError, match="refusing to send the token over plain HTTP"):
        TargetClient("http://target.example:8443", TOKEN)


def test_client_refuses_a_token_with_whitespace() -> None:
    with pytest.raises(UsageError, match="token"):
        TargetClient("https://t:1", "two words")


def test_client_refuses_an_unreadable_cacert(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot load CA certificate"):
        TargetClient("https://t:1", TOKEN, cacert=str(tmp_path / "missing.pem"))


def test_client_refuses_use_after_close(scripted: Scripted) -> None:
    client = client_for(scripted)
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.health()
    with pytest.raises(RuntimeError, match="closed"), client:
        pass


@pytest.mark.parametrize("base", ["http://127.0.0.1:9", "http://127.0.0.1:9/under/a/prefix/"])
def test_the_client_asks_for_the_urls_httpx_would_have_made(base: str) -> None:
    """Paths are parsed once and kept: each must be the URL httpx's own merge gives."""
    paths = ["/v1/turns", "/v1/health", "/v1/turns/t-1/events", "/v1/files", "/v1/a%20b/ü"]
    with TargetClient(base, None) as client:
        for _ in range(2):  # made, then kept
            for path in paths:
                merged = client._http.build_request("GET", path).url
                assert client._absolute(path) == merged, path
        for n in range(URLS_KEPT + 10):  # a turn's own paths come and go; the cache stays small
            client._absolute(f"/v1/turns/t-{n}")
        assert client._absolute.cache_info().currsize == URLS_KEPT


def test_client_refuses_a_turn_id_that_would_steer_the_path() -> None:
    with TargetClient("https://t:1", TOKEN) as client, pytest.raises(UsageError):
        client.turn("../health")


# -- connecting ---------------------------------------------------------------------------


def test_client_raises_target_unreachable_for_a_closed_port() -> None:
    client = TargetClient(f"http://127.0.0.1:{closed_port()}", TOKEN)
    with client, pytest.raises(TargetUnreachable) as caught:
        client.health()
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


def test_client_without_cacert_does_not_trust_a_private_ca(tls_scripted: Scripted) -> None:
    with TargetClient(tls_scripted.url, TOKEN) as client, pytest.raises(TlsFailure):
        client.health()


def test_client_with_the_right_cacert_reads_health(
    tls_scripted: Scripted, scripted_ca: trustme.CA, tmp_path: Path
) -> None:
    ca_file = tmp_path / "ca.pem"
    scripted_ca.cert_pem.write_to_path(str(ca_file))
    body = {"status": "degraded", "causes": [], "version": "0.1.0", "backend": "none"}
    tls_scripted.routes["GET", "/v1/health"] = lambda h, s: reply_json(h, 200, body)
    with TargetClient(tls_scripted.url, TOKEN, cacert=str(ca_file)) as client:
        assert client.health().status == "degraded"
    assert "authorization" not in {k.lower() for k in tls_scripted.seen[0].headers}


# -- the wrong scheme, against real listeners ---------------------------------------------


@pytest.fixture(scope="module")
def plain_target(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[str]:
    """A real target serving plain HTTP on 127.0.0.1 (as one behind SSH does); its URL."""
    root = Path(canonical_path(tmp_path_factory.mktemp("plain-target")))
    settings = make_settings(root, ca)
    plain = settings.server.model_copy(update={"tls_cert": None, "tls_key": None})
    with ServerThread(settings.model_copy(update={"server": plain})) as server:
        yield server.url


def test_http_url_for_an_https_listener_is_named_at_once(target: Target) -> None:
    pauses: list[float] = []
    plain_url = target.url.replace("https://", "http://")
    client = TargetClient(plain_url, BUILDER_TOKEN, sleep=pauses.append)
    request = TurnRequest(role="builder", argv=["true"])
    with client, pytest.raises(WrongScheme) as caught:
        client.submit(request, idempotency_key="key-1")
    where = plain_url.removeprefix("http://")
    assert f"{where} speaks HTTPS, not plain HTTP: give https://{where}" in str(caught.value)
    assert pauses == []  # not one retry of a request that can never work


def test_https_url_for_a_plain_listener_is_named_at_once(plain_target: str, target: Target) -> None:
    tls_url = plain_target.replace("http://", "https://")
    with (
        TargetClient(tls_url, BUILDER_TOKEN, cacert=target.cacert) as client,
        pytest.raises(WrongScheme) as caught,
    ):
        client.health()
    where = plain_target.removeprefix("http://")
    assert f"{where} speaks plain HTTP, not HTTPS: give http://{where}" in str(caught.value)
    assert "--cacert" not in str(caught.value)


def test_right_schemes_are_not_probed_and_work(plain_target: str, target: Target) -> None:
    with TargetClient(plain_target, BUILDER_TOKEN) as plain:
        assert plain.roles() == ["builder"]
    with TargetClient(target.url, BUILDER_TOKEN, cacert=target.cacert) as tls:
        assert tls.roles() == ["builder"]


def test_a_dropped_plain_connection_is_still_a_drop(scripted: Scripted) -> None:
    def hang_up(handler: Handler, seen: Seen) -> None:
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)

    scripted.routes["GET", "/v1/health"] = hang_up
    with client_for(scripted) as client, pytest.raises(ConnectionDropped):
        client.health()


# -- answers the client refuses -----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected", "says"),
    [
        (401, AuthRejected, "rejected the token (401: bad token); check --token-file"),
        (403, AuthRejected, "does not hold that role (403: bad token); check --role"),
        (404, UnknownTurn, f"does not know turn {TURN_ID} (404: bad token)"),
        (500, ProtocolError, "failed with 500: bad token"),
    ],
)
def test_client_maps_problem_statuses(
    scripted: Scripted, status: int, expected: type, says: str
) -> None:
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = problem(status, "bad token")
    with client_for(scripted) as client, pytest.raises(expected, match=re.escape(says)):
        client.turn(TURN_ID)


def test_client_names_the_fields_of_a_rejected_request(scripted: Scripted) -> None:
    errors = [{"field": "body.argv", "message": "argv is empty"}]
    scripted.routes["POST", "/v1/turns"] = problem(422, "the request is invalid", errors)
    request = TurnRequest(role="default", argv=["true"])
    with client_for(scripted) as client, pytest.raises(RequestRejected) as caught:
        client.submit(request)
    assert "the request is invalid; body.argv: argv is empty" in str(caught.value)


def test_client_rejects_a_body_that_is_not_the_model(scripted: Scripted) -> None:
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(h, 200, {"x": 1})
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="not a valid Turn"):
        client.turn(TURN_ID)


def test_client_rejects_an_unexpected_success_status(scripted: Scripted) -> None:
    scripted.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 202, turn_json())
    request = TurnRequest(role="default", argv=["true"])
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="expected 201 or 200"):
        client.submit(request)


def test_client_rejects_events_that_are_not_an_event_stream(scripted: Scripted) -> None:
    path = f"/v1/turns/{TURN_ID}/events"
    scripted.routes["GET", path] = lambda h, s: reply_json(h, 200, [])
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="application/json"):
        list(client.events(TURN_ID))


def test_client_rejects_a_frame_whose_id_disagrees_with_its_seq(scripted: Scripted) -> None:
    bad = frame({"seq": 2, "kind": "started"}).replace(b"id: 2", b"id: 9")
    scripted.routes["GET", f"/v1/turns/{TURN_ID}/events"] = lambda h, s: reply_events(h, bad)
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="disagrees"):
        list(client.events(TURN_ID))


# -- roles ----------------------------------------------------------------------------------


def test_client_roles_sends_the_token(scripted: Scripted) -> None:
    scripted.routes["GET", "/v1/roles"] = lambda h, s: reply_json(h, 200, {"roles": ["a", "b"]})
    with client_for(scripted) as client:
        assert client.roles() == ["a", "b"]
    assert scripted.seen[0].headers["Authorization"] == f"Bearer {TOKEN}"


def test_client_sends_back_no_cookie_a_target_set(scripted: Scripted) -> None:
    # The token is the only credential: whatever answered (a target, or something in the
    # way) gets no state of its own carried into the client's next requests.
    def setting_a_cookie(handler: Handler, _seen: Seen) -> None:
        body = json.dumps({"roles": ["a"]}).encode()
        handler.send_response(200)
        handler.send_header("Set-Cookie", "planted=1; Path=/")
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    scripted.routes["GET", "/v1/roles"] = setting_a_cookie
    with client_for(scripted) as client:
        client.roles()
        client.roles()
    assert [s.headers.get("Cookie") for s in scripted.seen] == [None, None]


def test_client_roles_of_a_target_without_the_route_says_to_name_one(scripted: Scripted) -> None:
    scripted.routes["GET", "/v1/roles"] = problem(404, "Not Found")
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="--role R"):
        client.roles()


# -- following a turn through dropped connections ----------------------------------------


def after_values(script: Scripted) -> list[str]:
    return [s.query for s in script.paths("GET", f"/v1/turns/{TURN_ID}/events")]


def test_follow_resumes_after_a_dropped_connection_exactly_once(scripted: Scripted) -> None:
    scripted_stream(
        scripted,
        (b": ping\n\n" + frame(STARTED) + frame(OUT), True),
        (frame(ERR_B64) + frame(EXIT), False),
    )
    with client_for(scripted) as client:
        events = list(client.follow(TURN_ID))
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert after_values(scripted) == ["after=0", "after=2"]
    headers = scripted.seen[0].headers
    assert headers["Authorization"] == f"Bearer {TOKEN}"


def test_follow_drops_events_a_target_repeats(scripted: Scripted) -> None:
    scripted_stream(
        scripted,
        (frame(STARTED) + frame(OUT), True),
        (frame(OUT) + frame(ERR_B64) + frame(EXIT), False),
    )
    with client_for(scripted) as client:
        assert [e.seq for e in client.follow(TURN_ID)] == [1, 2, 3, 4]


def test_follow_gives_up_after_its_budget(scripted: Scripted) -> None:
    scripted_stream(scripted, (b": ping\n\n", True))
    with client_for(scripted) as client, pytest.raises(ConnectionDropped, match="gave up"):
        list(client.follow(TURN_ID, after=7))
    attempts = after_values(scripted)
    assert 2 <= len(attempts) <= 12
    assert set(attempts) == {"after=7"}


def test_follow_reports_a_turn_the_target_marked_lost(scripted: Scripted) -> None:
    scripted_stream(scripted, (frame(STARTED), False))
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(
        h, 200, turn_json(state="lost")
    )
    with client_for(scripted) as client, pytest.raises(TurnLost, match="marked turn"):
        list(client.follow(TURN_ID))


def test_follow_ends_for_a_finished_turn_with_no_terminal_event(scripted: Scripted) -> None:
    scripted_stream(scripted, (frame(STARTED), False), (b"", False))
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(
        h, 200, turn_json(state="exited", exit_code=0)
    )
    with client_for(scripted) as client:
        assert [e.seq for e in client.follow(TURN_ID)] == [1]


def _submissions_broken_once(scripted: Scripted, first: Callable[[Handler], None]) -> list[str]:
    """The first submission's answer broken by ``first``, later ones answered with the turn;
    returns the Idempotency-Key of each submission, as it comes."""
    keys: list[str] = []

    def route(handler: Handler, seen: Seen) -> None:
        keys.append(seen.headers["Idempotency-Key"])
        if len(keys) > 1:
            reply_json(handler, 201, turn_json())
            return
        first(handler)
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)

    scripted.routes["POST", "/v1/turns"] = route
    return keys


def _nothing(handler: Handler) -> None:
    """No answer at all: the connection is closed on the request."""


def _half_a_turn(handler: Handler) -> None:
    """The turn's headers, and ten bytes of a body that promised more."""
    body = turn_json().encode()
    handler.send_response(201)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body[:10])
    handler.wfile.flush()


def test_submit_with_a_key_is_retried_after_a_dropped_exchange(scripted: Scripted) -> None:
    calls = _submissions_broken_once(scripted, _nothing)
    request = TurnRequest(role="default", argv=["true"])
    with client_for(scripted) as client:
        assert client.submit(request, idempotency_key="key-1").turn_id == TURN_ID
    assert calls == ["key-1", "key-1"]
    assert json.loads(scripted.paths("POST", "/v1/turns")[1].body)["argv"] == ["true"]


def test_a_target_answering_a_submission_with_the_turn_alone_is_followed_after_it(
    scripted: Scripted,
) -> None:
    """A target from before streamed submissions: submit, then follow, as before."""
    exited = {**EXIT, "seq": 2}
    script_turn(scripted, frame(STARTED) + frame(exited), turn_json(state="exited", exit_code=3))
    seen: list[str] = []
    with client_for(scripted) as client:
        request = TurnRequest(role="default", argv=["true"])
        events = list(client.submit_and_follow(request, "key-2", seen.append))
    assert [e.kind for e in events] == ["started", "exit"] and seen == [TURN_ID]
    (post,) = scripted.paths("POST", "/v1/turns")
    assert post.headers["Accept"].startswith("application/x-paddock-frames")
    assert post.headers["Idempotency-Key"] == "key-2"
    assert len(scripted.paths("GET", f"/v1/turns/{TURN_ID}/events")) == 1


def test_a_streamed_submission_must_say_where_its_turn_is(scripted: Scripted) -> None:
    def route(handler: Handler, seen: Seen) -> None:
        reply(handler, 201, b"", "application/x-paddock-frames")

    scripted.routes["POST", "/v1/turns"] = route
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="Location ''"):
        list(client.submit_and_follow(TurnRequest(role="default", argv=["true"]), "k", print))


def test_a_streamed_submission_is_retried_with_its_key_after_a_dropped_exchange(
    scripted: Scripted,
) -> None:
    """The answer lost before its headers: asked again with the same key, so no second turn."""
    keys = _submissions_broken_once(scripted, _nothing)
    scripted_stream(scripted, (frame(STARTED) + frame({**EXIT, "seq": 2}), False))
    with client_for(scripted) as client:
        request = TurnRequest(role="default", argv=["true"])
        events = list(client.submit_and_follow(request, "key-3", lambda turn_id: None))
    assert [e.seq for e in events] == [1, 2]
    assert keys == ["key-3", "key-3"]


def test_a_turn_answered_alone_and_cut_short_is_asked_for_again(scripted: Scripted) -> None:
    """A target from before streamed submissions, its answer broken mid-body: the turn's
    id never arrived, so the submission is retried with its key rather than followed."""
    keys = _submissions_broken_once(scripted, _half_a_turn)
    scripted_stream(scripted, (frame(STARTED) + frame({**EXIT, "seq": 2}), False))
    with client_for(scripted) as client:
        request = TurnRequest(role="default", argv=["true"])
        events = list(client.submit_and_follow(request, "key-4", lambda turn_id: None))
    assert [e.seq for e in events] == [1, 2] and keys == ["key-4", "key-4"]
