"""Exceptions of the agent side, and the one place httpx's exceptions are mapped to them.

    AgentError (shared.errors.PaddockError)
     ├── UsageError           the command line or client settings cannot make a request
     ├── TargetUnreachable    no connection to the target could be opened
     │    └── SshUnreachable  the SSH server could not be reached, or its handshake failed
     ├── HostKeyUnknown       the SSH server's host key is in no known_hosts file
     ├── HostKeyChanged       the SSH server offered a key other than the one known_hosts holds
     ├── SshAuthFailed        the SSH server accepted none of the keys offered
     ├── SshFailure           the SSH connection works but refused what paddock asked of it
     ├── TlsFailure           a connection opened, but the target's certificate was not trusted
     ├── WrongScheme          the listener speaks HTTPS where http:// was given, or the reverse
     ├── ConnectionDropped    an open connection broke mid-exchange; a stream can resume
     ├── AuthRejected         the target refused the token (401) or its role (403)
     ├── RequestRejected      the target refused the request itself (4xx problem)
     ├── TargetBusy           the target runs as many turns as it may (429); ``submit`` waits
     ├── ServiceUnavailable   the target takes no new turn now: disk full, stopping (503)
     ├── ProtocolError        the target answered with something the contract does not allow
     ├── UnknownTurn          the target knows no turn by that id (mistyped, or long removed)
     ├── TurnLost             the target marked the turn lost (it crashed or restarted)
     ├── SeatTaken            another lease holds the seat (409); ``supersede`` takes it over
     ├── LeaseLost            the lease no longer holds its seat: superseded, lapsed, released
     ├── UnknownSession       the target knows no session by that id among the role's
     ├── SessionUnavailable   the session runs another turn, or has ended (409)
     ├── SessionRefused       the fence refused the session; ``refusal`` says why
     ├── FileRefused          the target's fence refused a file operation; carries the refusal
     └── FileFailed           the target said no to the role's uid: no such file, permission,
                              a directory where a file was named, a full disk

Every one of these makes the CLI exit 125: paddock itself failed, not the command; but a
refused session exits as a refused turn does (126, or 127), and for ``paddock cp`` a
``FileRefused`` exits 126 (as a refused turn does) and a ``FileFailed`` 1 (as ``cp`` does).
An ``SshUnreachable`` is a ``TargetUnreachable``, so a stream that resumes after a
dropped connection retries it; the host-key and auth failures are never retried.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from shared.errors import PaddockError

if TYPE_CHECKING:
    # Imported where they are used: ``paddock run`` through the multiplexer never maps
    # an httpx failure, and importing httpx and ssl would cost it most of its start.
    import ssl

    import httpx

    from shared.wire import Refusal


class AgentError(PaddockError):
    """Something the agent side detected and reported on purpose."""

    label: ClassVar[str] = "error"
    """Names the failure for a person, in the CLI's ``paddock: LABEL: message`` line."""


class UsageError(AgentError):
    """The command line or the client's settings cannot be turned into a valid request."""

    label = "usage"


class TargetUnreachable(AgentError):
    """No connection to the target could be opened (refused, no route, name unknown)."""

    label = "target unreachable"


class SshUnreachable(TargetUnreachable):
    """The SSH server could not be reached, or the connection broke during its handshake."""

    label = "SSH unreachable"


class HostKeyUnknown(AgentError):
    """The SSH server's host key is in no known_hosts file; nothing was sent to it."""

    label = "SSH host key unknown"


class HostKeyChanged(AgentError):
    """The SSH server's host key differs from the one known_hosts holds: possibly an attack."""

    label = "SSH HOST KEY CHANGED"


class HostKeyRevoked(AgentError):
    """The SSH server's host key is marked ``@revoked`` in a known_hosts file."""

    label = "SSH HOST KEY REVOKED"


class SshAuthFailed(AgentError):
    """The SSH server accepted none of the keys offered (agent, ``-i``, config, defaults)."""

    label = "SSH auth failed"


class SshFailure(AgentError):
    """The SSH server refused a request on a working connection (e.g. port forwarding)."""

    label = "SSH failure"


class TlsFailure(AgentError):
    """The TLS handshake failed, most often because the target's certificate is not trusted."""

    label = "TLS failure"


class WrongScheme(AgentError):
    """The listener answered in TLS to ``http://``, or in plain HTTP to ``https://``."""

    label = "wrong scheme"


class ConnectionDropped(AgentError):
    """A connection broke after it was opened; an event stream can resume from its cursor."""

    label = "connection dropped"


class AuthRejected(AgentError):
    """The target rejected the bearer token (401) or the token does not hold the role (403)."""

    label = "auth rejected"


class RequestRejected(AgentError):
    """The target rejected the request itself; the message carries its detail and fields."""

    label = "request rejected"


