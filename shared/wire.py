"""Wire models of the v1 API (docs/api.md).

Every model forbids unknown fields: a misspelt field is an error that names it,
never a silently ignored request. Paths a request carries must be absolute;
whether they are *allowed* is the target's decision, not the model's.
"""

from __future__ import annotations

import base64
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.config import JsonDict

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
    "protected-path",
    "bad-archive",
    "stale-lease",
]
TurnState = Literal["running", "exited", "refused", "lost"]
SessionState = Literal["open", "refused", "closed", "lost"]
HealthCauseName = Literal["backend", "limits", "disk", "config", "turns-failing", "identity"]
SignalName = Literal["INT", "TERM", "KILL", "HUP"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TURN_ID = re.compile(r"t-[0-9a-f]{32}")
_LEASE_ID = re.compile(r"l-[0-9a-f]{32}")
_SESSION_ID = re.compile(r"s-[0-9a-f]{32}")
MAX_TTY_SIDE = 1000
"""Rows or columns of a terminal, at most: more than any screen, less than the kernel's 65535."""

# The validators' rules, as JSON Schema says them (for the OpenAPI document only: the
# validators below are what the target enforces, with messages that say how to fix it).
_NO_NUL = r"^[^\u0000]*$"
_ABSOLUTE = r"^/[^\u0000]*$"
_HOST_CONTAINER = r"^/[^\u0000:]*(:/[^\u0000]*)?$"


def is_turn_id(text: str) -> bool:
    """Whether ``text`` has the shape of a turn id (``t-`` and 32 hex digits)."""
    return _TURN_ID.fullmatch(text) is not None


def is_lease_id(text: str) -> bool:
    """Whether ``text`` has the shape of a lease id (``l-`` and 32 hex digits)."""
    return _LEASE_ID.fullmatch(text) is not None


def is_session_id(text: str) -> bool:
    """Whether ``text`` has the shape of a session id (``s-`` and 32 hex digits)."""
    return _SESSION_ID.fullmatch(text) is not None


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


MAX_LEASE_TTL_S = 86400.0
"""The longest a lease may run between renewals: a day."""
SEAT_TEXT = r"^[^\u0000-\u001f\u007f]*$"
_LEASE_ID_SHAPE = r"^l-[0-9a-f]{32}$"


def seat_text(value: str) -> str:
    """``value``, if it can name a seat: text without control characters."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError("a seat name must not hold control characters (newlines, tabs, NUL)")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError("a seat name must be valid Unicode text (no lone surrogates)") from exc
    return value


SeatName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=256,
        json_schema_extra={"pattern": SEAT_TEXT},
        description="what the lease holds, within its role: any text without control "
        "characters, such as the agent's workspace",
    ),
    AfterValidator(seat_text),
]
LeaseId = Annotated[str, Field(pattern=_LEASE_ID_SHAPE, description="`l-` and 32 hex digits")]
Generation = Annotated[int, Field(ge=1)]


class LeaseRef(Wire):
    """The lease a request acts under; the target refuses it unless it is its seat's current one.

    ``generation`` is the fencing token: each lease granted on a seat gets the
    next one, so a holder whose seat was taken over names an old generation.
    """

    lease_id: LeaseId
    seat: SeatName
    generation: Generation


class Leased(Wire):
    """A request that may act under a lease (``lease``); the role may require one."""

    lease: LeaseRef | None = Field(
        default=None,
        description="the lease this request acts under; refused (stale-lease) unless it is "
        "the seat's current generation, held and unexpired",
    )


class SessionLimits(Limits):
    """A session's limits: the fence's (memory, pids, cpu, scratch: all its turns together),
    its turns' defaults (``wall_s``, ``output_mb``, each turn's own), and its own life."""

    session_s: float | None = Field(
        default=None, gt=0, description="the session ends this long after it started"
    )
    session_idle_s: float | None = Field(
        default=None, gt=0, description="the session ends after this long without a turn"
    )


class Tty(Wire):
    """A terminal for a turn: its size, and the ``TERM`` its programs are told."""

    rows: int = Field(ge=1, le=MAX_TTY_SIDE)
    cols: int = Field(ge=1, le=MAX_TTY_SIDE)
    term: str | None = Field(
        default=None,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$",
        description="TERM inside (default: the target's own, if it has one)",
    )


class Resize(Wire):
    """A terminal turn's new size (``POST /v1/turns/{id}/resize``)."""

    rows: int = Field(ge=1, le=MAX_TTY_SIDE)
    cols: int = Field(ge=1, le=MAX_TTY_SIDE)


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
_ONE_PROGRAM: JsonDict = {
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
_EMPTY_FS: JsonDict = {
    "anyOf": [
        {"type": "null"},
        {
            "type": "object",
            "properties": {
                "read": {"anyOf": [{"type": "null"}, {"maxItems": 0}]},
                "write": {"anyOf": [{"type": "null"}, {"maxItems": 0}]},
            },
        },
    ]
}
_SESSION_TURN: JsonDict = {
    "if": {"required": ["session"], "properties": {"session": {"type": "string"}}},
    "then": {
        "properties": {
            "cwd": {"type": "null"},
            "env": {"anyOf": [{"type": "null"}, {"maxProperties": 0}]},
            "fs": _EMPTY_FS,
            "secrets": {"anyOf": [{"type": "null"}, {"maxItems": 0}]},
            "network": {"anyOf": [{"type": "null"}, {"const": "none"}]},
            "limits": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {
                            name: {"type": "null"}
                            for name in ("memory_mb", "pids", "cpu", "scratch_mb")
                        },
                    },
                ]
            },
        }
    },
}
"""A turn in a session sets none of the fence's fields (the session's are its own)."""


