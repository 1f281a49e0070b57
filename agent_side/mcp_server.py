"""``paddock mcp``: the target as a Model Context Protocol server, on stdin and stdout.

An agent harness starts ``paddock mcp -t box`` and calls its tools: ``run``,
``read_file``, ``write_file``, ``list_dir``, ``session_start`` and
``session_end``. Each maps onto one call of ``agent_side.api``: one ``Target``,
opened at the first call (a failure to reach it is that call's error, and the
next call tries again) and kept until the server ends. Sessions started here
are ended when it ends (stdin closed, TERM, HUP or INT), and a turn whose call
was cancelled is killed, so nothing is left running.

A refused turn, session or file operation is a result, not an error: it
carries the refusal (rule, subject, path, detail, and all of it in one
sentence as the CLI prints it, the fix in the tools' words), so a model can
change its request. paddock's own failures
(target unreachable, unknown session) are tool errors with paddock's message.
A stream longer than ``OUTPUT_LIMIT`` loses its middle, and the result says how
many bytes went and how to get them.

Stdout is the protocol's: the SDK points file descriptor 1 at stderr while it
serves, and everything paddock says goes to stderr anyway.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Literal, TypeVar

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field

from agent_side.api import RunResult, Submission, Target
from agent_side.connection import opened_target, refuse_with_local, resolve_connection
from agent_side.errors import AgentError, FileRefused, SessionRefused
from agent_side.leases import stored_ref
from agent_side.local import LOCAL_ROLE
from agent_side.sessions import open_session, session_request
from agent_side.turns import new_request
from agent_side.views import refusal_sentence, say
from shared.wire import FileEntry, FileListing, LeaseRef, Refusal, Session, TurnRequest

OUTPUT_LIMIT = 64 * 1024
"""Bytes of each stream a ``run`` result holds; beyond it, the middle is cut."""

READ_LIMIT = 256 * 1024
"""Bytes ``read_file`` returns unless asked for another amount."""

LIST_LIMIT = 1000
"""Entries ``list_dir`` returns unless asked for another number."""

KILL_WAIT_S = 60.0
"""How long a cancelled run waits for its submission's answer, to know which turn to kill."""

TOOL_FIXES: dict[tuple[str, str], str] = {
    ("bad-mount", "cwd"): "create it on the target, or give cwd an existing directory",
    ("limit-exceeds-role", "limits.wall_s"): "give a lower timeout, or none",
}
"""A refusal's fix in the tools' words (``refusal_sentence`` would name the CLI's flags)."""

INSTRUCTIONS = (
    "Runs commands and touches files on a paddock target, each command in a sandbox as the "
    "role's own user. Paths are absolute paths on the target; a command without cwd starts "
    "in the role's workspace (run pwd to learn it). A refused request comes back with a "
    "refusal naming the rule and what to change."
)

_T = TypeVar("_T")


# --- results --------------------------------------------------------------------------------


class RefusalReport(BaseModel):
    """Why the target's fence refused a request, and what to change."""

    rule: str = Field(description="the rule that refused it, e.g. outside-workspace")
    subject: str = Field(description="the request field at fault, e.g. cwd")
    path: str | None = Field(default=None, description="the path as given")
    resolved: str | None = Field(default=None, description="the path as the target resolved it")
    detail: str = Field(description="what is wrong and what to change, in the target's words")
    sentence: str = Field(description="the whole refusal in one sentence")


class RunReport(BaseModel):
    """How a command ended and what it printed."""

    exit_code: int = Field(
        description="the command's own 0..123; 124 timed out, 126 refused, 127 not found, "
        "128+N killed by signal N"
    )
    stdout: str
    stderr: str
    turn_id: str = Field(description="the turn's id on the target (paddock logs TURN)")
    session_id: str | None = Field(default=None, description="the session it ran in, if any")
    refusal: RefusalReport | None = Field(default=None, description="set when it was refused")
    truncated: str | None = Field(
        default=None, description="set when output was cut: how much, and how to get it all"
    )


