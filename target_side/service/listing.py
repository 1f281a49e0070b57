"""The turn listing: the newest turns of some roles, read from the ledger's end.

The ledger keeps every turn of the target's life, so the listing reads it
back only as far as it must (docs/api.md, ``GET /v1/turns``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from shared.wire import Turn

LISTING_SLACK = timedelta(minutes=10)
"""How much earlier than the listing's oldest turn was created its reading of the ledger goes
on (``newest_turns``)."""


def newest_turns(
    records: Iterable[dict[str, Any]], roles: frozenset[str], limit: int
) -> list[Turn]:
    """The newest ``limit`` turns of ``roles`` (by creation) in ``records``, ledger records
    newest first, each as its latest record says.

    Read back only as far as it must, since the ledger keeps every turn of the
    target's life (a whole read took 7 s of a thread holding the interpreter
    lock at 100,000 turns): once ``limit`` are found, until a record's latest
    moment is ``LISTING_SLACK`` before the creation of the last of them. A
    record reaches the ledger after its turn's moments, and records are
    appended in order, so any turn not seen by then was created earlier; the
    slack covers the time between a turn's moment and its record's append.
    """
    found: dict[str, Turn] = {}
    seen: set[str] = set()
    created: list[datetime] = []  # a heap: when the newest ``limit`` found were created
    for entry in records:
        turn = entry.get("turn")
        if not isinstance(turn, dict):
            continue  # a recovery, lease, session or file-operation record
        if len(created) == limit and _latest_moment(turn) < created[0] - LISTING_SLACK:
            break
        turn_id = str(turn.get("turn_id"))
        if turn_id in seen:
            continue  # an earlier state of a turn already found
        seen.add(turn_id)
        if turn.get("role") not in roles:
            continue
        parsed = Turn.model_validate(turn)
        found[parsed.turn_id] = parsed
        if len(created) < limit:
            heapq.heappush(created, parsed.created_at)
        else:
            heapq.heappushpop(created, parsed.created_at)
    return sorted(found.values(), key=lambda t: t.created_at, reverse=True)[:limit]


def _latest_moment(turn: dict[str, Any]) -> datetime:
    """The latest of a recorded turn's moments: its record was appended after it."""
    moments = (turn.get(name) for name in ("ended_at", "started_at", "created_at"))
    found = [datetime.fromisoformat(moment) for moment in moments if isinstance(moment, str)]
    return max(found, default=datetime.max.replace(tzinfo=UTC))  # none: never a reason to stop
