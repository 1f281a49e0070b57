"""``paddock status``: every stored target's health as seen from here, cause by cause.

Five causes, each set by its own failure and cleared by its own recovery
signal and by nothing else (one answered health poll says nothing about a
token the target rejected):

    cause         set when                                      cleared when (signal)
    connectivity  the host cannot be reached (network, SSH)     the host answered        reached
    offline       the host answers, no paddock target does      a target's health came   served
    tls           its identity fails (certificate, pinned CA,   its identity was         verified
                  SSH host key)                                 verified
    auth          a stored token (or the SSH login) is refused  every credential tried   accepted
                                                                was accepted
    degraded      the target's own health lists causes          its health lists none    armed

A cause keeps the time it began while it stays set; a poll that could not
look (the target was unreachable) leaves a cause as it was. The causes are
kept in ``$XDG_STATE_HOME/paddock/status.json`` (0600, replaced atomically),
with the time of the last poll, so a status read later can be told from a
fresh one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent_side import targets_file
from agent_side.errors import (
    AgentError,
    AuthRejected,
    ConnectionDropped,
    HostKeyChanged,
    HostKeyRevoked,
    HostKeyUnknown,
    ProtocolError,
    SshAuthFailed,
    SshUnreachable,
    TargetUnreachable,
    TlsFailure,
    UsageError,
    WrongScheme,
)
from agent_side.targets_file import StoredTarget
from agent_side.user_files import locked, private_dir, read_text, state_dir, write_private

CAUSES = ("connectivity", "offline", "tls", "auth", "degraded")
RECOVERS = {
    "reached": "connectivity",
    "served": "offline",
    "verified": "tls",
    "accepted": "auth",
    "armed": "degraded",
}
"""Each recovery signal, and the one cause it clears."""
STATUS_NAME = "status.json"
POLL_TIMEOUT_S = 10.0
PARALLEL_POLLS = 8


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# --- what one poll saw --------------------------------------------------------------------


@dataclass
class Observation:
    """What one poll of one target found: causes it saw fail, and recovery signals it saw."""

    failures: dict[str, str] = field(default_factory=dict)
    recoveries: set[str] = field(default_factory=set)
    target_causes: list[dict[str, str]] = field(default_factory=list)
    """The target's own health causes, as its health listed them (empty when armed)."""

    def fail(self, cause: str, detail: str) -> None:
        self.failures.setdefault(cause, detail)

    def recover(self, *signals: str) -> None:
        self.recoveries.update(signals)


@dataclass(frozen=True)
class Cause:
    cause: str
    since: str
    detail: str


@dataclass(frozen=True)
class TargetStatus:
    """One target's causes as they stand after its last poll."""

    name: str
    checked_at: str | None
    causes: dict[str, Cause]
    target_causes: list[dict[str, str]] = field(default_factory=list)

    @property
    def armed(self) -> bool:
        return not self.causes

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": "armed" if self.armed else "degraded",
            "checked_at": self.checked_at,
            "causes": [
                {"cause": c.cause, "since": c.since, "detail": c.detail}
                for c in sorted(self.causes.values(), key=lambda c: CAUSES.index(c.cause))
            ],
            "target_causes": self.target_causes,
        }


def apply(previous: TargetStatus, seen: Observation, at: str) -> TargetStatus:
    """The causes after ``seen``: failures set (keeping their start), recoveries clear their own."""
    causes = dict(previous.causes)
    for signal in seen.recoveries:
        cleared = RECOVERS[signal]
        if cleared not in seen.failures:
            causes.pop(cleared, None)
    for cause, detail in seen.failures.items():
        since = causes[cause].since if cause in causes else at
        causes[cause] = Cause(cause, since, detail)
    if "armed" in seen.recoveries:
        target_causes: list[dict[str, str]] = []
    elif seen.target_causes:
        target_causes = seen.target_causes
    else:
        target_causes = previous.target_causes  # its health was not seen this time
    return TargetStatus(previous.name, at, causes, target_causes)


# --- polling one stored target ---------------------------------------------------------------