class FileContent(BaseModel):
    """A file's content, or the part of it asked for."""

    path: str
    content: str = Field(description="the bytes, as text or as base64 (see encoding)")
    encoding: Literal["utf-8", "base64"] = Field(
        description="utf-8: content is the text; base64: the file is not UTF-8 text"
    )
    size: int = Field(description="the whole file's size in bytes")
    offset: int = Field(description="where the returned part starts, in bytes")
    truncated: str | None = Field(
        default=None, description="set when more follows: the offset to ask for next"
    )
    refusal: RefusalReport | None = None


class FileStored(BaseModel):
    """What write_file put in place."""

    path: str = Field(description="where the file is, as the target resolved the path")
    size: int = 0
    mode: str = Field(default="", description="its permission bits, four octal digits")
    created: bool = Field(default=False, description="true if nothing was there before")
    refusal: RefusalReport | None = None


class DirEntry(BaseModel):
    """One entry of a directory, as lstat saw it."""

    name: str
    type: str = Field(description="file, directory, symlink or other")
    size: int
    mode: str
    mtime: str = Field(description="last modified, ISO 8601")
    target: str | None = Field(default=None, description="a symlink's target")


class DirListing(BaseModel):
    """A path's own entry and, for a directory, what it holds."""

    path: str
    entry: DirEntry | None = Field(default=None, description="the path itself")
    entries: list[DirEntry] = Field(default_factory=list, description="sorted by name")
    truncated: bool = Field(default=False, description="more entries exist than were listed")
    refusal: RefusalReport | None = None


class SessionReport(BaseModel):
    """A session: one sandbox and one shell, for the runs that name it."""

    session_id: str | None = Field(default=None, description="pass it to run as session")
    state: str = Field(description="open, refused, closed or lost")
    cwd: str | None = Field(default=None, description="where its shell started")
    ended: str | None = Field(default=None, description="why it ended, once it has")
    refusal: RefusalReport | None = None


# --- the target, open for the server's life -------------------------------------------------


