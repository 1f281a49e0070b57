"""Running turns from Python: what ``paddock run`` does, as a library.

    from agent_side import Target

    with Target.ssh("ci@build-host", token=token) as target:      # one SSH connection
        result = target.run(["make", "test"], cwd="/srv/work/repo")
        result.exit_code, result.stdout, result.stderr, result.refusal

    with Target.https("https://build-host:8443", token=token, cacert="ca.pem") as target:
        ...

    async with AsyncTarget.ssh("ci@build-host", token=token) as target:
        result = await target.run(["make"])

``exit_code`` follows docs/design.md ("Exit statuses") as the CLI's status does (124 timed out,
126 refused, 127 not found, 128+N signal). Where the CLI would exit 125,
``run`` raises the ``AgentError`` instead: paddock failed, not the command.

Turns run as ``role=`` when given, else as the only role the token holds (the
target is asked once, ``GET /v1/roles``); a token holding several must name one.
Over SSH, an HTTPS listener's certificate is checked against ``cacert`` when
given, else against the CA the target host keeps at ``remote_cacert`` (where
``paddock deploy`` puts it), read over the SSH connection already verified.

``with target.lease(seat, ttl_s=60) as held:`` takes a lease on a seat (by
default the role's first workspace), renews it in the background, and
releases it at the end; every turn the target runs meanwhile carries it, so
the target refuses them once a newer holder has superseded it
(``held.lost`` then says so).

With ``cursors=CursorStore.for_user(os.environ, url)`` a ``Target`` records,
per turn, the last event handed to ``on_event`` (once the callback returned),
as ``paddock run`` does for what it prints; ``attach(turn_id)`` goes on from
there in a later process, even after this one was killed.

The async flavour runs the same synchronous client on worker threads. paramiko
is blocking and runs its own thread per connection, so an asyncio network
backend would still end in blocking channel calls; sharing one implementation
keeps resume, idempotent submission and exit statuses identical in both.
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TypeVar

import httpx

from agent_side.client import DEFAULT_TIMEOUT, TargetClient, pinned_tls_context, tls_context
from agent_side.cursors import Cursor, CursorStore
from agent_side.defaults import DEFAULT_SSH_TARGET, REMOTE_CA
from agent_side.errors import AgentError, UsageError
from agent_side.leases import HeldLease
from agent_side.turns import Finished, drive, follow_turn, new_request, output_bytes, sole_role
from shared.net import is_loopback
from shared.wire import (
    ArchiveWritten,
    Event,
    FileListing,
    FileWritten,
    Health,
    LeaseRef,
    OutputEvent,
    Refusal,
    SessionRequest,
    Turn,
    TurnRequest,
)

if TYPE_CHECKING:
    # paramiko is imported only when an SSH target is opened: it adds about a
    # third of a second to the start of every paddock command that never uses it.
    from agent_side.files import Acting
    from agent_side.sessions import AsyncTargetSession, TargetSession
    from agent_side.ssh import PassphraseSource, SshConnection, SshTimeouts

CANCEL_WAIT_S = 60.0
"""How long a cancelled run waits for its submission's answer, to know which turn to kill."""

_T = TypeVar("_T")
_Leased = TypeVar("_Leased", TurnRequest, SessionRequest)


