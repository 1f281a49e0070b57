"""A turn ends once its process was reaped, even while a process outside it holds its output
pipe open: nothing of the turn outlives its reaper, so such a holder is not the turn's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import IO

import pytest
import trustme
from conftest import make_settings
from test_durability import served

from shared.walk import canonical_path
from target_side.fence import runner
from target_side.service.app import create_app


def test_a_turn_ends_though_a_process_outside_it_holds_its_output_open(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "DRAIN_S", 0.5)
    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca))
    held: list[IO[bytes]] = []

    async def scenario() -> tuple[str, dict[str, object]]:
        async with served(app) as c:
            argv = ["sh", "-c", "echo before; sleep 1"]
            made = await c.post("/v1/turns", json={"role": "builder", "argv": argv})
            turn_id = made.json()["turn_id"]
            bwrap = app.state.manager.get(turn_id, frozenset({"builder"})).running._proc.pid
            # The turn's stdout, opened again through bubblewrap's descriptor 1: one more
            # writer the turn's end does not close.
            held.append(open(f"/proc/{bwrap}/fd/1", "wb"))  # noqa: SIM115 - closed below
            async with asyncio.timeout(30):
                stream = (await c.get(f"/v1/turns/{turn_id}/events")).text
            return stream, (await c.get(f"/v1/turns/{turn_id}")).json()

    try:
        stream, turn = asyncio.run(scenario())
    finally:
        for pipe in held:
            pipe.close()
    said = [json.loads(line[5:]) for line in stream.splitlines() if line[:5] == "data:"]
    assert (turn["state"], turn["exit_code"]) == ("exited", 0)
    assert "before" in "".join(e.get("data", "") for e in said if e["kind"] == "stdout")
    notices = [e["message"] for e in said if e["kind"] == "notice"]
    assert any("held by a process outside the turn" in n for n in notices), notices
