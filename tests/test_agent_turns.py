"""What the CLI and the Python API share about one turn (agent_side.turns).

(tests/test_turns.py is the target side's turn lifecycle.)
"""

from __future__ import annotations

import pytest
from scripted_server import NOW, Scripted, client_for, reply_json, turn_json

from agent_side.errors import ProtocolError, TurnLost, UsageError
from agent_side.turns import exit_status, new_request, sole_role
from shared.wire import ExitEvent, Turn


def _turn(**fields: object) -> Turn:
    return Turn.model_validate_json(turn_json(**fields))


def test_exit_status_prefers_the_terminal_event() -> None:
    event = ExitEvent(seq=3, at=NOW, exit_code=137, signal=9)
    assert exit_status(_turn(state="running"), event) == 137
    assert exit_status(_turn(state="exited", exit_code=124), None) == 124


def test_exit_status_of_a_lost_or_statusless_turn_is_a_paddock_failure() -> None:
    with pytest.raises(TurnLost):
        exit_status(_turn(state="lost"), None)
    with pytest.raises(ProtocolError, match="without an exit status"):
        exit_status(_turn(state="exited"), None)
    with pytest.raises(ProtocolError, match=r"not 0\.\.255"):
        exit_status(_turn(state="exited", exit_code=300), None)


def test_new_request_names_the_invalid_field() -> None:
    with pytest.raises(UsageError, match="argv"):
        new_request(role="default", argv=["nul\0byte"])


def test_sole_role_is_the_only_role_the_token_holds(scripted: Scripted) -> None:
    scripted.routes["GET", "/v1/roles"] = lambda h, s: reply_json(h, 200, {"roles": ["builder"]})
    with client_for(scripted) as client:
        assert sole_role(client) == "builder"


def test_sole_role_of_a_token_with_several_names_them(scripted: Scripted) -> None:
    roles = {"roles": ["builder", "tester"]}
    scripted.routes["GET", "/v1/roles"] = lambda h, s: reply_json(h, 200, roles)
    with client_for(scripted) as client, pytest.raises(UsageError) as caught:
        sole_role(client)
    assert "the token holds 2 roles (builder, tester)" in str(caught.value)
    assert "--role R" in str(caught.value)