def poll(entry: StoredTarget, environ: Mapping[str, str], timeout_s: float) -> Observation:
    """Ask ``entry`` for its health, and whether each stored token is still accepted."""
    seen = Observation()
    try:
        cacert = entry.checked_ca()
    except UsageError as exc:
        seen.fail("tls", str(exc))
        return seen
    try:
        with _opened(entry, cacert, environ, timeout_s) as target:
            if entry.route == "ssh":
                # The SSH server answered and took our key: the host is reached, its key known.
                seen.recover("reached", "verified")
                ssh_login = True
            else:
                ssh_login = False
            health = target.health()
            seen.recover("reached", "served")
            if target.client.base_url.startswith("https:"):
                seen.recover("verified")
            if health.status == "armed" and not health.causes:
                seen.recover("armed")
            else:
                seen.target_causes = [
                    {"cause": c.cause, "since": c.since.isoformat(), "detail": c.detail}
                    for c in health.causes
                ]
                listed = ", ".join(c.cause for c in health.causes) or health.status
                seen.fail("degraded", f"the target reports: {listed}")
            _check_tokens(entry, target.client, seen, ssh_login)
    except AgentError as exc:
        _classify(exc, seen)
    return seen


@contextlib.contextmanager
def _opened(
    entry: StoredTarget, cacert: str | None, environ: Mapping[str, str], timeout_s: float
) -> Iterator[Any]:
    from agent_side.api import Target

    timeout = httpx.Timeout(timeout_s, connect=timeout_s)
    if entry.route == "ssh" and entry.ssh is not None:
        from agent_side.connection import ssh_passphrase
        from agent_side.ssh import SshTimeouts

        limit = SshTimeouts(connect=timeout_s, banner=timeout_s, auth=timeout_s, channel=timeout_s)
        target = Target.ssh(
            entry.ssh,
            token=None,
            url=entry.url,
            cacert=cacert,
            remote_cacert=None,
            identity_files=entry.identity_files,
            known_hosts=entry.known_hosts,
            passphrase=ssh_passphrase(environ),
            timeouts=limit,
            timeout=timeout,
        )
    else:
        target = Target.https(entry.url, token=None, cacert=cacert, timeout=timeout)
    with target:
        yield target


def _check_tokens(entry: StoredTarget, client: Any, seen: Observation, ssh_login: bool) -> None:
    """Each stored token against ``GET /v1/roles``; ``accepted`` only when every one passed."""
    from agent_side.connection import read_token

    rejected = []
    for role, path in sorted(entry.tokens.items()):
        try:
            roles = client.roles(read_token(str(path)))
        except UsageError as exc:
            rejected.append(f"role {role}: {exc}")
            continue
        except AuthRejected:
            rejected.append(f"role {role}: the target refused its token ({path})")
            continue
        if role not in roles:
            rejected.append(f"role {role}: its token holds {', '.join(roles) or 'no role'}")
    if rejected:
        seen.fail("auth", "; ".join(rejected))
    elif entry.tokens or ssh_login:
        seen.recover("accepted")


def _classify(exc: AgentError, seen: Observation) -> None:
    """The cause ``exc`` speaks to, and what it proves besides (a refusal: the host answered)."""
    detail = str(exc)
    if isinstance(exc, HostKeyUnknown | HostKeyChanged | HostKeyRevoked):
        seen.recover("reached")
        seen.fail("tls", detail)
    elif isinstance(exc, SshAuthFailed):
        seen.recover("reached", "verified")
        seen.fail("auth", detail)
    elif isinstance(exc, SshUnreachable):
        seen.fail("connectivity", detail)
    elif isinstance(exc, TlsFailure | WrongScheme):
        seen.recover("reached")
        seen.fail("tls", detail)
    elif isinstance(exc, AuthRejected):
        seen.fail("auth", detail)
    elif isinstance(exc, TargetUnreachable) and _refused(exc):
        seen.recover("reached")
        seen.fail("offline", detail)
    elif isinstance(exc, ProtocolError):
        seen.recover("reached")
        seen.fail("offline", f"something answers that is not a paddock target: {detail}")
    elif isinstance(exc, TargetUnreachable | ConnectionDropped):
        seen.fail("connectivity", detail)
    else:
        seen.fail("connectivity", f"{exc.label}: {detail}")


