"""``target_side.tools.cli``, with each turn's steps stamped on one clock (for ``bench/stages.py``).

Run as ``python -m bench.stage_probe serve --config ...``. On SIGUSR2 the stamps
taken since the last signal are written to the file named by
``PADDOCK_STAGE_FILE`` (a temp file the bench chose), and forgotten: under
``turns``, one object a turn; under ``processes``, each bubblewrap's start
(``spawning``, ``spawned``: the call that starts it, and its return) and its
reaping (``reaped``), stamped on the thread that does them and named by no
turn (one at a time, the bench puts each in the turn it falls in). The probe
wraps the turn manager's own steps and ``subprocess.Popen``'s; it changes
nothing they do.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from types import FrameType
from typing import Any

from target_side.fence import limits
from target_side.service import turns

STAMPS: defaultdict[str, dict[str, float]] = defaultdict(dict)
PROCESSES: list[tuple[str, float]] = []
"""Steps of bubblewrap's processes, in the order they happened (list.append is atomic)."""
OUT_FILE = os.environ.get("PADDOCK_STAGE_FILE", "")


def _stamp(turn_id: str, step: str) -> None:
    STAMPS[turn_id].setdefault(step, time.monotonic())


TurnOf = Callable[[tuple[Any, ...]], str]
"""Where a wrapped step's turn id is, among its arguments (``self`` first)."""


def _record(args: tuple[Any, ...]) -> str:
    return str(args[1].turn.turn_id)


def _turn_id(args: tuple[Any, ...]) -> str:
    return str(args[1])


def _around(owner: Any, name: str, turn_of: TurnOf, before: str, after: str) -> None:
    real = getattr(owner, name)

    @functools.wraps(real)
    def sync(*args: Any, **kwargs: Any) -> Any:
        turn = turn_of(args)
        _stamp(turn, before)
        try:
            return real(*args, **kwargs)
        finally:
            _stamp(turn, after)

    @functools.wraps(real)
    async def asynchronous(*args: Any, **kwargs: Any) -> Any:
        turn = turn_of(args)
        _stamp(turn, before)
        try:
            return await real(*args, **kwargs)
        finally:
            _stamp(turn, after)

    wrapped: Callable[..., Any] = asynchronous if inspect.iscoroutinefunction(real) else sync
    setattr(owner, name, wrapped)


def _made(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def new_record(*args: Any, **kwargs: Any) -> Any:
        record = real(*args, **kwargs)
        _stamp(record.turn.turn_id, "made")
        return record

    return new_record


def _bubblewrap(args: Any) -> bool:
    argv = [args] if isinstance(args, (str, bytes)) else list(args)
    return any(os.path.basename(os.fsdecode(arg)) == "bwrap" for arg in argv[:2])


def _stamp_processes() -> None:
    """``spawning``/``spawned`` around ``Popen`` starting bubblewrap, ``reaped`` when its
    ``wait`` returns (the thread that started it waits for it)."""
    start = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    wait = subprocess.Popen.wait

    @functools.wraps(start)
    def execute_child(self: subprocess.Popen[bytes], args: Any, *rest: Any) -> Any:
        ours = _bubblewrap(args)
        if ours:
            PROCESSES.append(("spawning", time.monotonic()))
        try:
            return start(self, args, *rest)
        finally:
            if ours:
                PROCESSES.append(("spawned", time.monotonic()))
                self._paddock_bench_bwrap = True  # type: ignore[attr-defined]

    @functools.wraps(wait)
    def waited(self: subprocess.Popen[bytes], *args: Any, **kwargs: Any) -> int:
        code = wait(self, *args, **kwargs)
        if getattr(self, "_paddock_bench_bwrap", False):
            PROCESSES.append(("reaped", time.monotonic()))
        return code

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    subprocess.Popen.wait = waited  # type: ignore[method-assign,assignment]


def _dump(signum: int, frame: FrameType | None) -> None:
    done = {turn: steps for turn, steps in STAMPS.items() if "ended" in steps}
    # Renamed into place: the bench reads the file as soon as it is there.
    partial = f"{OUT_FILE}.part"
    with open(partial, "w") as out:
        json.dump({"turns": done, "processes": PROCESSES}, out)
    os.replace(partial, OUT_FILE)
    STAMPS.clear()
    PROCESSES.clear()


def main() -> None:
    manager = turns.TurnManager
    manager._new_record = _made(manager._new_record)  # type: ignore[method-assign]
    _around(manager, "_make_and_plan", _record, "planning", "planned")
    _around(limits.Limiter, "make_for_turn", _turn_id, "cgroups", "cgroups made")
    _around(manager, "_start_here", _record, "starting", "handed over")
    _around(manager, "_launch", _record, "launching", "launched")
    _around(manager, "_launched", _record, "started", "recorded")
    _around(manager, "_finish", _record, "ending", "ended")
    _stamp_processes()
    signal.signal(signal.SIGUSR2, _dump)
    sys.argv = ["target_side.tools.cli", *sys.argv[1:]]
    runpy.run_module("target_side.tools.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
