"""What ``paddock-deploy`` and ``paddock deploy`` agree on: steps, exit statuses, event lines.

Both sides import this module (the agent side from the installed
distribution, the target from the zipapp), so it stays standard-library only
and holds nothing but the shared vocabulary:

    STEPS             the ten steps, in the order they run
    Exit              the script's exit statuses
    event lines       one JSON object per line on stdout with --json:
                        {"event": "step", "index", "total", "step", "status", "detail", "seconds"}
                        {"event": "note", "detail"}        a warning for a person
                        {"event": "rollback", "detail"}    one change undone
                        {"event": "result", "ok", ...}     last, exactly once
                      and ``describe``, the line a person sees for each
    PASSED_OPTIONS    the script's options that ``paddock deploy`` hands through
    WHEEL_NAME        the wheel file name the script accepts
    certificate_sha256  the fingerprint format of the result's ca_sha256 / cert_sha256
    CONFIG_DIR, CONFIG_FILE, CA_FILE   where a default deploy puts the target's config and
                      the CA agents pin (the target's tools default to them too)
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paddock_deploy.places import CA_FILE, CONFIG_DIR, CONFIG_FILE

__all__ = ["CA_FILE", "CONFIG_DIR", "CONFIG_FILE"]

STEPS = (
    "preflight",
    "user",
    "dirs",
    "release",
    "tls",
    "config",
    "service",
    "switch",
    "restart",
    "health",
)
ARCHIVE_NAME = "paddock-deploy.pyz"
"""The file the agent side uploads and runs with the target's python3."""


class Exit(enum.IntEnum):
    """The script's exit statuses."""

    OK = 0
    """Deployed (or already up to date), and health answered."""
    ROLLED_BACK = 1
    """A step failed; this run's changes were undone."""
    REFUSED = 2
    """Refused or failed before changing anything."""
    ROLLBACK_INCOMPLETE = 3
    """A step failed and not every change could be undone."""


# A step event's status: "started", then "running" heartbeats during long work, then one of
# the finished ones.
STARTED, RUNNING = "started", "running"
CHANGED, UNCHANGED, FAILED = "changed", "unchanged", "failed"
FINISHED = frozenset({CHANGED, UNCHANGED, FAILED})

WHEEL_NAME = re.compile(r"paddock-[^-/]+(-[^-/]+)?-[^-/]+-[^-/]+-[^-/]+\.whl")
"""pip reads the version from the wheel's file name, so it must be pip's own."""


def wheel_problem(path: Path) -> str | None:
    """Why ``path`` cannot be deployed as the paddock wheel (None: it can be tried)."""
    if not path.is_file():
        return f"--wheel {path}: no such file"
    if not WHEEL_NAME.fullmatch(path.name):
        return (
            f"--wheel {path.name} is not a paddock wheel's file name; keep the name "
            "pip wheel gave it (pip reads the version from it)"
        )
    return None


# --- event lines ------------------------------------------------------------------------------


def step_event(
    step: str, status: str, detail: str = "", seconds: float | None = None
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "event": "step",
        "index": STEPS.index(step) + 1,
        "total": len(STEPS),
        "step": step,
        "status": status,
        "detail": detail,
    }
    if seconds is not None:
        event["seconds"] = round(seconds, 2)
    return event


def note_event(detail: str) -> dict[str, Any]:
    return {"event": "note", "detail": detail}


def rollback_event(detail: str) -> dict[str, Any]:
    return {"event": "rollback", "detail": detail}


def failure_result(
    step: str | None, error: str, *, rolled_back: bool, problems: list[str], summary: str
) -> dict[str, Any]:
    """The result line of a run that did not deploy (``step`` None: refused before any step)."""
    return {
        "event": "result",
        "ok": False,
        "failed_step": step,
        "error": error,
        "rolled_back": rolled_back,
        "rollback_problems": problems,
        "summary": summary,
    }


def describe(event: Mapping[str, Any]) -> str | None:
    """The line a person sees for ``event``; None for a result (each side sums it up itself)."""
    kind, detail = event.get("event"), event.get("detail", "")
    if kind == "step":
        where = f"[{event.get('index')}/{event.get('total')}] {event.get('step')}"
        status = event.get("status")
        if status == STARTED:
            return f"{where} ..."
        if status == RUNNING:
            return f"  {event.get('step')}: {detail}"
        return f"{where}: {'FAILED: ' if status == FAILED else ''}{detail}"
    if kind == "note":
        return f"  {detail}"
    if kind == "rollback":
        return f"  rollback: {detail}"
    return None


def parse_event(line: str) -> dict[str, Any] | None:
    """One event line as the script wrote it; None when the line is not one."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    return event


# --- options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One option of the script that ``paddock deploy`` passes through as it is given."""

    flag: str
    metavar: str
    help: str
    default: str | None = None
    """The script's default (the agent side passes nothing when the option is not given)."""
    repeated: bool = False
    path: bool = False
    """The value must be an absolute path on the target."""
    choices: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def described(self) -> str:
        """The help text, with the script's default when it has one."""
        return f"{self.help} (default {self.default})" if self.default else self.help


PASSED_OPTIONS = (
    Option(
        "--listen",
        "HOST:PORT",
        "where the server listens (default 127.0.0.1:8443; an existing config wins)",
    ),
    Option("--prefix", "DIR", "where releases go", default="/opt/paddock", path=True),
    Option("--state-root", "DIR", "the server's state (default /var/lib/paddock)", path=True),
    Option("--config-dir", "DIR", "config and TLS files", default=CONFIG_DIR, path=True),
    Option("--user", "USER", "the service user (created if missing)", default="paddock"),
    Option(
        "--service",
        "MODE",
        "systemd unit, or a supervised process where systemd is not PID 1",
        default="auto",
        choices=("auto", "systemd", "supervised"),
    ),
    Option(
        "--bin-dir",
        "DIR",
        "where the paddock-target command is linked, so it is on root's PATH",
        default="/usr/local/bin",
        path=True,
    ),
    Option(
        "--workspace",
        "DIR",
        "each new role works in DIR/ROLE, a directory of its own uid "
        "(repeatable; default /srv/paddock/work)",
        repeated=True,
        path=True,
    ),
    Option(
        "--launcher-socket",
        "PATH",
        "where the privileged launcher listens for the server "
        "(default /run/paddock/launcher.sock; an existing config wins)",
        path=True,
    ),
    Option(
        "--tls-host",
        "NAME",
        "another name or address for the generated certificate (repeatable)",
        repeated=True,
    ),
)


# --- certificates -----------------------------------------------------------------------------

_PEM_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def pem_certificates(pem: str) -> list[str]:
    return _PEM_CERTIFICATE.findall(pem)


def certificate_sha256(pem: str) -> str:
    """SHA-256 of the first certificate in ``pem`` (DER), as colon-separated upper-case hex."""
    found = pem_certificates(pem)
    if not found:
        raise ValueError("not a PEM certificate")
    return der_sha256(ssl.PEM_cert_to_DER_cert(found[0]))


def der_sha256(der: bytes) -> str:
    return hashlib.sha256(der).digest().hex(":").upper()
