"""File operations (docs/api.md, "Files"): a file's bytes, a listing, a directory as a tar.

The server never opens a role's file itself. Each operation is planned by
``policy.files`` (the same walk, forbidden list, workspaces and protected
names as a turn), then carried out by a short fence of its own, launched the
way a turn is (``fence.launch`` through ``fence.identity``), in which the file
helper (``fence/file_helper.py``) does the one thing asked as the role's uid.
The server moves bytes between the HTTP exchange and the helper's data pipe,
and reads the helper's reports:

- a read answers once the helper has checked the file (``ready``), then streams;
- a write streams the body to the helper, bounded by the role's ``file_mb``,
  and tells it to commit only once the whole body arrived and the helper
  received exactly that much: a client that goes away mid-upload leaves
  nothing behind.

Each operation counts against the caps on running turns while its fence runs,
and leaves one ``file`` record in the ledger (path, size, outcome; never
content).
"""

import asyncio
import contextlib
import email.utils
import fcntl
import importlib.resources
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, NamedTuple

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AfterValidator, ValidationError
from starlette.requests import ClientDisconnect

from shared.exit_status import ExitStatus
from shared.wire import (
    SEAT_TEXT,
    ArchiveWritten,
    FileListing,
    FileWritten,
    LeaseRef,
    Refusal,
    RefusedProblem,
    seat_text,
)
from target_side.errors import FileOpFailed, MissingPath, RefusedError, TargetError
from target_side.fence.file_helper import REQUEST_VARIABLE
from target_side.fence.launch import launch_turn
from target_side.fence.runner import Outcome, RunningTurn
from target_side.policy import refusals
from target_side.policy.files import FilePlan, Operation, plan_file
from target_side.service.auth import require_role
from target_side.service.connections import STREAMING
from target_side.service.openapi import PROBLEM_JSON, errors
from target_side.service.spool import now
from target_side.service.turns import TurnManager

log = logging.getLogger("paddock.target")

HELPER = importlib.resources.files("target_side.fence").joinpath("file_helper.py").read_bytes()
"""The helper's body, read once from the installed package, handed to every fence from memory."""
CHUNK = 1 << 18
PIPE_BYTES = 1 << 20
MAX_LISTING_BYTES = 64 << 20
"""A listing's JSON, at most (``limit`` entries of at most a few hundred bytes each)."""
DEFAULT_LIST_LIMIT = 10_000
MAX_LIST_LIMIT = 100_000
MODE_PATTERN = r"^0?[0-7]{3}$"
CLOSE_WAIT_S = 10.0
"""How long an abandoned operation's helper gets to end by itself before it is killed."""

_STATUS_OF_ERRNO = {
    "ENOENT": (404, "No such file"),
    "EACCES": (403, "Permission denied"),
    "EPERM": (403, "Permission denied"),
    "EROFS": (403, "Read-only"),
    "EBUSY": (403, "Protected"),
    "ETXTBSY": (409, "File busy"),
    "EISDIR": (409, "Is a directory"),
    "ENOTDIR": (409, "Not a directory"),
    "EEXIST": (409, "Already exists"),
    "ENOTEMPTY": (409, "Directory not empty"),
    "EINVAL": (409, "Not a regular file"),
    "ELOOP": (409, "Too many symlinks"),
    "EXDEV": (409, "Crosses a mount"),
    "ENAMETOOLONG": (409, "Name too long"),
    "ENOSPC": (507, "No space left"),
    "EDQUOT": (507, "Over quota"),
    "EFBIG": (507, "File too large for its filesystem"),
}
"""What the system's refusals mean to a client: the role's uid met them on the target."""


