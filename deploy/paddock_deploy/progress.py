"""What the deploy says while it runs: lines for a person, or JSON event lines (``--json``).

Each step says when it starts and when it ends, and a command that runs for
longer than ``HEARTBEAT_S`` says so again every ``HEARTBEAT_S`` (a pip install
can take a minute: silence would look like a hang).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from paddock_deploy import protocol
from paddock_deploy.errors import Interrupted

HEARTBEAT_S = 5.0


class Progress:
    """Writes event lines; a line that must arrive and cannot is an ``Interrupted``."""

    def __init__(self, as_json: bool, out: TextIO = sys.stdout) -> None:
        self.as_json = as_json
        self.out = out
        self.lost = False
        self._step: str | None = None

    def emit(self, event: dict[str, Any], text: str | None = None, *, must_arrive: bool) -> None:
        """``event`` as JSON, or as ``text`` (by default the protocol's line for it)."""
        line = json.dumps(event) if self.as_json else (text or protocol.describe(event) or "")
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (OSError, ValueError) as exc:
            self.lost = True
            if must_arrive:
                raise Interrupted(
                    "the output channel went away; nobody would see the result"
                ) from exc

    def started(self, step: str) -> None:
        self._step = step
        self.emit(protocol.step_event(step, protocol.STARTED), must_arrive=True)

    def finished(self, step: str, changed: bool, detail: str, seconds: float) -> None:
        status = protocol.CHANGED if changed else protocol.UNCHANGED
        self.emit(protocol.step_event(step, status, detail, seconds), must_arrive=True)
        self._step = None

    def failed(self, step: str, error: str) -> None:
        self.emit(protocol.step_event(step, protocol.FAILED, error), must_arrive=False)
        self._step = None

    def waiting(self, what: str) -> Callable[[float], None]:
        """A heartbeat for ``what``, to be called with the seconds it has run so far."""

        def beat(seconds: float) -> None:
            if self._step is None:
                return
            event = protocol.step_event(
                self._step, protocol.RUNNING, f"{what}: still running after {seconds:.0f}s", seconds
            )
            self.emit(event, must_arrive=True)

        return beat

    def note(self, text: str) -> None:
        self.emit(protocol.note_event(text), must_arrive=False)

    def rollback(self, text: str) -> None:
        self.emit(protocol.rollback_event(text), must_arrive=False)