class TurnRequest(Leased):
    """One command (``argv``) or one script (``script`` + ``script_sha256``) to run."""

    model_config = ConfigDict(json_schema_extra=_ONE_PROGRAM | _SESSION_TURN)

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
    session: Annotated[str, Field(json_schema_extra={"pattern": "^s-[0-9a-f]{32}$"})] | None = (
        Field(
            default=None,
            description="run inside this open session's fence and shell (`cwd`, `env`, `fs`, "
            "`secrets`, `network` and the fence's limits are then the session's)",
        )
    )
    tty: Tty | None = Field(
        default=None,
        description="run on a terminal of this size: one output stream, stdin is keystrokes",
    )

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

    @model_validator(mode="after")
    def _session_fence_is_the_sessions(self) -> TurnRequest:
        # A turn in a session gets exactly the session's fence: nothing it asks may widen it.
        if self.session is None:
            return self
        if not is_session_id(self.session):
            raise ValueError(f"session {self.session!r} is not a session id (s- and 32 hex digits)")
        given = [name for name in SESSION_FENCE_FIELDS if getattr(self, name) != _EMPTY[name]]
        given += [
            f"limits.{name}"
            for name in sorted(self.limits.model_fields_set)
            if name not in SESSION_TURN_LIMITS and getattr(self.limits, name) is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: a turn in a session runs in the session's fence, which "
                "its own request cannot change; give these when starting the session (and "
                "use cd or export inside it), or run a turn of its own without 'session'"
            )
        return self


SESSION_FENCE_FIELDS = ("cwd", "env", "fs", "secrets", "network")
"""What a turn request may not set with ``session``: they are the session's."""
SESSION_TURN_LIMITS = frozenset({"wall_s", "output_mb"})
"""The limits a turn in a session may ask for itself (at most the session's)."""
_EMPTY: dict[str, object] = {
    "cwd": None,
    "env": {},
    "fs": FsAccess(),
    "secrets": [],
    "network": "none",
}


