"""Every way a deploy stops, in one tree.

DeployError          a step could not be done; the message says what to change
 ├── Refused         preflight found the host or the arguments unfit; nothing was changed
 ├── InjectedFailure --fail-at made a step fail after it did its work
 └── Interrupted     a signal, or the output channel went away: stop, and roll back
"""

from __future__ import annotations


class DeployError(Exception):
    """A step could not be done; the message says what to change."""


class Refused(DeployError):
    """Preflight found the host or the arguments unfit; nothing was changed."""


class InjectedFailure(DeployError):
    """``--fail-at`` made a step fail after it did its work (tests of the rollback)."""


class Interrupted(DeployError):
    """A signal arrived, or the output channel went away: stop, and roll back."""
