"""Exceptions of the target side.

TargetError (shared.errors.PaddockError)
 ├── ConfigError        the configuration is unusable; the message names the key
 ├── RefusedError       the fence refused a turn; carries the wire ``Refusal``
 └── BackendError       bubblewrap (or the chosen backend) cannot run here
"""

from shared.errors import PaddockError
from shared.wire import Refusal


class TargetError(PaddockError):
    """Something the target side detected and reported on purpose."""


class ConfigError(TargetError):
    """The configuration cannot be used; the message says which key and why."""


class RefusedError(TargetError):
    """The fence refused a turn. Raised by exactly one place per rule."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"{refusal.rule} ({refusal.subject}): {refusal.detail}")
        self.refusal = refusal


class BackendError(TargetError):
    """The isolation backend is missing or does not work on this host."""
