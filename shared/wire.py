"""Wire models of the v1 API (docs/api.md).

Every model forbids unknown fields: a misspelt field is an error that names it,
never a silently ignored request. Paths a request carries must be absolute;
whether they are *allowed* is the target's decision, not the model's.
"""

from __future__ import annotations

import base64
import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    field_validator,
    model_validator,
)

from shared.exit_status import ExitStatus

MAX_ARGV = 4096
MAX_SCRIPT_BYTES = 512 * 1024

RefusalRule = Literal[
    "forbidden-path",
    "outside-workspace",
    "untrusted-executable",
    "not-executable",
    "not-found",
    "digest-mismatch",
    "reserved-env",
    "invalid-env",
    "network-not-allowed",
    "limit-exceeds-role",
    "backend-unavailable",
    "path-changed",
    "bad-mount",
]
TurnState = Literal["running", "exited", "refused", "lost"]
HealthCauseName = Literal["backend", "limits", "disk", "config", "turns-failing", "identity"]
SignalName = Literal["INT", "TERM", "KILL", "HUP"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TURN_ID = re.compile(r"t-[0-9a-f]{32}")

# The validators' rules, as JSON Schema says them (for the OpenAPI document only: the
# validators below are what the target enforces, with messages that say how to fix it).
_NO_NUL = r"^[^\u0000]*$"
_ABSOLUTE = r"^/[^\u0000]*$"
_HOST_CONTAINER = r"^/[^\u0000:]*(:/[^\u0000]*)?$"


def is_turn_id(text: str) -> bool:
    """Whether ``text`` has the shape of a turn id (``t-`` and 32 hex digits)."""
    return _TURN_ID.fullmatch(text) is not None


class Wire(BaseModel):
    """Base of every wire model: unknown fields are rejected by name."""

    model_config = ConfigDict(extra="forbid")


def _absolute(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path must not contain NUL")
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is relative; give an absolute path (starting with '/')")
    return value


AbsolutePath = Annotated[
    str,
    Field(min_length=1, max_length=4096, json_schema_extra={"pattern": _ABSOLUTE}),
    AfterValidator(_absolute),
]


class FsAccess(Wire):
    """Extra host paths a turn asks to see: ``read`` read-only, ``write`` writable."""

    read: list[AbsolutePath] = Field(default_factory=list, max_length=256)
    write: list[AbsolutePath] = Field(default_factory=list, max_length=256)


class Limits(Wire):
    """Resource limits; each may be lower than the role's maximum, never higher."""

    wall_s: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, gt=0)
    pids: int | None = Field(default=None, gt=0)
    cpu: float | None = Field(default=None, gt=0)
    output_mb: int | None = Field(default=None, gt=0)
    scratch_mb: int | None = Field(default=None, gt=0, description="size of the turn's /tmp")


_Argv = Annotated[
    list[Annotated[str, Field(json_schema_extra={"pattern": _NO_NUL})]],
    Field(
        max_length=MAX_ARGV,
        # The program's name may not be empty; its arguments may.
        json_schema_extra={
            "minItems": 1,
            "prefixItems": [{"type": "string", "minLength": 1, "pattern": _NO_NUL}],
        },
    ),
]
_Digest = Annotated[str, Field(json_schema_extra={"pattern": "^[0-9a-f]{64}$"})]
_ONE_PROGRAM = {
    "oneOf": [
        {
            "title": "a command",
            "required": ["argv"],
            "properties": {
                "argv": {"type": "array"},
                "script": {"type": "null"},
                "script_sha256": {"type": "null"},
            },
        },
        {
            "title": "a script",
            "required": ["script", "script_sha256"],
            "properties": {
                "argv": {"type": "null"},
                "script": {"type": "string"},
                "script_sha256": {"type": "string"},
            },
        },
    ]
}
"""Exactly one of ``argv`` or ``script``, and ``script_sha256`` with ``script`` alone (an
absent field and ``null`` are the same)."""


class TurnRequest(Wire):
    """One command (``argv``) or one script (``script`` + ``script_sha256``) to run."""

    model_config = ConfigDict(json_schema_extra=_ONE_PROGRAM)

    role: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    argv: _Argv | None = Field(
        default=None, description="the program (found on the fence's PATH) and its arguments"
    )
    script: str | None = Field(
        default=None, max_length=MAX_SCRIPT_BYTES, description="a bash script's body"
    )
    script_sha256: _Digest | None = Field(
        default=None, description="the sha256 of the script's UTF-8 body"
    )
    cwd: AbsolutePath | None = Field(
        default=None, description="default: the role's first workspace"
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    fs: FsAccess = Field(default_factory=FsAccess)
    secrets: list[Annotated[str, Field(json_schema_extra={"pattern": _HOST_CONTAINER})]] = Field(
        default_factory=list,
        max_length=64,
        description="host:container, both absolute, bound read-only (host alone: at its own path)",
    )
    network: Literal["none", "host"] = "none"
    limits: Limits = Field(default_factory=Limits)
    stdin: Literal["closed", "open"] = "closed"

    @field_validator("argv")
    @classmethod
    def _argv_usable(cls, argv: list[str] | None) -> list[str] | None:
        if argv is None:
            return None
        if not argv or not argv[0]:
            raise ValueError("argv is empty; give the program to run as its first element")
        if any("\0" in arg for arg in argv):
            raise ValueError("an argv element contains NUL, which no program can receive")
        return argv

    @field_validator("secrets")
    @classmethod
    def _secret_pairs(cls, secrets: list[str]) -> list[str]:
        for pair in secrets:
            for part in pair.split(":", 1):
                _absolute(part)
        return secrets

    @field_validator("script_sha256")
    @classmethod
    def _digest_shape(cls, digest: str | None) -> str | None:
        if digest is not None and not _SHA256_HEX.fullmatch(digest):
            raise ValueError("script_sha256 must be 64 lowercase hex digits")
        return digest

    @model_validator(mode="after")
    def _one_program(self) -> TurnRequest:
        if (self.argv is None) == (self.script is None):
            raise ValueError("give exactly one of 'argv' or 'script'")
        if self.script is not None and self.script_sha256 is None:
            raise ValueError("a script turn needs 'script_sha256', the sha256 of its body")
        if self.script is None and self.script_sha256 is not None:
            raise ValueError("'script_sha256' belongs to a script turn; this one has 'argv'")
        return self


class Refusal(Wire):
    """Why the fence refused a turn, precise enough to act on."""

    rule: RefusalRule
    subject: str = Field(description="the request field at fault, e.g. 'fs.read[0]'")
    path: str | None = Field(default=None, description="the path as given")
    resolved: str | None = Field(default=None, description="the path as the walk resolved it")
    detail: str = Field(description="one sentence saying what to change")

    @property
    def exit_code(self) -> int:
        """127 for a program not found on the fence's PATH, 126 for every other refusal."""
        return ExitStatus.NOT_FOUND if self.rule == "not-found" else ExitStatus.REFUSED


class Executable(Wire):
    """The file a turn executed, pinned by device and inode."""

    path: str
    dev: int
    ino: int


class Usage(Wire):
    """What a finished turn consumed."""

    wall_s: float
    cpu_s: float | None = None
    max_rss_kb: int | None = None


class Turn(Wire):
    """A turn as the target knows it."""

    turn_id: str
    role: str
    state: TurnState
    exit_code: int | None = None
    signal: int | None = None
    refusal: Refusal | None = None
    created_at: datetime
    started_at: datetime | None = None
    ended_at: datetime | None = None
    executable: Executable | None = None
    usage: Usage | None = None
    output_truncated: bool = False

    @property
    def finished(self) -> bool:
        """Whether the turn has reached a state it will never leave."""
        return self.state != "running"


class _EventBase(Wire):
    seq: int = Field(ge=1)
    at: datetime


class StartedEvent(_EventBase):
    """The fence is up and the program was started."""

    kind: Literal["started"] = "started"
    executable: Executable | None = None


class OutputEvent(_EventBase):
    """A piece of the turn's stdout or stderr, as text or, if not UTF-8, base64."""

    kind: Literal["stdout", "stderr"]
    data: str | None = None
    data_b64: str | None = None
    _bytes: bytes | None = PrivateAttr(default=None)

    @classmethod
    def of_bytes(cls, seq: int, at: datetime, kind: str, data: bytes) -> OutputEvent:
        """The event for ``data`` as it came (a frame): text if UTF-8, else base64, and its
        bytes kept, so a reader writing them out never encodes them back (``output``)."""
        try:
            fields = {"data": data.decode()}
        except UnicodeDecodeError:
            fields = {"data_b64": base64.b64encode(data).decode()}
        event = cls.model_construct(seq=seq, at=at, kind=kind, **fields)
        event._bytes = data
        return event

    @property
    def output(self) -> bytes | None:
        """The bytes, when the event came with them (else from ``data`` or ``data_b64``)."""
        return self._bytes

    @model_validator(mode="after")
    def _one_payload(self) -> OutputEvent:
        if (self.data is None) == (self.data_b64 is None):
            raise ValueError("an output event carries exactly one of 'data' or 'data_b64'")
        return self


class ExitEvent(_EventBase):
    """The turn ended; no event follows."""

    kind: Literal["exit"] = "exit"
    exit_code: int
    signal: int | None = None
    turn: Turn | None = None
    """The turn as it ended (as ``GET /v1/turns/{id}`` would answer); absent from older targets."""


class RefusedEvent(_EventBase):
    """The fence refused the turn (nothing ran, or bwrap could not set up); no event follows."""

    kind: Literal["refused"] = "refused"
    refusal: Refusal
    exit_code: int
    turn: Turn | None = None
    """The turn as it ended; absent from older targets."""


class NoticeEvent(_EventBase):
    """Something the target wants the user to know (a limit hit, output truncated)."""

    kind: Literal["notice"] = "notice"
    message: str


Event = Annotated[
    StartedEvent | OutputEvent | ExitEvent | RefusedEvent | NoticeEvent,
    Field(discriminator="kind"),
]
TERMINAL_KINDS = frozenset({"exit", "refused"})


EVENTS: TypeAdapter[Event] = TypeAdapter(Event)
"""Validates one event (``EVENTS.validate_json(text)``) into its ``kind``'s model."""


class SignalRequest(Wire):
    """A signal for every process of a turn."""

    signal: SignalName


class HealthCause(Wire):
    """One active reason the target is degraded, with when it began."""

    cause: HealthCauseName
    since: datetime
    detail: str


class Health(Wire):
    """``armed`` when no cause is active, else ``degraded`` with every cause listed."""

    status: Literal["armed", "degraded"]
    causes: list[HealthCause] = Field(default_factory=list)
    version: str
    backend: str


class PlannedMount(Wire):
    """One mount of a planned fence: a host path bound read-only or writable, or a symlink."""

    kind: Literal["ro", "rw", "symlink"]
    source: str
    dest: str
    subject: str = Field(description="what asked for it: a request field, or the fence itself")


class PlannedLimits(Wire):
    """The limits a turn runs under: the request's, or the role's maxima where it asked none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float
    memory_mb: int
    pids: int
    cpu: float
    output_mb: int
    scratch_mb: int


class FenceView(Wire):
    """The fence a request would get, as ``POST /v1/plan`` reports it (nothing is launched)."""

    backend: str
    argv: list[str]
    executable: Executable
    cwd: str
    uid: int
    gid: int
    network: bool
    mounts: list[PlannedMount]
    env_names: list[str] = Field(description="names only: values may be secrets")
    limits: PlannedLimits


class PlanResult(Wire):
    """Exactly one of ``fence`` (it would run) or ``refusal`` (it would be refused)."""

    fence: FenceView | None = None
    refusal: Refusal | None = None
    exit_code: int = Field(description="0 if it would launch, else the refusal's exit status")


class ProblemField(Wire):
    """One field of a rejected request and what was wrong with it."""

    field: str
    message: str


class Problem(BaseModel):
    """An RFC 9457 problem body, for transport failures (never a turn outcome)."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    errors: list[ProblemField] = Field(default_factory=list)


class RoleList(Wire):
    """The body of ``GET /v1/roles``: the roles the presented token holds, sorted."""

    roles: list[str]