class TargetBusy(AgentError):
    """The target runs as many turns as a cap allows (429); nothing was started.

    ``retry_after_s`` is how long the target asked to wait before trying again.
    """

    label = "target busy"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(AgentError):
    """The target takes no new turn for now (its disk is full, or it is stopping) (503)."""

    label = "target unavailable"


class ProtocolError(AgentError):
    """The target's answer breaks the wire contract (status, content type, or body)."""

    label = "protocol error"


class UnknownTurn(AgentError):
    """The target knows no turn by that id: mistyped, or removed after its retention time."""

    label = "unknown turn"


class TurnLost(AgentError):
    """The target marked the turn lost: it crashed or restarted while the turn ran."""

    label = "turn lost"


class SeatTaken(AgentError):
    """Another lease holds the seat (409); a request that supersedes it takes it over."""

    label = "seat taken"


class LeaseLost(AgentError):
    """The lease no longer holds its seat (superseded, lapsed), or is gone (released, unknown)."""

    label = "lease lost"


class UnknownSession(AgentError):
    """The target knows no session by that id among the role's (mistyped, or long removed)."""

    label = "unknown session"


class SessionUnavailable(AgentError):
    """The session runs another turn (one at a time), or has ended; nothing was started."""

    label = "session unavailable"

    def __init__(self, message: str, turn_id: str | None = None) -> None:
        super().__init__(message)
        self.turn_id = turn_id
        """The turn it is running, when that is why."""


class SessionRefused(AgentError):
    """The fence refused the session, as it would a turn; ``refusal`` says why and what to do."""

    label = "session refused"

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class FileRefused(AgentError):
    """A rule of the target's fence refused a file operation; nothing was written.

    ``refusal`` is the same object a refused turn carries (rule, subject, path,
    resolved, detail).
    """

    label = "refused"

    def __init__(self, message: str, refusal: Refusal, status: int) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.status = status


class FileFailed(AgentError):
    """The target carried out no file operation: the path is missing, the role's uid may not,
    a directory stands where a file was named, or the reverse. Nothing was written.

    ``status`` is the HTTP status (404, 403, 409, 507, ...); ``errno`` the system's word,
    when it gave one.
    """

    label = "file"

    def __init__(self, message: str, status: int, errno: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.errno = errno


_TLS_HINT = "check --cacert / PADDOCK_CACERT names the CA that signed the target's certificate"


def map_transport_error(exc: httpx.HTTPError, url: str) -> AgentError:
    """The ``AgentError`` for an httpx failure talking to ``url``; callers raise it ``from exc``.

    Every ``httpx.HTTPError`` maps to something: a test walks httpx's whole
    exception tree so a new httpx exception cannot slip through unmapped.
    A transport that already knew what went wrong (the SSH tunnel raises
    ``httpcore.ConnectError`` from a ``HostKeyChanged``, say) is believed.
    """
    import httpx

    known = _agent_cause(exc)
    if known is not None:
        # A fresh instance: re-raising the original from ``exc`` would loop its cause chain.
        return type(known)(str(known))
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        tls = ssl_cause(exc)
        if tls is not None:
            return TlsFailure(f"TLS handshake with {url} failed ({_ssl_reason(tls)}); {_TLS_HINT}")
        return TargetUnreachable(
            f"cannot connect to {url} ({exc or type(exc).__name__}); "
            "check the target is running and the address (--target / PADDOCK_TARGET) is right"
        )
    if isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
        # Read/write errors, timeouts and a peer that hangs up mid-body all mean the
        # same to a caller: the exchange broke after it began, so it may be resumed.
        plain = url.startswith("http:")
        hint = "; if the target serves HTTPS, give an https:// URL" if plain else ""
        return ConnectionDropped(
            f"the connection to {url} broke mid-exchange ({exc or type(exc).__name__}){hint}"
        )
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return UsageError(f"cannot use target URL {url}: {exc}; give an https:// URL")
    if isinstance(exc, httpx.ProxyError):
        return TargetUnreachable(f"a proxy refused the connection to {url}: {exc}")
    return ProtocolError(f"talking to {url} failed: {type(exc).__name__}: {exc}")


def ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` somewhere in ``exc``'s cause chain (httpx wraps it twice)."""
    import ssl

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _agent_cause(exc: BaseException) -> AgentError | None:
    """An ``AgentError`` that ``exc`` was explicitly raised from, through any wrappers.

    Only ``__cause__`` counts: an error merely raised while another was being
    handled (``__context__``) says nothing about why this one happened.
    """
    seen: set[int] = set()
    current: BaseException | None = exc.__cause__
    while current is not None and id(current) not in seen:
        if isinstance(current, AgentError):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


def _ssl_reason(exc: ssl.SSLError) -> str:
    import ssl

    # The attributes are filled in only when OpenSSL raised the error itself.
    verify_message = getattr(exc, "verify_message", None)
    if isinstance(exc, ssl.SSLCertVerificationError) and verify_message:
        return f"certificate not trusted: {verify_message}"
    return getattr(exc, "reason", None) or str(exc)