@dataclass(frozen=True)
class RunResult:
    """How a turn ended: its status, its whole output, and the target's record of it."""

    exit_code: int
    stdout: bytes = field(repr=False)
    stderr: bytes = field(repr=False)
    turn: Turn
    refusal: Refusal | None
    """Why the fence refused the turn (``exit_code`` 126, or 127 for not-found), else None."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Target:
    """A paddock target, reached over HTTPS or through one SSH connection.

    Every turn and request of this object shares one HTTP connection pool, and
    for ``ssh`` one SSH connection under it: no turn pays a handshake.
    Thread-safe; use as a context manager, or ``close()`` it.
    """

    def __init__(
        self,
        client: TargetClient,
        *,
        role: str | None = None,
        ssh: SshConnection | None = None,
        cursors: CursorStore | None = None,
    ) -> None:
        self._client = client
        self._role = role
        self._ssh = ssh
        self._cursors = cursors
        self._held: HeldLease | None = None
        self._named: LeaseRef | None = None

    @classmethod
    def https(
        cls,
        url: str,
        *,
        token: str | None,
        cacert: str | None = None,
        role: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        cursors: CursorStore | None = None,
    ) -> Target:
        """The target listening at ``url`` (``https://``, or ``http://`` on loopback only)."""
        client = TargetClient(url, token, cacert=cacert, timeout=timeout)
        return cls(client, role=role, cursors=cursors)

    @classmethod
    def ssh(
        cls,
        destination: str,
        *,
        token: str | None,
        url: str = DEFAULT_SSH_TARGET,
        cacert: str | None = None,
        remote_cacert: str | None = REMOTE_CA,
        role: str | None = None,
        identity_files: Sequence[str] = (),
        known_hosts: Sequence[str] = (),
        passphrase: str | PassphraseSource | None = None,
        ssh_config: str | None = "~/.ssh/config",
        use_agent: bool = True,
        timeouts: SshTimeouts | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        cursors: CursorStore | None = None,
    ) -> Target:
        """The target whose listener is ``url`` as seen from the SSH server ``destination``.

        ``destination`` is ``[USER@]HOST[:PORT]``, HOST possibly an alias from
        ``ssh_config``. Connects at once, so an unknown host, a changed host key
        or rejected keys are raised here, before any turn.

        An ``https`` listener is checked against ``cacert`` if given, else
        against the PEM file ``remote_cacert`` on the SSH host, read through
        this connection; where that file does not exist (or ``remote_cacert``
        is None), against the system's CAs.
        """
        from agent_side.ssh import Destination, SshConnection, SshOptions, SshTimeouts, resolve
        from agent_side.tunnel import SshTransport

        scheme = _checked_ssh_url(url).scheme
        options = SshOptions(
            identity_files=tuple(identity_files),
            known_hosts=tuple(known_hosts),
            ssh_config=ssh_config,
            use_agent=use_agent,
            passphrase=_passphrase_source(passphrase),
            timeouts=timeouts or SshTimeouts(),
        )
        connection = SshConnection(resolve(Destination.parse(destination), options), options)
        connection.connect()
        try:
            context = None
            if scheme == "https":
                context = _ssh_tls_context(connection, cacert, remote_cacert)
            transport = SshTransport(connection, ssl_context=context)
            client = TargetClient(
                url,
                token,
                transport=transport,
                timeout=timeout,
                probe_backend=transport.network_backend,
            )
        except BaseException:
            connection.close()
            raise
        return cls(client, role=role, ssh=connection, cursors=cursors)

    @property
    def role(self) -> str:
        """The role turns run as unless ``run`` names another.

        The one given, else the only role the token holds (the target is asked
        once); a ``UsageError`` naming the choices when it holds several.
        """
        if self._role is None:
            self._role = sole_role(self._client)
        return self._role

    @property
    def client(self) -> TargetClient:
        """The API client underneath, for what ``run`` does not cover (signals, events)."""
        return self._client

    @property
    def ssh_connection(self) -> SshConnection | None:
        """The SSH connection every request goes through, or None over HTTPS."""
        return self._ssh

    def __repr__(self) -> str:
        via = f" via {self._ssh.endpoint}" if self._ssh is not None else ""
        return f"Target({self._client.base_url!r}{via}, role={self._role!r})"

    def health(self) -> Health:
        """The target's health (no token needed)."""
        return self._client.health()

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        read: Sequence[str] = (),
        write: Sequence[str] = (),
        network: bool = False,
        timeout: float | None = None,
        role: str | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> RunResult:
        """Run ``argv`` as one turn and wait for it; paths are absolute paths on the target.

        ``on_event`` sees every event once, as it arrives (output included).
        """
        request = new_request(
            role=role or self.role,
            argv=argv,
            cwd=cwd,
            env=env,
            read=read,
            write=write,
            network=network,
            wall_s=timeout,
        )
        return self.run_request(request, on_event=on_event)

    def lease(
        self,
        seat: str | None = None,
        ttl_s: float = 60.0,
        *,
        supersede: bool = False,
        role: str | None = None,
    ) -> HeldLease:
        """Take a lease on ``seat``, renewed in the background; turns run meanwhile carry it.

        Use as a context manager (leaving it releases the lease). ``SeatTaken``
        while another lease holds the seat, unless ``supersede``.
        """
        if self._held is not None:
            raise UsageError(
                f"this Target already holds lease {self._held.lease.lease_id}; release it "
                "first, or open another Target for a second seat"
            )
        lease = self._client.take_lease(role or self.role, seat, ttl_s, supersede=supersede)
        self._held = HeldLease(self._client, lease, on_close=self._lease_closed)
        return self._held.start()

    def _lease_closed(self, held: HeldLease) -> None:
        if self._held is held:
            self._held = None

    def act_under(self, lease: LeaseRef | None) -> None:
        """Name ``lease``, taken elsewhere (``paddock lease take``) and not renewed here, in
        every request that names none, as a lease held here is; ``None`` stops."""
        self._named = lease

    def lease_for(self, role: str) -> LeaseRef | None:
        """The lease a request of ``role`` naming none acts under: the one held here for that
        role, else the one ``act_under`` named (the target refuses it for another role)."""
        held = self._held
        if held is not None and held.lease.role == role:
            return held.ref
        return self._named

    def session(
        self,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        read: Sequence[str] = (),
        write: Sequence[str] = (),
        network: bool = False,
        timeout: float | None = None,
        idle_s: float | None = None,
        lifetime_s: float | None = None,
        role: str | None = None,
    ) -> TargetSession:
        """Start a session (one fence, one shell) and return it; ``with`` ends it on leaving.

        The fence is planned as ``run`` with the same arguments would be, and
        a refusal raises ``SessionRefused`` (its ``refusal`` says why).
        ``timeout`` is each turn's wall-time limit unless it asks for less;
        ``idle_s`` and ``lifetime_s`` end the session (at most the role's).
        agent_side/sessions.py shows it in use.
        """
        from agent_side.sessions import TargetSession, open_session, session_request

        request = session_request(
            role=role or self.role,
            cwd=cwd,
            env=env,
            read=read,
            write=write,
            network=network,
            timeout=timeout,
            idle_s=idle_s,
            lifetime_s=lifetime_s,
        )
        return TargetSession(self, open_session(self, self.with_lease(request)))

    def with_lease(self, request: _Leased) -> _Leased:
        """``request``, carrying the lease its role acts under here (``lease_for``) if it
        names none."""
        lease = self.lease_for(request.role) if request.lease is None else None
        return request if lease is None else request.model_copy(update={"lease": lease})

    def run_request(
        self,
        request: TurnRequest,
        *,
        on_event: Callable[[Event], None] | None = None,
        on_submitted: Callable[[str], None] | None = None,
    ) -> RunResult:
        """Run a prepared ``TurnRequest``; ``on_submitted`` gets the turn id once it exists.

        A request naming no lease carries the one this target holds for its role, if any.
        """
        request = self.with_lease(request)
        output = _Collector(on_event)

        def submitted(turn_id: str) -> None:
            if self._cursors is not None:
                output.cursor = self._cursors.open(turn_id)
            if on_submitted is not None:
                on_submitted(turn_id)

        with output:
            finished = drive(self._client, request, output.event, submitted)
        return output.result(finished)

    def attach(
        self,
        turn_id: str,
        *,
        from_start: bool = False,
        on_event: Callable[[Event], None] | None = None,
    ) -> RunResult:
        """Wait for a turn that already runs, from the last event delivered before.

        With ``cursors``, that is the last event any earlier ``run``, ``attach``
        or paddock command handed over for this turn; without, or with
        ``from_start``, the first. ``stdout`` and ``stderr`` hold what this call
        delivered.
        """
        after = 0
        output = _Collector(on_event)
        if self._cursors is not None:
            after = 0 if from_start else self._cursors.last_delivered(turn_id)
            output.cursor = self._cursors.open(turn_id, start=after)
        with output:
            finished = follow_turn(self._client, turn_id, output.event, after=after)
        return output.result(finished)

    # --- files (docs/api.md, "Files"): done on the target as the role's uid -----------------

    def acting(self, role: str | None = None) -> Acting:
        """Who a file operation is done as: ``role`` (default: this target's), under the lease
        this target holds for it, if any."""
        from agent_side.files import Acting

        role = role or self.role
        return Acting(role, self.lease_for(role))

    def read_file(self, path: str, *, role: str | None = None) -> bytes:
        """The whole file at ``path`` on the target.

        ``FileRefused`` when the fence's rules refuse it, ``FileFailed`` when the
        target says no to the role's uid (404 missing, 403 permission, 409 a directory).
        """
        from agent_side import files  # tarfile: loaded by those who copy

        return files.read_file(self._client, self.acting(role), path)

    def write_file(
        self,
        path: str,
        data: bytes | IO[bytes],
        *,
        mode: int | None = None,
        role: str | None = None,
    ) -> FileWritten:
        """Make ``data`` (bytes, or a binary file read to its end) the file at ``path``, all or
        nothing. ``mode``: permission bits; without, a replaced file keeps its own, else 0644."""
        from agent_side import files  # tarfile: loaded by those who copy

        return files.write_file(self._client, self.acting(role), path, data, mode)

    def list_dir(self, path: str, *, limit: int = 10_000, role: str | None = None) -> FileListing:
        """``path``'s own entry (``.entry``) and, for a directory, its entries (``.entries``,
        sorted, at most ``limit``; ``.truncated`` if there were more)."""
        from agent_side import files  # tarfile: loaded by those who copy

        return files.list_dir(self._client, self.acting(role), path, limit)

    def get_dir(self, path: str, local_dir: str, *, role: str | None = None) -> int:
        """Fetch the directory ``path`` into the local ``local_dir`` (made if missing, merged
        into if not); returns how many entries came."""
        from agent_side import files  # tarfile: loaded by those who copy

        return files.get_dir(self._client, self.acting(role), path, local_dir)

    def put_dir(self, local_dir: str, path: str, *, role: str | None = None) -> ArchiveWritten:
        """Send the local directory ``local_dir`` into ``path`` on the target (made if missing,
        merged into if not): every entry, or (refused) none."""
        from agent_side import files  # tarfile: loaded by those who copy

        return files.put_dir(self._client, self.acting(role), local_dir, path)

    def close(self) -> None:
        """Release a lease still held, close the HTTP pool, then the SSH connection under it."""
        try:
            if self._held is not None:
                self._held.close()
            self._client.close()
        finally:
            if self._ssh is not None:
                self._ssh.close()

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncTarget:
    """``Target`` for asyncio code: the same client, driven from worker threads.

    Opens on ``async with`` (or ``await open()``). Turns run concurrently, up to
    ``max_concurrent_turns`` at once. Cancelling a ``run`` kills its turn on the
    target (KILL), so nothing keeps running that nobody waits for; ``on_event``
    is called on a worker thread.
    """

    def __init__(self, opener: Callable[[], Target], *, max_concurrent_turns: int = 16) -> None:
        # asyncio and its executors are loaded only by code that uses them: the
        # ``paddock`` command imports this module and never does.
        import concurrent.futures

        self._opener = opener
        self._target: Target | None = None
        # Its own threads: asyncio's default executor has only cpu_count + 4 of them.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrent_turns + 1, thread_name_prefix="paddock-async"
        )

    @classmethod
    def https(cls, url: str, **options: Any) -> AsyncTarget:
        """Like ``Target.https`` (same options); connects on entering."""
        return cls(functools.partial(Target.https, url, **options))

    @classmethod
    def ssh(cls, destination: str, **options: Any) -> AsyncTarget:
        """Like ``Target.ssh`` (same options); the SSH connection is made on entering."""
        return cls(functools.partial(Target.ssh, destination, **options))

    @property
    def target(self) -> Target:
        """The synchronous ``Target`` underneath (once open)."""
        if self._target is None:
            raise RuntimeError("this AsyncTarget is not open; use 'async with' or 'await open()'")
        return self._target

    async def open(self) -> AsyncTarget:
        if self._target is None:
            self._target = await self._call(self._opener)
        return self

    async def health(self) -> Health:
        return await self._call(self.target.health)

    async def lease(
        self,
        seat: str | None = None,
        ttl_s: float = 60.0,
        *,
        supersede: bool = False,
        role: str | None = None,
    ) -> HeldLease:
        """Like ``Target.lease``, awaited: ``async with await target.lease(seat) as held:``."""
        take = functools.partial(self.target.lease, seat, ttl_s, supersede=supersede, role=role)
        return await self._call(take)

    async def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        read: Sequence[str] = (),
        write: Sequence[str] = (),
        network: bool = False,
        timeout: float | None = None,
        role: str | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> RunResult:
        """Like ``Target.run``, awaited; cancelling it kills the turn."""
        target = self.target
        # Asking the target for the role is a request: not on the event loop.
        if not role:
            role = await self._call(_role_of, target)
        request = new_request(
            role=role,
            argv=argv,
            cwd=cwd,
            env=env,
            read=read,
            write=write,
            network=network,
            wall_s=timeout,
        )
        return await self.run_request(request, on_event=on_event)

    async def run_request(
        self, request: TurnRequest, *, on_event: Callable[[Event], None] | None = None
    ) -> RunResult:
        """Like ``Target.run_request``, awaited; cancelling it kills the turn."""
        import asyncio

        target = self.target
        submission = Submission()
        work = self._pool.submit(
            target.run_request, request, on_event=on_event, on_submitted=submission.submitted
        )
        work.add_done_callback(lambda _: submission.settle())
        try:
            return await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            await asyncio.shield(self._call(submission.kill, target))
            raise

    async def read_file(self, path: str, *, role: str | None = None) -> bytes:
        """Like ``Target.read_file``, awaited."""
        return await self._call(functools.partial(self.target.read_file, path, role=role))

    async def write_file(
        self,
        path: str,
        data: bytes | IO[bytes],
        *,
        mode: int | None = None,
        role: str | None = None,
    ) -> FileWritten:
        """Like ``Target.write_file``, awaited."""
        write = functools.partial(self.target.write_file, path, data, mode=mode, role=role)
        return await self._call(write)

    async def list_dir(
        self, path: str, *, limit: int = 10_000, role: str | None = None
    ) -> FileListing:
        """Like ``Target.list_dir``, awaited."""
        listing = functools.partial(self.target.list_dir, path, limit=limit, role=role)
        return await self._call(listing)

    async def get_dir(self, path: str, local_dir: str, *, role: str | None = None) -> int:
        """Like ``Target.get_dir``, awaited."""
        return await self._call(functools.partial(self.target.get_dir, path, local_dir, role=role))

    async def put_dir(
        self, local_dir: str, path: str, *, role: str | None = None
    ) -> ArchiveWritten:
        """Like ``Target.put_dir``, awaited."""
        return await self._call(functools.partial(self.target.put_dir, local_dir, path, role=role))

    def session(
        self,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        read: Sequence[str] = (),
        write: Sequence[str] = (),
        network: bool = False,
        timeout: float | None = None,
        idle_s: float | None = None,
        lifetime_s: float | None = None,
        role: str | None = None,
    ) -> AsyncTargetSession:
        """Like ``Target.session``; the session starts on ``async with`` (or ``await open()``)."""
        from agent_side.sessions import AsyncTargetSession

        options = {
            "cwd": cwd,
            "env": env,
            "read": read,
            "write": write,
            "network": network,
            "timeout": timeout,
            "idle_s": idle_s,
            "lifetime_s": lifetime_s,
        }
        return AsyncTargetSession(self, options, role)

    async def call(self, function: Callable[..., _T], *args: object) -> _T:
        """``function(*args)`` on one of this target's worker threads."""
        return await self._call(function, *args)

    async def aclose(self) -> None:
        target, self._target = self._target, None
        if target is not None:
            await self._call(target.close)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncTarget:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _call(self, function: Callable[..., _T], *args: object) -> _T:
        import asyncio

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args))


