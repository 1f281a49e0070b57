"""New turns are made and planned on threads of their own, a few at a time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import trustme
from conftest import make_settings
from test_durability import served

from shared.walk import canonical_path
from shared.wire import TurnRequest
from target_side.policy.plan import FencePlan
from target_side.service.app import create_app
from target_side.service.turns import PLANNING_THREADS, TurnManager


async def test_a_burst_of_turns_is_planned_a_few_at_a_time_on_threads_of_its_own(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All at once on the blocking pool, a burst's plans shared the interpreter lock 64 ways and
    every turn launched late; and a pool full of slow blocking steps held up every new turn."""
    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca))
    changed = threading.Condition()
    planning = 0
    most = 0
    threads: set[str] = set()
    real_plan = TurnManager.plan

    def plan(manager: TurnManager, request: TurnRequest, turn_id: str) -> FencePlan:
        nonlocal planning, most
        with changed:
            planning += 1
            most = max(most, planning)
            threads.add(threading.current_thread().name)
            changed.notify_all()
            # Held until as many plans run as the pool allows (a timed pause let a loaded
            # machine start the last one after the first had ended), or the burst's tail.
            changed.wait_for(lambda: planning >= PLANNING_THREADS, timeout=2)
        try:
            return real_plan(manager, request, turn_id)
        finally:
            with changed:
                planning -= 1

    monkeypatch.setattr(TurnManager, "plan", plan)
    async with served(app) as client:
        answers = await asyncio.gather(
            *(
                client.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
                for _ in range(3 * PLANNING_THREADS)
            )
        )
    assert [a.status_code for a in answers] == [201] * (3 * PLANNING_THREADS)
    assert most == PLANNING_THREADS
    assert all(name.startswith("paddock-plan") for name in threads), threads