class SessionRequest(Leased):
    """A long-lived fence with one shell, for turns that name it (``POST /v1/sessions``).

    A session under a lease runs each of its turns under it too (unless the
    turn names its own): once a newer holder takes the seat, they are refused.
    """

    role: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    cwd: AbsolutePath | None = Field(
        default=None, description="where the shell starts; default: the role's first workspace"
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    fs: FsAccess = Field(default_factory=FsAccess)
    secrets: list[Annotated[str, Field(json_schema_extra={"pattern": _HOST_CONTAINER})]] = Field(
        default_factory=list,
        max_length=64,
        description="host:container, both absolute, bound read-only (host alone: at its own path)",
    )
    network: Literal["none", "host"] = "none"
    limits: SessionLimits = Field(default_factory=SessionLimits)

    @field_validator("secrets")
    @classmethod
    def _secret_pairs(cls, secrets: list[str]) -> list[str]:
        for pair in secrets:
            for part in pair.split(":", 1):
                _absolute(part)
        return secrets

    def fence_request(self, argv: list[str]) -> TurnRequest:
        """The turn request whose fence this session is: the same fields, running ``argv``."""
        limits = Limits.model_validate(
            self.limits.model_dump(exclude={"session_s", "session_idle_s"}, exclude_none=True)
        )
        return TurnRequest(
            role=self.role,
            argv=argv,
            cwd=self.cwd,
            env=self.env,
            fs=self.fs,
            secrets=self.secrets,
            network=self.network,
            limits=limits,
            stdin="open",
            lease=self.lease,
        )


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
    session_id: str | None = Field(default=None, description="the session it ran in, if any")
    tty: bool = Field(default=False, description="whether it ran on a terminal")

    @property
    def finished(self) -> bool:
        """Whether the turn has reached a state it will never leave."""
        return self.state != "running"


class SessionTimes(Wire):
    """How long a session may live, and stay idle, as it was started."""

    session_s: float
    session_idle_s: float
    wall_s: float = Field(description="each turn's wall-time limit unless it asks for less")
    output_mb: int = Field(description="each turn's output limit unless it asks for less")


class Session(Wire):
    """A session as the target knows it."""

    session_id: str
    role: str
    state: SessionState
    refusal: Refusal | None = None
    created_at: datetime
    started_at: datetime | None = None
    ended_at: datetime | None = None
    last_active_at: datetime | None = Field(
        default=None, description="when its last turn ended (or it started): idleness counts from"
    )
    cwd: str | None = Field(default=None, description="where its shell started")
    turn_id: str | None = Field(default=None, description="the turn running in it now, if any")
    turns: int = Field(default=0, description="how many turns it has run")
    limits: SessionTimes | None = None
    ended: str | None = Field(default=None, description="why it ended, in a sentence")
    exit_code: int | None = Field(
        default=None, description="the shell's own status, when the shell itself exited"
    )

    @property
    def finished(self) -> bool:
        return self.state != "open"


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
        bytes kept, so a reader writing them out never encodes them back (``output``).

        The base64 of bytes that are not UTF-8 is made only when something reads
        ``data_b64`` (or serialises the event): a reader of ``output`` never pays
        for it, which was a third of a binary stream's cost.
        """
        try:
            text = data.decode()
        except UnicodeDecodeError:
            event = cls.model_construct(seq=seq, at=at, kind=kind)
            del event.__dict__["data_b64"]  # made from _bytes on first read (__getattr__)
        else:
            event = cls.model_construct(seq=seq, at=at, kind=kind, data=text)
        event._bytes = data
        return event

    def __getattr__(self, name: str) -> Any:
        if name == "data_b64":
            encoded = base64.b64encode(self._bytes or b"").decode()
            self.__dict__["data_b64"] = encoded
            return encoded
        return super().__getattr__(name)  # type: ignore[misc]

    # No return annotation on purpose: pydantic would publish it (Any) as the event's
    # serialised schema, where without one the model's own schema stands.
    @model_serializer(mode="wrap")
    def _with_payload(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]  # noqa: ANN202
        _ = self.data_b64  # a payload not made yet is made before the event is written out
        return handler(self)

    def __repr_args__(self) -> Any:
        _ = self.data_b64
        return super().__repr_args__()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OutputEvent):
            _ = self.data_b64, other.data_b64
        return super().__eq__(other)

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


FileType = Literal["file", "directory", "symlink", "other"]
_MODE = r"^[0-7]{4}$"


class FileEntry(Wire):
    """One entry of a listing (``GET /v1/files?list=1``), as ``lstat`` saw it on the target."""

    name: str = Field(description="its name (invalid UTF-8 shown as U+FFFD; see name_b64)")
    name_b64: str | None = Field(
        default=None, description="the name's bytes, base64, only when they are not UTF-8"
    )
    type: FileType
    size: int = Field(ge=0)
    mode: str = Field(pattern=_MODE, description="permission bits, four octal digits")
    mtime: datetime
    uid: int
    gid: int
    target: str | None = Field(default=None, description="a symlink's target, as stored")


class FileListing(Wire):
    """A path and, when it is a directory, what it holds (sorted by name)."""

    path: str = Field(description="the path as the walk resolved it")
    entry: FileEntry = Field(description="the path itself")
    entries: list[FileEntry] = Field(default_factory=list)
    truncated: bool = Field(
        default=False, description="more entries than `limit` exist; only `limit` are listed"
    )


class FileWritten(Wire):
    """What ``PUT /v1/files`` put in place."""

    path: str = Field(description="where the file now is, as the walk resolved the path")
    size: int = Field(ge=0)
    mode: str = Field(pattern=_MODE)
    uid: int = Field(description="the host uid the file belongs to: the role's own")
    created: bool = Field(description="true if nothing was there before")


class ArchiveWritten(Wire):
    """What ``PUT /v1/archive`` put in place."""

    path: str = Field(description="the directory, as the walk resolved the path")
    entries: int = Field(ge=0, description="archive members extracted")
    size: int = Field(ge=0, description="bytes of regular files extracted")
    created: bool = Field(description="true if the directory did not exist before")


class RefusedProblem(Problem):
    """A problem body for a file operation the target did not carry out.

    ``refusal`` when a rule of the fence refused it (the same object a refused
    turn carries); ``errno`` when the host refused the role's uid (permission,
    no such file, a directory where a file was named).
    """

    refusal: Refusal | None = None
    errno: str | None = Field(default=None, description="the system's error name, e.g. EACCES")


class RoleList(Wire):
    """The body of ``GET /v1/roles``: the roles the presented token holds, sorted."""

    roles: list[str]


LeaseState = Literal["held", "released", "expired", "superseded"]


class LeaseRequest(Wire):
    """Take a seat: a lease on ``seat`` for ``role``, until ``ttl_s`` seconds pass unrenewed."""

    role: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    seat: SeatName | None = Field(default=None, description="default: the role's first workspace")
    ttl_s: float = Field(default=60.0, gt=0, le=MAX_LEASE_TTL_S)
    supersede: bool = Field(
        default=False,
        strict=True,  # a boolean, not 0 or "false"
        description="take the seat even while another lease holds it: that one is superseded",
    )


class RenewRequest(Wire):
    """Extend a held lease to ``ttl_s`` seconds from now (default: its own ``ttl_s``)."""

    ttl_s: float | None = Field(default=None, gt=0, le=MAX_LEASE_TTL_S)


class Lease(Wire):
    """A lease on a seat, as the target knows it now."""

    lease_id: str
    role: str
    seat: str
    generation: int = Field(description="this lease's place in its seat's succession, from 1")
    state: LeaseState
    ttl_s: float
    granted_at: datetime
    expires_at: datetime = Field(description="when it lapses unless renewed first")
    ended_at: datetime | None = Field(
        default=None, description="when it was released, lapsed, or superseded"
    )

    @property
    def ref(self) -> LeaseRef:
        """What a request names to act under this lease."""
        return LeaseRef(lease_id=self.lease_id, seat=self.seat, generation=self.generation)