def _refused(exc: BaseException) -> bool:
    """Whether the host itself refused the connection (it answered: nothing listens there)."""
    # Only an SSH route has imported paramiko (check imports it before any poll starts).
    paramiko = sys.modules.get("paramiko")
    refused_channel = getattr(paramiko, "ChannelException", ())
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ConnectionRefusedError):
            return True
        if paramiko is not None and isinstance(current, refused_channel):
            return bool(current.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


# --- the book of causes, between runs -------------------------------------------------------


def status_path(environ: Mapping[str, str]) -> Path:
    return state_dir(environ) / STATUS_NAME


def _read_book(path: Path) -> dict[str, TargetStatus]:
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}; remove it to start afresh") from exc
    if text is None:
        return {}
    try:
        data = json.loads(text)
        return {
            name: TargetStatus(
                name,
                entry.get("checked_at"),
                {
                    cause: Cause(cause, value["since"], value["detail"])
                    for cause, value in entry["causes"].items()
                    if cause in CAUSES
                },
                list(entry.get("target_causes", [])),
            )
            for name, entry in data["targets"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"{path} is not a status file paddock wrote ({exc!r}); remove it to start afresh "
            "(the causes' start times are lost with it)"
        ) from exc


def _render_book(book: Mapping[str, TargetStatus]) -> str:
    targets = {
        name: {
            "checked_at": status.checked_at,
            "causes": {
                c.cause: {"since": c.since, "detail": c.detail} for c in status.causes.values()
            },
            "target_causes": status.target_causes,
        }
        for name, status in sorted(book.items())
    }
    return json.dumps({"targets": targets}, indent=2) + "\n"


def check(
    names: Sequence[str],
    environ: Mapping[str, str],
    *,
    timeout_s: float = POLL_TIMEOUT_S,
    poller: Callable[[StoredTarget, Mapping[str, str], float], Observation] = poll,
) -> list[TargetStatus]:
    """Poll the stored targets ``names`` (all when empty), record and return their status."""
    stored = {entry.name: entry for entry in targets_file.load_all(environ)}
    unknown = [name for name in names if name not in stored]
    if unknown:
        known = ", ".join(sorted(stored)) or "none yet"
        raise UsageError(f"no stored target {unknown[0]!r} (stored: {known})")
    chosen = [stored[name] for name in (names or sorted(stored))]
    if any(entry.route == "ssh" for entry in chosen):
        # Imported here, once: polls importing it side by side could see it half-made.
        import paramiko  # noqa: F401
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL_POLLS) as pool:
        seen = list(pool.map(lambda entry: poller(entry, environ, timeout_s), chosen))
    directory = private_dir(state_dir(environ))
    path = directory / STATUS_NAME
    with locked(directory, ".status.lock"):
        book = _read_book(path)
        at = now_iso()
        for entry, observation in zip(chosen, seen, strict=True):
            previous = book.get(entry.name, TargetStatus(entry.name, None, {}))
            book[entry.name] = apply(previous, observation, at)
        # A target no longer stored has no status to keep.
        book = {name: status for name, status in book.items() if name in stored}
        write_private(path, _render_book(book))
    return [book[entry.name] for entry in chosen]


def table_lines(statuses: Sequence[TargetStatus]) -> list[str]:
    """One line per active cause, each with the time it began; ``armed`` for a target with none."""
    rows = [("TARGET", "CAUSE", "SINCE", "DETAIL")]
    for status in statuses:
        if status.armed:
            rows.append((status.name, "armed", "-", f"checked {status.checked_at}"))
        for cause in sorted(status.causes.values(), key=lambda c: CAUSES.index(c.cause)):
            rows.append((status.name, cause.cause, cause.since, cause.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[3]])
        for row in rows
    ]
