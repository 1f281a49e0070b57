"""Per-cause health (docs/design.md, "Health"): each cause set and cleared by its own signal."""

from __future__ import annotations

from datetime import UTC, datetime

from shared import __version__
from shared.wire import Health, HealthCause
from shared.wire import HealthCauseName as Cause


class HealthBoard:
    """The active causes of degradation; empty means armed."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._causes: dict[Cause, HealthCause] = {}

    def degrade(self, cause: Cause, detail: str, at: datetime | None = None) -> None:
        """Record ``cause``; an already active cause keeps its original date."""
        since = self._causes[cause].since if cause in self._causes else at or datetime.now(UTC)
        self._causes[cause] = HealthCause(cause=cause, since=since, detail=detail)

    def recover(self, cause: Cause) -> None:
        """Clear exactly ``cause``; every other cause stays until its own recovery."""
        self._causes.pop(cause, None)

    def snapshot(self) -> Health:
        causes = sorted(self._causes.values(), key=lambda c: c.since)
        return Health(
            status="degraded" if causes else "armed",
            causes=causes,
            version=__version__,
            backend=self.backend,
        )
