"""A turn's bubblewrap is started by the thread that planned it, not when the event loop gets to it.

The loop then follows the turn (its pipes, its launch line, its ``started``
event), and while other turns are still being planned that bookkeeping waits
for them, for a second at most. These tests hold the loop, or another turn's
planning, from the failure hook's seams (which run on the planning thread).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime
from pathlib import Path

import trustme
from conftest import make_settings
from test_durability import served

from shared.walk import canonical_path
from target_side.service.app import create_app
from target_side.service.turns import BOOKKEEPING_WAIT_S

PRINT_TIME = ["date", "+%s.%N"]


def test_a_turns_command_runs_while_the_event_loop_is_held(tmp_path: Path, ca: trustme.CA) -> None:
    loops: list[tuple[asyncio.AbstractEventLoop, int]] = []
    released: list[float] = []

    def hold_the_loop() -> None:
        time.sleep(1.0)
        released.append(time.time())

    def at(step: str) -> None:
        if step != "open-to-launch":
            return
        # The fence's paths are held: from here the loop is held for a second, whichever
        # thread got here (on the loop itself, bubblewrap would wait for it).
        loop, thread = loops[0]
        if threading.get_ident() == thread:
            hold_the_loop()
        else:
            loop.call_soon_threadsafe(hold_the_loop)

    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca), inject=at)

    async def scenario() -> tuple[str, int]:
        loops.append((asyncio.get_running_loop(), threading.get_ident()))
        async with served(app) as c:
            made = await c.post("/v1/turns", json={"role": "builder", "argv": PRINT_TIME})
            turn_id = made.json()["turn_id"]
            stream = (await c.get(f"/v1/turns/{turn_id}/events")).text
            turn = (await c.get(f"/v1/turns/{turn_id}")).json()
            return stream, turn["exit_code"]

    stream, exit_code = asyncio.run(scenario())
    said = [json.loads(line[5:]) for line in stream.splitlines() if line[:5] == "data:"]
    printed = float("".join(e.get("data", "") for e in said if e["kind"] == "stdout"))
    assert exit_code == 0
    # It ran while the loop slept: bubblewrap was not waiting for the loop to start it.
    assert printed < released[0]


def _two_turns(tmp_path: Path, ca: trustme.CA, held_s: float) -> float:
    """Seconds until the second turn's submission was answered, while the first one's
    planning was held for ``held_s``."""
    first_planning = threading.Event()
    go_on = threading.Event()
    calls = 0
    lock = threading.Lock()

    def at(step: str) -> None:
        nonlocal calls
        if step != "check-to-open":
            return
        with lock:
            calls += 1
            mine = calls
        if mine == 1:  # the first turn, planned, before its paths are held: held here
            first_planning.set()
            go_on.wait(held_s)

    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca), inject=at)

    async def scenario() -> float:
        async with served(app) as c:
            first = asyncio.create_task(
                c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            )
            await asyncio.to_thread(first_planning.wait, 10)
            began = time.monotonic()
            second = await c.post("/v1/turns", json={"role": "builder", "argv": PRINT_TIME})
            took = time.monotonic() - began
            go_on.set()
            assert (await first).status_code == 201
            assert second.status_code == 201
            started = datetime.fromisoformat(second.json()["started_at"]).timestamp()
            assert started < time.time() - took / 2  # it ran before it was answered
            return took

    return asyncio.run(scenario())


def test_a_started_turns_bookkeeping_waits_for_the_turns_being_planned(
    tmp_path: Path, ca: trustme.CA
) -> None:
    assert _two_turns(tmp_path, ca, held_s=0.6) >= 0.5


def test_it_waits_a_second_at_most(tmp_path: Path, ca: trustme.CA) -> None:
    took = _two_turns(tmp_path, ca, held_s=5.0)
    assert BOOKKEEPING_WAIT_S - 0.1 <= took < BOOKKEEPING_WAIT_S + 1.5


def test_a_failure_on_the_planning_thread_ends_the_turn_as_the_targets_own(
    tmp_path: Path, ca: trustme.CA
) -> None:
    failing = {"on": True}

    def at(step: str) -> None:
        if failing["on"] and step == "open-to-launch":
            raise RuntimeError("a fault of the target's own, not of the turn")

    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca), inject=at)

    async def scenario() -> tuple[int, dict[str, object], int]:
        async with served(app) as c:
            made = await c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            turn = (await c.get(f"/v1/turns/{made.json()['turn_id']}")).json()
            failing["on"] = False
            # Nothing is left counted against the caps: the next turn runs.
            after = await c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            return made.status_code, turn, after.status_code

    status, turn, after = asyncio.run(scenario())
    assert status == 201
    assert turn["state"] == "exited" and turn["exit_code"] == 125
    assert after == 201
    assert app.state.manager._running == 0