def _absolute(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path must not contain NUL")
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is relative; give an absolute path (starting with '/')")
    return value


def _octal(value: str | None) -> str | None:
    if value is not None and (len(value.lstrip("0")) > 3 or int(value, 8) > 0o777):
        raise ValueError("mode takes permission bits only (at most 777); setuid is never set")
    return value


RoleParam = Annotated[
    str,
    Query(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the role to act as (the token must hold it)",
    ),
]
PathParam = Annotated[
    str,
    Query(
        min_length=1,
        max_length=4096,
        description="an absolute path on the target; symlinks are followed as the walk does",
        json_schema_extra={"pattern": r"^/[^\u0000]*$"},
    ),
    AfterValidator(_absolute),
]
ModeParam = Annotated[
    str | None,
    Query(
        pattern=MODE_PATTERN,
        description="octal permission bits, e.g. 0644 (default: a replaced file's own, or 0644)",
    ),
    AfterValidator(_octal),
]


@dataclass(frozen=True)
class Actor:
    """Who asks for a file operation: a role the token holds, and the lease it acts under."""

    role: str
    lease: LeaseRef | None = None
    unnamed: tuple[str, ...] = ()
    """The lease parameters missing when some were given: refused as no lease at all."""


LeaseIdParam = Annotated[
    str | None,
    Query(
        pattern=r"^l-[0-9a-f]{32}$",
        description="the lease this operation acts under (with lease_seat and "
        "lease_generation); refused (stale-lease) unless it is the seat's current one",
    ),
]
LeaseSeatParam = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=256,
        description="the lease's seat",
        json_schema_extra={"pattern": SEAT_TEXT},
    ),
    AfterValidator(lambda seat: seat if seat is None else seat_text(seat)),
]
LeaseGenerationParam = Annotated[int | None, Query(ge=1, description="the lease's generation")]


class LeaseQuery(NamedTuple):
    """The lease a file operation's query names, or which of its parameters are missing."""

    lease: LeaseRef | None
    unnamed: tuple[str, ...] = ()


async def lease_of(
    lease_id: LeaseIdParam = None,
    lease_seat: LeaseSeatParam = None,
    lease_generation: LeaseGenerationParam = None,
) -> LeaseQuery:
    """The lease the query names: all three parameters, or none of them.

    Some without the others is a stale lease (refused, and recorded, as the
    operation starts), not a malformed request: each parameter alone is valid.
    """
    given = {"lease_id": lease_id, "lease_seat": lease_seat, "lease_generation": lease_generation}
    unnamed = tuple(name for name, value in given.items() if value is None)
    if lease_id is None or lease_seat is None or lease_generation is None:
        return LeaseQuery(None, unnamed if len(unnamed) < len(given) else ())
    return LeaseQuery(LeaseRef(lease_id=lease_id, seat=lease_seat, generation=lease_generation))


