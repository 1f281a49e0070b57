"""SIGTERM: no new turn, running turns end (or are killed after the grace time) and are recorded,
every stream gets its final event, and only then is the state root free for the next server."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import output, wait_until
from process_support import TargetProcess, follow_into, wait_for_exit, write_config

from shared.walk import canonical_path
from shared.wire import Event
from target_side.service import ledger

GRACE_S = 3.0


def test_sigterm_lets_turns_end_then_records_every_one_and_frees_the_root(
    tmp_path: Path,
) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"stop_grace_s": GRACE_S})
    target = TargetProcess.start(config, url, root / "target.log")
    quick_seen: list[Event] = []
    slow_seen: list[Event] = []
    try:
        with target.client() as c, target.client() as quick_c, target.client() as slow_c:
            quick = c.post(
                "/v1/turns", json={"role": "builder", "argv": ["sh", "-c", "sleep 1; echo made it"]}
            ).json()
            slow = c.post("/v1/turns", json={"role": "builder", "argv": ["sleep", "60"]}).json()
            followers = [
                follow_into(quick_c, quick["turn_id"], quick_seen),
                follow_into(slow_c, slow["turn_id"], slow_seen),
            ]
            assert wait_until(lambda: bool(quick_seen) and bool(slow_seen))
            target.proc.terminate()
            # Stopping: a new turn is refused on a connection already open...
            assert wait_until(lambda: "stopping:" in target.log.read_text(), timeout=GRACE_S)
            refused = c.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            assert refused.status_code == 503
            assert refused.json()["reason"] == "stopping"
            # ...and the state root is still held: a second server cannot take it yet.
            second = TargetProcess.start(config, url, root / "second.log", wait=False)
            assert wait_for_exit(second.proc, timeout=30) not in (None, 0)
            for follower in followers:
                follower.join(timeout=GRACE_S + 20)
        assert wait_for_exit(target.proc, timeout=30) is not None
    finally:
        target.kill()
    # The quick turn finished on its own; the slow one was killed after the grace time, said so.
    assert output(quick_seen) == "made it\n"
    assert (quick_seen[-1].kind, quick_seen[-1].exit_code) == ("exit", 0)  # type: ignore[union-attr]
    notice, end = slow_seen[-2:]
    assert notice.kind == "notice" and f"stop_grace_s = {GRACE_S:g} s" in notice.message  # type: ignore[union-attr]
    assert (end.kind, end.exit_code) == ("exit", 125)  # type: ignore[union-attr]
    # Recorded, not lost: the next servers find both turns ended as their streams said,
    # and record nothing more about them.
    for _ in range(2):
        after = TargetProcess.start(config, url, root / "after.log")
        try:
            with after.client() as c:
                states = [c.get(f"/v1/turns/{t['turn_id']}").json() for t in (quick, slow)]
        finally:
            after.terminate()
        assert [(t["state"], t["exit_code"]) for t in states] == [("exited", 0), ("exited", 125)]
    ledger.verify(root / "state")
    lines = (root / "state" / ledger.LEDGER).read_text().splitlines()
    ends = [json.loads(line) for line in lines if '"kind":"end"' in line]
    assert sorted(e["turn"]["turn_id"] for e in ends) == sorted([quick["turn_id"], slow["turn_id"]])
