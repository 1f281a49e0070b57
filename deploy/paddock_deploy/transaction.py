"""This run's changes, each with its undo, rolled back in reverse when anything fails."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class Undo:
    """One change of this run, and how to take it back."""

    what: str
    action: Callable[[], object]


class Transaction:
    """Undo actions in the order changes were made, rolled back in reverse on failure.

    ``after_failure`` actions run once every undo is done, also last first:
    putting the previous server back must wait until its release, config and
    service files are back, and the new release goes only once nothing runs it.
    """

    def __init__(self) -> None:
        self._undo: list[Undo] = []
        self._after: list[Undo] = []

    @property
    def changed(self) -> bool:
        return bool(self._undo or self._after)

    def on_failure(self, what: str, action: Callable[[], object]) -> None:
        self._undo.append(Undo(what, action))

    def after_failure(self, what: str, action: Callable[[], object]) -> None:
        self._after.append(Undo(what, action))

    def roll_back(self, report: Callable[[str], None]) -> list[str]:
        """Undo everything; every undo is tried, and the problems are returned."""
        problems = []
        for undo in [*reversed(self._undo), *reversed(self._after)]:
            try:
                undo.action()
                report(f"undone: {undo.what}")
            except Exception as exc:
                problems.append(f"{undo.what}: {exc}")
                report(f"COULD NOT UNDO: {undo.what}: {exc}")
        return problems


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not cut a rollback in half."""
    wanted = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, signal.SIG_IGN) for s in wanted}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