class HelperRun:
    """One file operation's fence while it runs: the helper's reports, its data, its end."""

    def __init__(self, service: "FileService", plan: FilePlan, role: str) -> None:
        self.service = service
        self.plan = plan
        self.role = role
        self.reports: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._line = b""
        self._stderr = b""
        self.notices: list[str] = []
        self.running: RunningTurn | None = None
        self.outcome: Outcome | None = None
        self.ended: asyncio.Task[None] | None = None
        self.data_reader: asyncio.StreamReader | None = None
        self._data_transport: asyncio.BaseTransport | None = None
        self._data_writer: asyncio.StreamWriter | None = None
        self.facts: dict[str, Any] = {}
        """What the ledger records: grown as the operation goes."""

    async def start(self, direction: Literal["in", "out"]) -> None:
        """Launch the fence, with the data pipe's other end handed to the helper."""
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError):
            # A megabyte in flight, not the default 64 KiB: fewer wake-ups on either side.
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        theirs, ours = (read_end, write_end) if direction == "in" else (write_end, read_end)
        try:
            request = {**self.plan.request, "data_fd": theirs}
            fence = replace(
                self.plan.fence, env={**self.plan.fence.env, REQUEST_VARIABLE: json.dumps(request)}
            )
            manager = self.service.manager
            self.running = await launch_turn(
                manager.bwrap(),
                fence,
                self._emit,
                manager.limiter,
                identity=manager.identity,
                extra_fds=(theirs,),
            )
        except BaseException:
            os.close(ours)
            raise
        finally:
            os.close(theirs)
        self.ended = asyncio.create_task(self._wait())
        loop = asyncio.get_running_loop()
        if direction == "out":
            self.data_reader = asyncio.StreamReader(limit=PIPE_BYTES)
            reader_protocol = asyncio.StreamReaderProtocol(self.data_reader)
            self._data_transport, _ = await loop.connect_read_pipe(
                lambda: reader_protocol, os.fdopen(ours, "rb", 0)
            )
        else:
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, os.fdopen(ours, "wb", 0)
            )
            self._data_writer = asyncio.StreamWriter(transport, protocol, None, loop)

    def _emit(self, kind: str, **fields: Any) -> None:
        # Output comes as the bytes the helper wrote (``raw``): its reports are JSON lines.
        raw = fields.get("raw")
        if kind == "stdout" and isinstance(raw, bytes):
            self._line += raw
            *whole, self._line = self._line.split(b"\n")
            for line in whole:
                with contextlib.suppress(ValueError):
                    report = json.loads(line)
                    if isinstance(report, dict):
                        self.reports.put_nowait(report)
        elif kind == "stderr":
            if isinstance(raw, bytes):
                self._stderr = (self._stderr + raw)[-4096:]
        elif kind == "notice":
            self.notices.append(str(fields.get("message", "")))

    async def _wait(self) -> None:
        running = self.running
        if running is None:
            return
        try:
            self.outcome = await running.wait()
        finally:
            fence = self.plan.fence
            if fence.audit:
                with contextlib.suppress(TargetError):
                    for said in await self.service.manager.identity.audit(
                        fence.role, (fence.uid, fence.gid), fence.audit, fence.turn_id
                    ):
                        log.warning("file operation %s: %s", fence.turn_id, said)
            self.reports.put_nowait(None)
            # After the end is out: removing cgroups waits for their last task to go.
            try:
                await running.cleanup()
            except Exception:
                log.exception("file operation %s: cleaning up after it failed", fence.turn_id)

    async def report(self, *expected: str) -> dict[str, Any]:
        """The helper's next report, if it is one of ``expected``; else the error it means."""
        found = await self.reports.get()
        if found is None:
            self.reports.put_nowait(None)  # the end, for whoever asks next
            raise self._ended_without_report()
        if found.get("event") in expected:
            return found
        raise self.service.failure(self, found)

    def _ended_without_report(self) -> FileOpFailed:
        outcome = self.outcome
        if outcome is not None and outcome.refusal is not None:
            return refused_error(outcome.refusal)
        if outcome is not None and outcome.exit_code == ExitStatus.TIMED_OUT:
            return FileOpFailed(
                408,
                "Took too long",
                f"the file operation ran past role {self.role!r}'s wall_s and was ended; "
                "nothing was written",
            )
        log.error(
            "file operation %s ended without a report (exit %s): %s %s",
            self.plan.fence.turn_id,
            outcome.exit_code if outcome is not None else None,
            " ".join(self.notices),
            self._stderr.decode(errors="replace"),
        )
        return FileOpFailed(
            500, "Internal error", "the file operation failed on the target; its log has details"
        )

    async def feed(self, body: AsyncIterator[bytes], idle_s: float, limit: int) -> int:
        """Send the body to the helper; returns its size. Stops early if the helper has gone
        (its report says why). Over ``limit`` bytes, refused with nothing written; no part
        for ``idle_s``, ended (408)."""
        writer = self._data_writer
        if writer is None:
            raise RuntimeError("feed needs a run started with direction 'in'")
        loop = asyncio.get_running_loop()
        size = 0
        try:
            async with asyncio.timeout(idle_s) as clock:
                async for chunk in body:
                    clock.reschedule(loop.time() + idle_s)
                    size += len(chunk)
                    if size > limit:
                        raise self.service.too_large(self, size, status=413)
                    if writer.is_closing():
                        break  # the helper has gone: its report says why
                    writer.write(chunk)
                    with contextlib.suppress(ConnectionError):
                        await writer.drain()
        except TimeoutError:
            raise FileOpFailed(
                408,
                "Upload stalled",
                f"no part of the body arrived for {idle_s:g} s; nothing was written",
            ) from None
        except ClientDisconnect:
            raise FileOpFailed(
                408, "Upload ended early", "the client went away; nothing was written"
            ) from None
        finally:
            writer.close()
        return size

    async def read_data(self, most: int) -> bytes:
        """All the data the helper sends, at most ``most`` bytes (past that: a failure)."""
        reader = self.data_reader
        if reader is None:
            raise RuntimeError("read_data needs a run started with direction 'out'")
        data = await reader.read(most + 1)
        while len(data) <= most:
            more = await reader.read(most + 1 - len(data))
            if not more:
                return data
            data += more
        raise FileOpFailed(500, "Internal error", "the listing is larger than the target sends")

    async def stream_data(self) -> AsyncIterator[bytes]:
        """The helper's data as it comes, then its ``done``; a client gone kills the fence."""
        reader = self.data_reader
        if reader is None:
            raise RuntimeError("stream_data needs a run started with direction 'out'")
        finished = False
        try:
            while chunk := await reader.read(CHUNK):
                yield chunk
            done = await self.report("done")
            self.facts["size"] = done.get("size")
            finished = True
        finally:
            if not finished:
                self.abandon("the client stopped reading, or the helper failed midway")
            else:
                self.service.finish_soon(self, "done")

    async def commit(self) -> None:
        running = self.running
        if running is not None:
            with contextlib.suppress(OSError):
                await running.write_stdin(b"commit\n", eof=True)

    def abandon(self, why: str) -> None:
        """End the fence now (nothing commits without its word) and record it in the background."""
        if self.running is not None:
            self.running.kill()
        self.facts["abandoned"] = why
        self.service.finish_soon(self, "failed")

    async def close(self) -> Outcome | None:
        """Wait for the fence to end: its stdin and data pipe closed first, so nothing commits
        and nothing blocks; killed if it has not ended after ``CLOSE_WAIT_S``."""
        running = self.running
        if running is not None:
            with contextlib.suppress(OSError):
                await running.write_stdin(b"", eof=True)
        for transport in (self._data_writer, self._data_transport):
            if transport is not None:
                transport.close()
        if self.ended is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.ended), CLOSE_WAIT_S)
            except TimeoutError:
                if running is not None:
                    running.kill()
                await self.ended
        return self.outcome


