"""Every exception the target side raises on purpose, in one tree.

    TargetError (shared.errors.PaddockError)
     ├── ConfigError          the configuration is unusable; the message names the key
     ├── UnsafeFileError      a private file, or a directory above it, could be swapped or read
     ├── RefusedError         the fence refused a turn; carries the wire ``Refusal``
     │    └── MissingPath     refused because the path named does not exist (files: HTTP 404)
     ├── BackendError         bubblewrap cannot run here
     ├── FilterUnavailable    no seccomp filter can be built on this machine
     ├── LimitError           a turn's limits could not be put in place; it must not run
     ├── PathChanged          a checked path is no longer what the check saw
     ├── HomeError            a role's home could not be made or repaired
     ├── LauncherError        the privileged launcher refused or could not be reached
     ├── LedgerError          the ledger's chain or head does not check out
     ├── StorageError         the state disk refused a write (full or failing); nothing torn is left
     ├── StateRootBusy        another server holds the state root's lock
     ├── TurnCapReached       a cap on running turns is reached (HTTP 429, Retry-After)
     ├── TargetUnavailable    the target takes no new turn for now: disk full, stopping (HTTP 503)
     ├── AuthError            the request carries no usable token (HTTP 401)
     ├── RoleNotHeld          the token is valid but lacks the role asked for (HTTP 403)
     ├── UnknownTurn          no turn with that id is visible to the caller (HTTP 404)
     ├── TurnNotRunning       the turn has ended: it takes no signal or input (HTTP 409)
     ├── StdinClosed          the turn takes no input (HTTP 409)
     ├── UnknownLease         no lease with that id is visible to the caller (HTTP 404)
     ├── SeatHeld             another lease holds the seat; ``supersede`` takes it (HTTP 409)
     ├── LeaseEnded           the lease was superseded, released or has lapsed (HTTP 409)
     ├── NoTerminal           the turn runs on no terminal: it cannot be resized (HTTP 409)
     ├── UnknownSession       no session with that id is visible to the caller (HTTP 404)
     ├── SessionBusy          the session runs another turn; one at a time (HTTP 409)
     ├── SessionEnded         the session has ended: it runs no more turns (HTTP 409)
     └── FileOpFailed         a file operation was not carried out (refused, or the host said no)

A refusal is a turn's outcome, not a failure of the target: ``RefusedError``
only carries one from where a rule is detected to where the turn is recorded.
"""

from shared.errors import PaddockError
from shared.wire import Refusal


class TargetError(PaddockError):
    """Something the target side detected and reported on purpose."""


class ConfigError(TargetError):
    """The configuration cannot be used; the message says which key and why."""


class UnsafeFileError(TargetError):
    """A private file, or a directory above it, could be read or replaced by someone else."""


class RefusedError(TargetError):
    """The fence refused a turn. Raised by exactly one place per rule."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"{refusal.rule} ({refusal.subject}): {refusal.detail}")
        self.refusal = refusal


class MissingPath(RefusedError):
    """Refused because the path named does not exist (``bad-mount``): a file operation's 404."""


class BackendError(TargetError):
    """The isolation backend is missing or does not work on this host."""


class FilterUnavailable(TargetError):
    """No seccomp filter can be built on this machine; the message says why."""


class LimitError(TargetError):
    """A turn's limits could not be put in place; the turn must not run."""


class PathChanged(TargetError):
    """A component of a checked path is no longer what the check saw."""


class HomeError(TargetError):
    """A role's home could not be made or repaired; no turn of the role can run until it is."""


class LauncherError(TargetError):
    """The privileged launcher refused a request, or could not be reached."""


class ThreadIdsError(TargetError):
    """A worker thread could not take a role's ids (or give them back); the turn must not run."""


class LedgerError(TargetError):
    """The ledger is damaged: a record does not chain to the one before, or the head disagrees."""


class StorageError(TargetError):
    """The state disk refused a write (full, over quota, or failing).

    Whoever raises it has cut back what it had half written, so what is on disk
    is whole; the message names the file and the system's reason.
    """


class StateRootBusy(TargetError):
    """Another server holds the state root's lock; the message says which (pid, start time)."""


class TurnCapReached(TargetError):
    """A cap on running turns is reached; the caller may retry after ``retry_after_s``."""

    def __init__(self, message: str, cap: str, limit: int, retry_after_s: int) -> None:
        super().__init__(message)
        self.cap = cap
        """The configuration key of the cap reached, e.g. ``server.max_turns``."""
        self.limit = limit
        self.retry_after_s = retry_after_s


class TargetUnavailable(TargetError):
    """The target takes no new turn for now (its disk is full, or it is stopping)."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        """``disk`` or ``stopping``."""
        self.retry_after_s = retry_after_s


class AuthError(TargetError):
    """The request carries no usable token (HTTP 401)."""


class RoleNotHeld(TargetError):
    """The token is valid but does not hold the role asked for (HTTP 403)."""


class UnknownTurn(TargetError):
    """No turn with that id is visible to the caller."""


class TurnNotRunning(TargetError):
    """The turn has ended, so it takes no signal or input."""


class StdinClosed(TargetError):
    """The turn was not started with ``stdin: open``, or its stdin is already closed."""


class UnknownLease(TargetError):
    """No lease with that id is visible to the caller (HTTP 404)."""


class SeatHeld(TargetError):
    """Another lease holds the seat; only a request that supersedes it may take it (HTTP 409)."""

    def __init__(self, message: str, seat: str, generation: int, expires_at: str) -> None:
        super().__init__(message)
        self.seat = seat
        self.generation = generation
        """The holder's generation: the one a superseding lease follows."""
        self.expires_at = expires_at


class LeaseEnded(TargetError):
    """The lease no longer holds its seat (superseded, released, lapsed): it cannot be renewed."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class NoTerminal(TargetError):
    """The turn was not started with ``tty``, so it has no terminal to resize."""


class UnknownSession(TargetError):
    """No session with that id is visible to the caller."""


class SessionBusy(TargetError):
    """The session is running another turn; it runs one at a time."""

    def __init__(self, message: str, turn_id: str | None) -> None:
        super().__init__(message)
        self.turn_id = turn_id
        """The turn it is running (None while that turn is being started)."""


class SessionEnded(TargetError):
    """The session has ended (or never opened): it runs no more turns."""


class FileOpFailed(TargetError):
    """A file operation was not carried out; ``status`` is its HTTP answer.

    Carries the ``Refusal`` when a rule of the fence refused it, else ``errno``:
    the system's word when it refused the role's uid (a file operation acts on
    the host only as its role). Nothing was written either way.
    """

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        refusal: Refusal | None = None,
        errno: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.refusal = refusal
        self.errno = errno