class Remote:
    """The one target the tools act on: opened at the first call, closed when the server ends."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self.local = bool(args.local)
        self._exits = contextlib.ExitStack()
        self._open = lambda: self._under(self._exits.enter_context(opened_target(args, environ)))
        self._lease = _lease(args.lease, environ)
        self._target: Target | None = None
        self._opening = anyio.Lock()
        self._sessions: set[str] = set()
        """Sessions started here: ended when the server ends."""
        self._running = 0
        """Runs not yet over: a cancelled one still has its turn to kill."""
        self._closed = False

    def _under(self, target: Target) -> Target:
        target.act_under(self._lease)
        return target

    async def target(self) -> Target:
        # One opening at a time: two first calls must not start two embedded targets.
        async with self._opening:
            if self._target is None:
                self._target = await anyio.to_thread.run_sync(self._open)
            return self._target

    async def call(self, function: Callable[[Target], _T]) -> _T:
        """``function(target)`` on a worker thread: the Target API blocks."""
        target = await self.target()
        return await anyio.to_thread.run_sync(function, target)

    async def run(self, request: Callable[[str], TurnRequest]) -> RunResult:
        """Run the turn ``request(role)`` builds; cancelling the call kills the turn."""
        target = await self.target()
        turn = request(await anyio.to_thread.run_sync(lambda: target.role))
        submission = Submission()

        def wait() -> RunResult:
            try:
                return target.run_request(turn, on_submitted=submission.submitted)
            finally:
                submission.settle()

        self._running += 1
        try:
            return await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(submission.kill, target)
            raise
        finally:
            self._running -= 1

    def opened(self, session_id: str) -> None:
        self._sessions.add(session_id)

    def ended(self, session_id: str) -> None:
        self._sessions.discard(session_id)

    async def close(self) -> None:
        """End the sessions started here, then close the target (and an embedded one's server).

        Runs cancelled by the end kill their turns first: the target stays open until they have.
        """
        with anyio.CancelScope(shield=True):
            if self._closed:
                return
            self._closed = True
            with anyio.move_on_after(KILL_WAIT_S):
                while self._running:
                    await anyio.sleep(0.05)
            if self._sessions:
                async with anyio.create_task_group() as tasks:
                    for session_id in sorted(self._sessions):
                        tasks.start_soon(self._end_quietly, session_id)
            self._target = None
            await anyio.to_thread.run_sync(self._exits.close)

    async def _end_quietly(self, session_id: str) -> None:
        try:
            await self.call(lambda target: target.client.end_session(session_id))
        except AgentError as exc:
            say(f"could not end session {session_id}: {exc.label}: {exc}")
        self.ended(session_id)


@contextlib.contextmanager
def paddock_failures() -> Iterator[None]:
    """paddock's own failures, as tool errors the model reads (never a crash of the server)."""
    try:
        yield
    except AgentError as exc:
        raise ToolError(f"{exc.label}: {exc}") from exc


# --- the tools ------------------------------------------------------------------------------

Command = Annotated[
    list[str] | str,
    Field(
        description="a list runs as one program with its arguments (found on the target's "
        "PATH); a string is bash code (pipes, &&, redirections)"
    ),
]
Cwd = Annotated[
    str | None,
    Field(description="absolute working directory on the target; default: the role's workspace"),
]
Env = Annotated[dict[str, str] | None, Field(description="environment variables to set")]
Timeout = Annotated[
    float | None,
    Field(gt=0, description="seconds before the command is killed (exit 124); default: the role's"),
]
SessionId = Annotated[
    str | None,
    Field(
        description="run in this session's shell (from session_start); cwd and env are then "
        "the session's"
    ),
]
TargetPath = Annotated[str, Field(description="absolute path on the target")]


class Tools:
    """The tools, each a method: its docstring and parameters are what the model sees."""

    def __init__(self, remote: Remote) -> None:
        self._remote = remote

    async def run(
        self,
        command: Command,
        cwd: Cwd = None,
        env: Env = None,
        timeout: Timeout = None,
        session: SessionId = None,
    ) -> RunReport:
        """Run a command on the target in a fresh sandbox (or in a session's shell) and wait
        for it. Returns its exit code, stdout and stderr (each cut in the middle past 64 KiB,
        with a note); a refused command returns the refusal: the rule and what to change."""
        if session is not None and (cwd is not None or env):
            raise ToolError(
                "a session's commands run in its own directory and environment: leave out "
                "cwd and env, and cd or export in the session instead"
            )

        def request(role: str) -> TurnRequest:
            script = command if isinstance(command, str) else None
            argv = [] if isinstance(command, str) else command
            return new_request(
                role=role,
                argv=argv,
                script=script,
                cwd=cwd,
                env=env,
                wall_s=timeout,
                session=session,
            )

        with paddock_failures():
            result = await self._remote.run(request)
        return run_report(result, session, local=self._remote.local)

    async def read_file(
        self,
        path: TargetPath,
        offset: Annotated[int, Field(ge=0, description="byte to start at")] = 0,
        limit: Annotated[int, Field(ge=1, description="most bytes to return")] = READ_LIMIT,
    ) -> FileContent:
        """Read a file on the target, as the role's user. UTF-8 text comes back as text,
        anything else as base64 (encoding says which). Past `limit` bytes, `truncated` gives
        the offset to read on from."""
        with paddock_failures():
            try:
                data = await self._remote.call(lambda target: target.read_file(path))
            except FileRefused as exc:
                refusal = refusal_report(exc.refusal)
                return FileContent(
                    path=path, content="", encoding="utf-8", size=0, offset=0, refusal=refusal
                )
        return file_content(path, data, offset, limit)

    async def write_file(
        self,
        path: TargetPath,
        content: Annotated[str, Field(description="the file's whole new content")],
        encoding: Annotated[
            Literal["utf-8", "base64"],
            Field(description="base64 for binary content: it is decoded before writing"),
        ] = "utf-8",
        mode: Annotated[
            str | None,
            Field(
                pattern=r"^0?[0-7]{3}$",
                description="octal permission bits, e.g. 0755; default: a replaced file "
                "keeps its own, a new one gets 0644",
            ),
        ] = None,
    ) -> FileStored:
        """Write a whole file on the target, as the role's user: all of it or nothing. Its
        directory must exist."""
        data = decoded(content, encoding)
        bits = None if mode is None else int(mode, 8)
        with paddock_failures():
            try:
                written = await self._remote.call(
                    lambda target: target.write_file(path, data, mode=bits)
                )
            except FileRefused as exc:
                return FileStored(path=path, refusal=refusal_report(exc.refusal))
        return FileStored(
            path=written.path, size=written.size, mode=written.mode, created=written.created
        )

    async def list_dir(
        self,
        path: TargetPath,
        limit: Annotated[int, Field(ge=1, description="most entries to return")] = LIST_LIMIT,
    ) -> DirListing:
        """List a directory on the target (name, type, size, mode, mtime of each entry), or
        describe a single file."""
        with paddock_failures():
            try:
                listing = await self._remote.call(lambda target: target.list_dir(path, limit=limit))
            except FileRefused as exc:
                return DirListing(path=path, refusal=refusal_report(exc.refusal))
        return dir_listing(listing)

    async def session_start(
        self,
        cwd: Annotated[
            str | None,
            Field(description="absolute directory the shell starts in; default: the workspace"),
        ] = None,
        env: Env = None,
        timeout: Annotated[
            float | None,
            Field(gt=0, description="each command's time limit in seconds; default: the role's"),
        ] = None,
        idle: Annotated[
            float | None, Field(gt=0, description="end the session after this many idle seconds")
        ] = None,
        lifetime: Annotated[
            float | None, Field(gt=0, description="end the session this many seconds after start")
        ] = None,
    ) -> SessionReport:
        """Start a session: one sandbox with one bash shell, for many run calls that pass its
        session_id. cd, export, shell functions and background jobs last from one run to the
        next. It is ended by session_end, by its idle or lifetime limit, or when this server
        stops."""

        def start(target: Target) -> Session:
            request = session_request(
                role=target.role,
                cwd=cwd,
                env=env,
                timeout=timeout,
                idle_s=idle,
                lifetime_s=lifetime,
            )
            session = open_session(target, target.with_lease(request))
            # Noted on this thread, so a server ending meanwhile still ends the session.
            self._remote.opened(session.session_id)
            return session

        with paddock_failures():
            try:
                return session_report(await self._remote.call(start))
            except SessionRefused as exc:
                return SessionReport(state="refused", refusal=refusal_report(exc.refusal))

    async def session_end(
        self, session_id: Annotated[str, Field(description="the id session_start returned")]
    ) -> SessionReport:
        """End a session: everything still running in it is killed."""
        with paddock_failures():
            session = await self._remote.call(lambda target: target.client.end_session(session_id))
        self._remote.ended(session_id)
        return session_report(session)


def build_server(remote: Remote) -> MCPServer:
    """The MCP server whose tools act on ``remote``."""
    from shared import __version__

    # WARNING: at INFO the SDK (and httpx under it) would log every call on stderr.
    server: MCPServer = MCPServer(
        "paddock", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING"
    )
    tools = Tools(remote)
    for tool in (
        tools.run,
        tools.read_file,
        tools.write_file,
        tools.list_dir,
        tools.session_start,
        tools.session_end,
    ):
        server.add_tool(tool)
    return server


# --- results from what the API returned -----------------------------------------------------


def refusal_report(refusal: Refusal) -> RefusalReport:
    return RefusalReport(
        rule=refusal.rule,
        subject=refusal.subject,
        path=refusal.path,
        resolved=refusal.resolved,
        detail=refusal.detail,
        sentence=refusal_sentence(refusal, TOOL_FIXES),
    )


def run_report(result: RunResult, session: str | None, *, local: bool) -> RunReport:
    stdout, stdout_cut = clipped(result.stdout)
    stderr, stderr_cut = clipped(result.stderr)
    turn_id = result.turn.turn_id
    note = None
    if stdout_cut or stderr_cut:
        note = truncation_note({"stdout": stdout_cut, "stderr": stderr_cut}, turn_id, local=local)
    return RunReport(
        exit_code=result.exit_code,
        stdout=stdout,
        stderr=stderr,
        turn_id=turn_id,
        session_id=session,
        refusal=None if result.refusal is None else refusal_report(result.refusal),
        truncated=note,
    )


def clipped(data: bytes, limit: int = OUTPUT_LIMIT) -> tuple[str, int]:
    """``data`` as text, its middle cut out past ``limit`` bytes; and how many bytes were cut.

    The middle goes because a command's first lines say what it set out to do and its last
    ones how it ended.
    """
    if len(data) <= limit:
        return data.decode(errors="replace"), 0
    half = limit // 2
    cut = len(data) - 2 * half
    head = data[:half].decode(errors="replace")
    tail = data[-half:].decode(errors="replace")
    return f"{head}\n[... {cut} bytes cut here ...]\n{tail}", cut


def truncation_note(cuts: Mapping[str, int], turn_id: str, *, local: bool) -> str:
    parts = [f"{count} bytes of {stream}" for stream, count in cuts.items() if count]
    kept = OUTPUT_LIMIT // 2 // 1024
    note = (
        f"{' and '.join(parts)} cut from the middle (the first and last {kept} KiB of each "
        "stream are kept). For all of it, run the command again with its output redirected "
        "to a file (> out.log 2>&1) and read_file that file"
    )
    if local:
        return note + "."
    return note + f", or run `paddock logs {turn_id}` where this server runs."


def file_content(path: str, data: bytes, offset: int, limit: int) -> FileContent:
    """The part of ``data`` from ``offset``, at most ``limit`` bytes, as text if it is text."""
    try:
        data.decode()
        text = True
    except UnicodeDecodeError:
        text = False
    end = min(len(data), offset + limit)
    if text:
        # Back off to a character's first byte, so the next part starts on one.
        while offset < end < len(data) and data[end] & 0xC0 == 0x80:
            end -= 1
    part = data[offset:end]
    content = part.decode(errors="replace") if text else base64.b64encode(part).decode()
    more = len(data) - end
    return FileContent(
        path=path,
        content=content,
        encoding="utf-8" if text else "base64",
        size=len(data),
        offset=offset,
        truncated=f"{more} more bytes: call read_file with offset={end}" if more > 0 else None,
    )


def decoded(content: str, encoding: str) -> bytes:
    if encoding == "utf-8":
        return content.encode()
    try:
        return base64.b64decode(content, validate=True)
    except binascii.Error as exc:
        raise ToolError(f"content is not valid base64: {exc}") from exc


def dir_listing(listing: FileListing) -> DirListing:
    return DirListing(
        path=listing.path,
        entry=dir_entry(listing.entry),
        entries=[dir_entry(entry) for entry in listing.entries],
        truncated=listing.truncated,
    )


def dir_entry(entry: FileEntry) -> DirEntry:
    return DirEntry(
        name=entry.name,
        type=entry.type,
        size=entry.size,
        mode=entry.mode,
        mtime=entry.mtime.isoformat(),
        target=entry.target,
    )


def session_report(session: Session) -> SessionReport:
    return SessionReport(
        session_id=session.session_id,
        state=session.state,
        cwd=session.cwd,
        ended=session.ended,
        refusal=None if session.refusal is None else refusal_report(session.refusal),
    )


# --- the command ----------------------------------------------------------------------------


def _lease(lease_id: str | None, environ: Mapping[str, str]) -> LeaseRef | None:
    """The lease ``--lease ID`` names, as ``paddock lease take`` kept it (read before serving)."""
    if not lease_id:
        return None
    lease_id, seat, generation = stored_ref(lease_id, environ)
    return LeaseRef(lease_id=lease_id, seat=seat, generation=generation)


def serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """``paddock mcp``: serve the tools on stdio until stdin closes; 0.

    The command line is checked before serving, so a harness sees a usage error
    at once; the target itself is reached at the first call.
    """
    if args.local:
        refuse_with_local(args, LOCAL_ROLE)
    else:
        resolve_connection(args, environ)
    remote = Remote(args, environ)
    anyio.run(functools.partial(_serve, build_server(remote), remote))
    return 0


async def _serve(server: MCPServer, remote: Remote) -> None:
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_stop_on_signal, tasks.cancel_scope, remote)
            await server.run_stdio_async()
            tasks.cancel_scope.cancel()
    finally:
        await remote.close()


async def _stop_on_signal(scope: anyio.CancelScope, remote: Remote) -> None:
    """TERM, HUP or INT end the server as a closed stdin does: sessions ended, turns killed.

    The SDK reads stdin on a worker thread that no cancellation reaches, so while stdin
    stays open the server cannot unwind: once its calls are cancelled and the target is
    closed, the process leaves at once, with 128 + the signal's number.
    """
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP, signal.SIGINT) as signals:
        number = await anext(signals)
    say(f"mcp: {signal.Signals(number).name}: ending the sessions started here")
    scope.cancel()
    await remote.close()
    sys.stderr.flush()
    os._exit(128 + number)