class FileService:
    """Every file operation of one target; its fences are the turn manager's, counted alike."""

    def __init__(self, manager: TurnManager) -> None:
        self.manager = manager
        self._background: set[asyncio.Task[None]] = set()
        self._active: set[HelperRun] = set()

    # --- the operations ----------------------------------------------------------------

    async def read(self, who: Actor, path: str) -> tuple[dict[str, Any], AsyncIterator[bytes]]:
        """The file's entry as the helper saw it, and its bytes as they come."""
        run = await self._begin("read", who, path, "out")
        ready = await self._ready(run)
        run.facts["size"] = ready.get("size")
        return ready, run.stream_data()

    async def listing(self, who: Actor, path: str, limit: int) -> FileListing:
        run = await self._begin("list", who, path, "out", limit_entries=limit)
        await self._ready(run)
        try:
            data = await run.read_data(MAX_LISTING_BYTES)
            done = await run.report("done")
            listing = FileListing.model_validate_json(data)
        except ValidationError as exc:
            await self._end(run, "failed")
            raise FileOpFailed(500, "Internal error", "the listing came back malformed") from exc
        except BaseException as exc:
            await self._end(run, _outcome_of(exc), **_cause_of(exc))
            raise
        run.facts["entries"] = done.get("entries")
        await self._end(run, "done")
        return listing

    async def read_archive(
        self, who: Actor, path: str
    ) -> tuple[dict[str, Any], AsyncIterator[bytes]]:
        run = await self._begin("archive-read", who, path, "out")
        ready = await self._ready(run)
        run.facts |= {"size": ready.get("size"), "entries": ready.get("entries")}
        return ready, run.stream_data()

    async def write(self, who: Actor, path: str, mode: str | None, request: Request) -> FileWritten:
        """Stream the body into a file at ``path``, committed once it has all arrived."""
        run = await self._begin("write", who, path, "in", mode=mode, request=request)
        done = await self._upload(run, request)
        return FileWritten(
            path=run.plan.resolved,
            size=done["size"],
            mode=done["mode"],
            uid=done["uid"],
            created=done["created"],
        )

    async def write_archive(self, who: Actor, path: str, request: Request) -> ArchiveWritten:
        """Stream a tar into the directory at ``path``: every member or none."""
        run = await self._begin("archive-write", who, path, "in", request=request)
        done = await self._upload(run, request)
        run.facts["entries"] = done.get("entries")
        return ArchiveWritten(
            path=run.plan.resolved,
            entries=done["entries"],
            size=done["size"],
            created=done["created"],
        )

    # --- how each goes -----------------------------------------------------------------

    async def _begin(
        self,
        op: Operation,
        who: Actor,
        path: str,
        direction: Literal["in", "out"],
        *,
        mode: str | None = None,
        limit_entries: int = 0,
        request: Request | None = None,
    ) -> HelperRun:
        """Admit, plan and launch one operation (a refusal is recorded, then raised)."""
        role = who.role
        self.manager.admit(role)
        op_id = f"t-{uuid.uuid4().hex}"
        facts: dict[str, Any] = {"op_id": op_id, "role": role, "op": op, "path": path}
        try:
            if who.unnamed:
                raise RefusedError(
                    refusals.stale_lease(
                        who.unnamed[0],
                        "a lease is named by lease_id, lease_seat and lease_generation together; "
                        f"{', '.join(who.unnamed)} missing",
                    )
                )
            self.manager.leases.admit(role, who.lease)
            plan = await asyncio.to_thread(
                self._plan, op, role, path, op_id, mode=mode, limit_entries=limit_entries
            )
        except RefusedError as refused:
            self.manager.release(role)
            await self._record(facts, "refused", rule=refused.refusal.rule)
            raise refused_error(refused.refusal, missing=isinstance(refused, MissingPath)) from None
        except BaseException:
            self.manager.release(role)
            raise
        run = HelperRun(self, plan, role)
        self._active.add(run)
        run.facts = facts | {"resolved": plan.resolved, "uid": plan.fence.uid}
        declared = _declared_size(request)
        try:
            if declared is not None and declared > plan.limit_bytes:
                raise self.too_large(run, declared, status=413)
            # Again at launch: a seat taken over while it was planned refuses it.
            self.manager.leases.admit(role, who.lease)
            await run.start(direction)
        except RefusedError as refused:
            await self._end(run, "refused", rule=refused.refusal.rule)
            raise refused_error(refused.refusal) from None
        except BaseException as exc:
            await self._end(run, _outcome_of(exc), **_cause_of(exc))
            raise
        return run

    def _plan(self, op: Operation, role: str, path: str, op_id: str, **options: Any) -> FilePlan:
        try:
            etc = str(self.manager.etc.current())
        except OSError as exc:
            raise RefusedError(
                refusals.backend_unavailable(f"could not copy the fence's /etc: {exc}")
            ) from exc
        return plan_file(
            op, role, path, self.manager.settings, op_id, HELPER, etc_dir=etc, **options
        )

    async def _ready(self, run: HelperRun) -> dict[str, Any]:
        try:
            return await run.report("ready")
        except BaseException as exc:
            await self._end(run, _outcome_of(exc), **_cause_of(exc))
            raise

    async def _upload(self, run: HelperRun, request: Request) -> dict[str, Any]:
        """Body in, ``received`` checked against what was sent, then ``commit`` and ``done``."""
        idle = self.manager.settings.server.request_timeout_s
        request.scope[STREAMING] = True
        try:
            await run.report("ready")
            sent = await run.feed(_chunks(request), idle, run.plan.limit_bytes)
            run.facts["size"] = sent
            received = await run.report("received")
            if received.get("size") != sent:
                raise FileOpFailed(
                    500, "Internal error", "the helper did not receive the whole body"
                )
            await run.commit()
            done = await run.report("done")
        except BaseException as exc:
            await self._end(run, _outcome_of(exc), **_cause_of(exc))
            raise
        finally:
            request.scope[STREAMING] = False
        await self._end(run, "done")
        return done

    async def _end(self, run: HelperRun, outcome: str, **facts: Any) -> None:
        """Wait for the fence to end, release its admission, and record it once."""
        if run.facts.get("recorded"):
            return
        run.facts["recorded"] = True
        try:
            await run.close()
        finally:
            self._active.discard(run)
            self.manager.release(run.role)
            facts = {k: v for k, v in run.facts.items() if k != "recorded"} | facts
            await self._record(facts, outcome)

    def finish_soon(self, run: HelperRun, outcome: str) -> None:
        """``_end`` on the event loop, for a stream that may no longer await (it was cancelled)."""
        task = asyncio.create_task(self._end(run, outcome))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record(self, facts: dict[str, Any], outcome: str, **more: Any) -> None:
        record = {**facts, **more, "outcome": outcome, "at": now()}
        try:
            await self.manager.record_in_ledger("file", **record)
        except Exception:
            log.exception("file operation %s: the ledger record failed", facts.get("op_id"))

    async def stop(self) -> None:
        """End every file operation's fence (nothing commits without its word), and let each be
        recorded: the target is stopping."""
        for run in list(self._active):
            if run.running is not None:
                run.running.kill()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # --- what a failure is -------------------------------------------------------------

    def failure(self, run: HelperRun, report: dict[str, Any]) -> FileOpFailed:
        """The error a helper report other than the one awaited means."""
        event = report.get("event")
        if event == "refused":
            rule = str(report.get("rule"))
            run.facts["rule"] = rule
            member = report.get("member")
            why = str(report.get("why"))
            if rule == "file-too-large":
                upload = run.plan.op in ("write", "archive-write")
                return self.too_large(
                    run, int(report.get("size") or 0), status=413 if upload else 403
                )
            if rule == "protected-path" and isinstance(member, str):
                where = os.path.join(run.plan.resolved, member)
                return refused_error(refusals.protected_path("archive", member, where, why))
            return refused_error(refusals.bad_archive(_text(member), why))
        if event == "error":
            code = str(report.get("errno") or "EIO")
            run.facts["errno"] = code
            status, title = _STATUS_OF_ERRNO.get(code, (500, "File operation failed"))
            path = report.get("path") or run.plan.resolved
            detail = (
                f"{path}: {report.get('message')} ({code}, as uid {run.plan.fence.uid}, "
                f"role {run.role!r}); nothing was written"
            )
            return FileOpFailed(status, title, detail, errno=code)
        return FileOpFailed(500, "Internal error", "the file helper answered out of turn")

    def too_large(self, run: HelperRun, size: int, *, status: int) -> FileOpFailed:
        limits = self.manager.settings.roles[run.role].limits
        what = "the body" if run.plan.op in ("write", "archive-write") else "what it names"
        refusal = refusals.file_too_large(what, run.plan.path, size, limits.file_mb, run.role)
        run.facts["rule"] = refusal.rule
        return refused_error(refusal, status=status)


