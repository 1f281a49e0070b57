"""The HTTP surface: authentication, and bad input answered by problem+json, launching nothing."""

from __future__ import annotations

import httpx
import pytest
from conftest import OTHER_TOKEN, Target


def _launched_nothing(target: Target, before: set[str]) -> None:
    scratch = target.settings.state_root / "scratch"
    assert set(p.name for p in scratch.glob("*")) <= before


def _scratch_names(target: Target) -> set[str]:
    return {p.name for p in (target.settings.state_root / "scratch").glob("*")}


def _problem(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == status
    assert "Traceback" not in response.text
    return body


def test_health_needs_no_token(target: Target) -> None:
    with target.client(token=None) as c:
        body = c.get("/v1/health").json()
    assert body["status"] in {"armed", "degraded"}
    assert body["backend"] == "bubblewrap"
    assert not any(c["cause"] == "backend" for c in body["causes"])


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
def test_turns_without_a_valid_token_are_401(target: Target, token: str | None) -> None:
    with target.client(token=token) as c:
        response = c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
    _problem(response, 401)
    assert response.headers["www-authenticate"] == "Bearer"


def test_turn_for_role_the_token_does_not_hold_is_403(target: Target) -> None:
    with target.client(token=OTHER_TOKEN) as c:
        response = c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
    body = _problem(response, 403)
    assert "builder" in str(body["detail"])


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_roles_without_a_valid_token_are_401(target: Target, token: str | None) -> None:
    with target.client(token=token) as c:
        _problem(c.get("/v1/roles"), 401)


def test_roles_lists_only_what_the_token_holds(target: Target, client: httpx.Client) -> None:
    assert client.get("/v1/roles").json() == {"roles": ["builder"]}
    with target.client(token=OTHER_TOKEN) as c:
        assert c.get("/v1/roles").json() == {"roles": ["other"]}


def test_turn_of_another_role_is_not_visible(target: Target, client: httpx.Client) -> None:
    turn_id = client.post("/v1/turns", json={"role": "builder", "argv": ["true"]}).json()["turn_id"]
    with target.client(token=OTHER_TOKEN) as c:
        _problem(c.get(f"/v1/turns/{turn_id}"), 404)
        _problem(c.get(f"/v1/turns/{turn_id}/events"), 404)


def test_malformed_json_is_400(target: Target, client: httpx.Client) -> None:
    before = _scratch_names(target)
    response = client.post(
        "/v1/turns",
        content=b'{"role": "builder", "argv": [',
        headers={"content-type": "application/json"},
    )
    _problem(response, 400)
    _launched_nothing(target, before)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_turn_not_sent_as_json_is_422_naming_the_content_type(
    target: Target, client: httpx.Client, content_type: str | None
) -> None:
    before = _scratch_names(target)
    headers = {} if content_type is None else {"content-type": content_type}
    body = b'{"role": "builder", "argv": ["true"]}'
    problem = _problem(client.post("/v1/turns", content=body, headers=headers), 422)
    assert "application/json" in str(problem["detail"]), problem
    _launched_nothing(target, before)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"role": "builder", "argv": ["true"], "surprise": 1}, "surprise"),
        ({"role": "builder", "argv": ["true"], "cwd": "relative/dir"}, "cwd"),
        ({"role": "builder", "argv": ["true"], "fs": {"read": ["etc/passwd"]}}, "fs.read.0"),
        ({"role": "builder", "argv": []}, "argv"),
        ({"role": "builder"}, "body"),
        ({"role": "builder", "argv": ["true"], "limits": {"wall_s": -1}}, "limits.wall_s"),
        ({"role": "builder", "argv": ["true"], "network": "lan"}, "network"),
    ],
)
def test_bad_request_is_422_naming_the_field(
    target: Target, client: httpx.Client, body: dict[str, object], field: str
) -> None:
    before = _scratch_names(target)
    problem = _problem(client.post("/v1/turns", json=body), 422)
    assert field in [e["field"] for e in problem["errors"]]  # type: ignore[union-attr]
    _launched_nothing(target, before)


def test_unknown_turn_is_404(client: httpx.Client) -> None:
    _problem(client.get("/v1/turns/t-" + "0" * 32), 404)
    _problem(client.get("/v1/turns/not-a-turn-id"), 404)
    _problem(client.post("/v1/turns/t-" + "0" * 32 + "/signal", json={"signal": "INT"}), 404)


def test_body_over_one_mib_is_413_and_server_keeps_serving(
    target: Target, client: httpx.Client
) -> None:
    before = _scratch_names(target)
    huge = {"role": "builder", "argv": ["echo", "x" * (1 << 20)]}
    _problem(client.post("/v1/turns", json=huge), 413)

    def chunks():
        yield b'{"role": "builder", "argv": ["echo", "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"]}'

    # Streamed without a Content-Length: the limit is enforced while reading.
    _problem(
        client.post("/v1/turns", content=chunks(), headers={"content-type": "application/json"}),
        413,
    )
    _launched_nothing(target, before)
    assert client.get("/v1/health").status_code == 200
    assert client.post("/v1/turns", json={"role": "builder", "argv": ["true"]}).status_code == 201


def test_signal_to_an_ended_turn_is_409(client: httpx.Client) -> None:
    from conftest import finished

    turn_id = client.post("/v1/turns", json={"role": "builder", "argv": ["true"]}).json()["turn_id"]
    finished(client, turn_id)
    _problem(client.post(f"/v1/turns/{turn_id}/signal", json={"signal": "INT"}), 409)


def test_unknown_signal_is_422(client: httpx.Client) -> None:
    turn_id = client.post("/v1/turns", json={"role": "builder", "argv": ["true"]}).json()["turn_id"]
    _problem(client.post(f"/v1/turns/{turn_id}/signal", json={"signal": "STOP"}), 422)