class Submission:
    """The turn id of a run on a worker thread, once its submission has returned."""

    def __init__(self) -> None:
        self._settled = threading.Event()
        self.turn_id: str | None = None

    def submitted(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self._settled.set()

    def settle(self) -> None:
        """The run ended, submitted or not: nobody needs to wait any longer."""
        self._settled.set()

    def kill(self, target: Target) -> None:
        """KILL the run's turn (blocking). A cancel can come while the submission is still in
        flight, the turn perhaps already running: its answer, which the HTTP timeouts bound,
        says what to kill."""
        self._settled.wait(CANCEL_WAIT_S)
        if self.turn_id is not None:
            with contextlib.suppress(AgentError, RuntimeError):
                target.client.signal(self.turn_id, "KILL")


class _Collector:
    """Gathers a turn's output, hands each event on, and records it once handed on."""

    def __init__(self, on_event: Callable[[Event], None] | None) -> None:
        self._on_event = on_event
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.cursor: Cursor | None = None

    def event(self, event: Event) -> None:
        if isinstance(event, OutputEvent):
            (self.stdout if event.kind == "stdout" else self.stderr).extend(output_bytes(event))
        if self._on_event is not None:
            self._on_event(event)
        if self.cursor is not None:
            self.cursor.delivered(event.seq)

    def result(self, finished: Finished) -> RunResult:
        return RunResult(
            exit_code=finished.exit_status,
            stdout=bytes(self.stdout),
            stderr=bytes(self.stderr),
            turn=finished.turn,
            refusal=finished.turn.refusal,
        )

    def __enter__(self) -> _Collector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.cursor is not None:
            self.cursor.close()


def _ssh_tls_context(
    connection: SshConnection, cacert: str | None, remote_cacert: str | None
) -> ssl.SSLContext:
    """Trust ``cacert``, else the CA file the target host keeps, else the system's CAs."""
    if cacert is not None or remote_cacert is None:
        return tls_context(cacert)
    pem = connection.read_file(remote_cacert)
    if pem is None:
        return tls_context(None)
    source = f"{remote_cacert} on {connection.endpoint}"
    try:
        text = pem.decode("ascii")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source} is not a PEM certificate; give --cacert") from exc
    return pinned_tls_context(text, source)


def _passphrase_source(passphrase: str | PassphraseSource | None) -> PassphraseSource | None:
    if isinstance(passphrase, str):
        secret = passphrase
        return lambda _path: secret
    return passphrase


def _checked_ssh_url(url: str) -> httpx.URL:
    """The listener's URL, as seen from the SSH server; plain HTTP only to its loopback."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise UsageError(f"target URL {url!r} is not a URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"target URL {url!r} must look like http://127.0.0.1:PORT")
    if parsed.scheme == "http" and not is_loopback(parsed.host):
        raise UsageError(
            f"refusing plain HTTP from the SSH server to {parsed.host}: the token would cross "
            "the network unencrypted; name a loopback listener or use https://"
        )
    return parsed


def _role_of(target: Target) -> str:
    return target.role