def refused_error(refusal: Refusal, *, missing: bool = False, status: int = 403) -> FileOpFailed:
    """The HTTP error for a refusal: 404 when the path is missing, else ``status``."""
    title = "No such file" if missing else "Refused by the fence"
    return FileOpFailed(404 if missing else status, title, refusal.detail, refusal=refusal)


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, FileOpFailed) and exc.refusal is not None:
        return "refused"
    return "failed"


def _cause_of(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, FileOpFailed):
        return {"rule": exc.refusal.rule} if exc.refusal is not None else {"errno": exc.errno}
    return {"error": type(exc).__name__}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _declared_size(request: Request | None) -> int | None:
    if request is None:
        return None
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


async def _chunks(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


# --- HTTP ----------------------------------------------------------------------------------

_FILE_ERRORS: dict[int, str] = {
    403: "The fence refused it (`refusal`: the same object a refused turn carries), the token "
    "does not hold the role, or the role's uid may not (`errno`).",
    404: "The path (or, for a write, its directory) does not exist (`refusal`, rule `bad-mount`).",
    408: "The body stopped arriving, or the operation ran past the role's `wall_s`; nothing "
    "was written.",
    409: "A directory where a file was named, or the reverse (`errno`).",
    413: "The body, or what an archive unpacks to, is over the role's `file_mb` (`refusal`, "
    "rule `limit-exceeds-role`); nothing was written.",
    507: "The target's disk is full or over quota (`errno`); nothing was written.",
}


def file_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Error responses of the file routes; theirs carry ``refusal`` or ``errno``."""
    found = errors(*(s for s in statuses if s not in _FILE_ERRORS))
    for status in statuses:
        if status in _FILE_ERRORS:
            found[status] = {"model": RefusedProblem, "description": _FILE_ERRORS[status]}
    return found


_BINARY = {"schema": {"type": "string", "format": "binary"}}
_FILE_HEADERS = {
    "X-Paddock-Mode": {
        "description": "the file's permission bits, four octal digits",
        "schema": {"type": "string", "pattern": "^[0-7]{4}$"},
    },
    "X-Paddock-Size": {
        "description": "the file's size in bytes (as Content-Length); for an archive, the "
        "bytes of its regular files",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "Last-Modified": {"description": "the file's mtime", "schema": {"type": "string"}},
}
FILE_OR_LISTING: dict[str, Any] = {
    "description": "The file's bytes (`application/octet-stream`, its size and mode in the "
    "headers); with `list=true`, the listing (`application/json`).",
    "headers": _FILE_HEADERS,
    # application/json: FileListing, added from the route's ``model``.
    "content": {"application/octet-stream": _BINARY},
}
ARCHIVE: dict[str, Any] = {
    "description": "The directory as a tar stream (POSIX pax): its entries named relative to "
    "it; directories, regular files and symlinks.",
    "headers": {"X-Paddock-Size": _FILE_HEADERS["X-Paddock-Size"]},
    "content": {"application/x-tar": _BINARY},
}
FILE_BODY: dict[str, Any] = {
    "required": False,
    "description": "the file's bytes, as they are (any content type)",
    "content": {"application/octet-stream": _BINARY},
}
ARCHIVE_BODY: dict[str, Any] = {
    "required": False,
    "description": "a tar archive (plain or gzip-compressed), its members named relative to "
    "the directory",
    "content": {"application/x-tar": _BINARY},
}


def install(app: FastAPI, service: FileService, roles: Any) -> None:
    """Add the file routes to ``app``; ``roles`` is the app's token dependency (an Annotated)."""

    async def acting(
        held: roles,
        role: RoleParam,
        lease: Annotated[LeaseQuery, Depends(lease_of)],
    ) -> Actor:
        require_role(held, role)
        return Actor(role, lease.lease, lease.unnamed)

    Acting = Annotated[Actor, Depends(acting)]

    @app.get(
        "/v1/files",
        operation_id="readFile",
        summary="Read a file, or list a directory",
        response_model=None,
        responses={
            200: {"model": FileListing, **FILE_OR_LISTING},
            **file_errors(401, 403, 404, 409, 422, 429, 503),
        },
    )
    async def read_file(
        who: Acting,
        path: PathParam,
        list_: Annotated[
            bool, Query(alias="list", description="list the path instead of reading it")
        ] = False,
        limit: Annotated[
            int,
            Query(ge=0, le=MAX_LIST_LIMIT, description="with list: entries at most (0: stat)"),
        ] = DEFAULT_LIST_LIMIT,
    ) -> Response:
        """A file's bytes, streamed; with ``list``, the path's entry and a directory's entries."""
        if list_:
            listing = await service.listing(who, path, limit)
            return JSONResponse(listing.model_dump(mode="json", exclude_none=True))
        ready, chunks = await service.read(who, path)
        headers = {
            "Content-Length": str(ready["size"]),
            "X-Paddock-Size": str(ready["size"]),
            "X-Paddock-Mode": str(ready["mode"]),
            "Last-Modified": email.utils.formatdate(float(ready["mtime"]), usegmt=True),
        }
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

    @app.put(
        "/v1/files",
        operation_id="writeFile",
        summary="Write a file",
        responses=file_errors(401, 403, 404, 408, 409, 413, 422, 429, 503, 507),
        openapi_extra={"requestBody": FILE_BODY},
    )
    async def write_file(
        request: Request,
        who: Acting,
        path: PathParam,
        mode: ModeParam = None,
    ) -> FileWritten:
        """The body becomes the file at ``path``, atomically (all of it, or nothing)."""
        return await service.write(who, path, mode, request)

    @app.get(
        "/v1/archive",
        operation_id="readArchive",
        summary="Fetch a directory as a tar",
        response_class=StreamingResponse,
        responses={200: ARCHIVE, **file_errors(401, 403, 404, 409, 422, 429, 503)},
    )
    async def read_archive(
        who: Acting,
        path: PathParam,
    ) -> Response:
        """The directory at ``path`` as a tar stream."""
        ready, chunks = await service.read_archive(who, path)
        headers = {"X-Paddock-Size": str(ready.get("size", 0))}
        return StreamingResponse(chunks, media_type="application/x-tar", headers=headers)

    @app.put(
        "/v1/archive",
        operation_id="writeArchive",
        summary="Extract a tar into a directory",
        responses=file_errors(401, 403, 404, 408, 409, 413, 422, 429, 503, 507),
        openapi_extra={"requestBody": ARCHIVE_BODY},
    )
    async def write_archive(
        request: Request,
        who: Acting,
        path: PathParam,
    ) -> ArchiveWritten:
        """Every member of the tar into ``path`` (made if missing), or, refused, none."""
        return await service.write_archive(who, path, request)

    @app.exception_handler(FileOpFailed)
    async def file_failed(request: Request, exc: FileOpFailed) -> JSONResponse:
        body = RefusedProblem(
            title=exc.title,
            status=exc.status,
            detail=exc.detail,
            refusal=exc.refusal,
            errno=exc.errno,
        )
        response = JSONResponse(
            body.model_dump(mode="json", exclude_none=True),
            status_code=exc.status,
            media_type=PROBLEM_JSON,
        )
        if request.method == "PUT":
            # The body may not all have been read: this connection cannot carry another request.
            response.headers["Connection"] = "close"
        return response
