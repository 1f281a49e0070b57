"""A synchronous client for the target's v1 API (docs/api.md).

Every httpx failure leaves this module as an ``AgentError`` (see ``errors``).
Only three things are retried, each because the contract makes it safe: a
``submit`` that carries an ``Idempotency-Key`` (the target returns the same
turn), any ``submit`` answered 429 (the target started nothing; it is asked
again after its ``Retry-After``, for up to ``RetryPolicy.busy_s``), and
``follow``, which resumes the event stream from the last event it delivered
(the target neither loses nor repeats events after a cursor).
"""

from __future__ import annotations

import functools
import http.cookiejar
import math
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TypeVar

import httpcore
import httpx
from pydantic import BaseModel, RootModel, ValidationError

from agent_side import probe
from agent_side.errors import (
    AgentError,
    AuthRejected,
    ConnectionDropped,
    FileFailed,
    FileRefused,
    LeaseLost,
    ProtocolError,
    RequestRejected,
    SeatTaken,
    ServiceUnavailable,
    SessionUnavailable,
    TargetBusy,
    TargetUnreachable,
    TlsFailure,
    TurnLost,
    UnknownSession,
    UnknownTurn,
    UsageError,
    WrongScheme,
    map_transport_error,
    ssl_cause,
)
from agent_side.pool_transport import PoolTransport
from agent_side.sse import ServerSentEvent, SSEDecoder
from shared import __version__
from shared.frames import MEDIA_TYPE as FRAMES_MEDIA_TYPE
from shared.frames import Frame, FrameDecoder, FrameError, moment
from shared.net import is_loopback
from shared.wire import (
    EVENTS,
    TERMINAL_KINDS,
    Event,
    Health,
    Lease,
    LeaseRequest,
    OutputEvent,
    PlanResult,
    Problem,
    Refusal,
    RenewRequest,
    Resize,
    RoleList,
    Session,
    SessionRequest,
    SignalRequest,
    Turn,
    TurnRequest,
    is_turn_id,
)

DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
"""Reads allow 30 s of silence: twice the target's default heartbeat on event streams."""

_Model = TypeVar("_Model", bound=BaseModel)
_Answer = TypeVar("_Answer")


class _TurnList(RootModel[list[Turn]]):
    """The body of ``GET /v1/turns``."""


EVENTS_ACCEPT = f"{FRAMES_MEDIA_TYPE}, text/event-stream;q=0.5"
URLS_KEPT = 32
"""Parsed URLs a client keeps, the most recently used (a turn's own paths come and go)."""
"""Frames from a target that has them; the event stream from one that does not."""

STREAMED_SUBMIT_ACCEPT = f"{FRAMES_MEDIA_TYPE}, application/json;q=0.5"
"""The turn's frames in answer to its submission; the new turn alone from a target that
answers a submission with nothing else."""


class _LeaseList(RootModel[list[Lease]]):
    """The body of ``GET /v1/leases``."""


class _SessionList(RootModel[list[Session]]):
    """The body of ``GET /v1/sessions``."""


_MAX_SHOWN_BODY = 200
_MAX_RETRY_AFTER_S = 60.0
"""A longer Retry-After is waited as this: a target's estimate, not a promise."""


@dataclass(frozen=True)
class RetryPolicy:
    """How ``follow`` (and a keyed ``submit``) wait between tries: doubling, capped, bounded."""

    first_delay_s: float = 0.01
    """Small: a dropped connection is usually back at once, and resume latency is this wait."""
    max_delay_s: float = 5.0
    budget_s: float = 30.0
    busy_s: float = 300.0
    """How long ``submit`` keeps asking a target that answers 429 (all its turns are taken)."""

    def delays(self, clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
        """The pause before each retry, until the delays or the clock pass ``budget_s``."""
        started = clock()
        spent = 0.0
        delay = self.first_delay_s
        while spent + delay <= self.budget_s and clock() - started + delay <= self.budget_s:
            yield delay
            spent += delay
            delay = min(delay * 2, self.max_delay_s)


class TargetClient:
    """The target's API over one httpx connection pool.

    ``transport`` replaces the network: any ``httpx.BaseTransport``, such as
    ``httpx.MockTransport`` or an SSH channel transport. ``httpx.ASGITransport``
    is async-only and cannot serve this synchronous client.

    The bearer token goes only to routes that need it (not to health), and
    never over plain HTTP to a host other than loopback. Without a token
    (``None``) only ``health`` can succeed.

    ``probe_backend`` opens connections the way ``transport`` does, for one
    question asked only when the first exchange fails: does the listener speak
    TLS or plain HTTP (see ``probe``)? Direct connections need none given.

    Events come as frames (``shared.frames``: output as its own bytes, the
    ended turn in the terminal event) from a target that offers them, else
    as Server-Sent Events; ``frames=False`` always asks for the event stream.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        cacert: str | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        probe_backend: httpcore.NetworkBackend | None = None,
        frames: bool = True,
    ) -> None:
        url = _checked_base_url(base_url, using_transport=transport is not None)
        self._url = url
        if probe_backend is None and transport is None:
            probe_backend = httpcore.SyncBackend()
        self._probe_backend = probe_backend
        self._answered = False
        """Set once the listener has answered in HTTP: from then on the scheme is right."""
        self._auth = {} if token is None else {"Authorization": f"Bearer {_checked_token(token)}"}
        self._base_url = str(url).rstrip("/")
        self._absolute = functools.lru_cache(maxsize=URLS_KEPT)(
            functools.partial(_url_on, self._base_url)
        )
        """``path`` on the target, parsed once: httpx merging a relative path into its base
        URL parses both again on every request (about 70 us of the client's CPU each)."""
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._accept = EVENTS_ACCEPT if frames else "text/event-stream"
        if transport is None:
            # Plain TCP, as httpx's own transport, but a request's head and body leave together.
            tls = tls_context(cacert) if url.scheme == "https" else None
            transport = PoolTransport(httpcore.SyncBackend(), ssl_context=tls)
        self._http = httpx.Client(
            base_url=self._base_url,
            transport=transport,
            timeout=timeout,
            # Proxy, netrc and CA variables would silently change where the token goes.
            trust_env=False,
            follow_redirects=False,
            headers={"User-Agent": f"paddock/{__version__}"},
            cookies=_NoCookies(),
        )
        self._closed = False

    @property
    def base_url(self) -> str:
        return self._base_url

    def __repr__(self) -> str:
        return f"TargetClient({self._base_url!r}, closed={self._closed})"

    def close(self) -> None:
        """Close the connection pool; the client refuses every call after this."""
        self._closed = True
        self._http.close()

    def __enter__(self) -> TargetClient:
        self._require_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def health(self) -> Health:
        """The target's health; needs no token."""
        return self._model(Health, self._request("GET", "/v1/health", auth=False), 200)

    def submit(
        self, request: TurnRequest, idempotency_key: str | None = None, *, wait_busy: bool = True
    ) -> Turn:
        """Start a turn. With ``idempotency_key``, a dropped exchange is retried safely.

        A target at its cap (429) is asked again after its Retry-After, unless
        ``wait_busy`` is False: then ``TargetBusy`` says so at once (a pool tries another).
        """
        headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        body = request.model_dump_json(exclude_none=True).encode()

        def attempt() -> Turn:
            response = self._request("POST", "/v1/turns", content=body, headers=headers)
            # 200 is how a target may answer a retried POST it had already served.
            return self._model(Turn, response, 201, 200)

        dropped: tuple[type[AgentError], ...] = (
            () if idempotency_key is None else (ConnectionDropped,)
        )
        return self._retrying(attempt, retry_on=dropped, while_busy=wait_busy)

    def submit_and_follow(
        self,
        request: TurnRequest,
        idempotency_key: str,
        on_submitted: Callable[[str], None],
    ) -> Iterator[Event]:
        """Start a turn and yield each of its events exactly once, to its end.

        One request where the target answers a submission with the turn's
        frames (its id in ``Location``): a round trip less than ``submit``
        then ``follow``, which is what happens with a target that answers
        with the turn alone, or when this client does not take frames. The
        submission is retried with its key until the target answers; once
        the turn's id is known, a broken stream is resumed by ``follow``.
        ``on_submitted`` gets the turn's id before its first event.
        """
        if self._accept != EVENTS_ACCEPT:
            turn = self.submit(request, idempotency_key)
            on_submitted(turn.turn_id)
            yield from self.follow(turn.turn_id)
            return
        body = request.model_dump_json(exclude_none=True).encode()
        response = self._retrying(
            lambda: self._submit_streamed(body, idempotency_key),
            retry_on=(ConnectionDropped,),
            while_busy=True,
        )
        cursor = 0
        try:
            if _media_type(response) != FRAMES_MEDIA_TYPE:
                turn_id = self._model(Turn, response, 201, 200).turn_id
                on_submitted(turn_id)
            else:
                turn_id = _turn_id_at(response)
                on_submitted(turn_id)
                with self._mapped("/v1/turns"):
                    for event in _frame_events(response.iter_raw()):
                        if event.seq <= cursor:
                            continue
                        cursor = event.seq
                        yield event
                        if event.kind in TERMINAL_KINDS:
                            return
        except (ConnectionDropped, TargetUnreachable):
            pass  # the turn runs on: followed from its last event delivered
        finally:
            response.close()
        yield from self.follow(turn_id, after=cursor)

    def _submit_streamed(self, body: bytes, idempotency_key: str) -> httpx.Response:
        """The answer to a submission asking for the turn's frames, open (the caller closes
        it) when it is frames, else read whole: a break before the turn's id is known is
        one the submission is retried through."""
        self._require_open()
        headers = {
            **self._auth,
            "Idempotency-Key": idempotency_key,
            "Content-Type": "application/json",
            "Accept": STREAMED_SUBMIT_ACCEPT,
        }
        with self._mapped("/v1/turns"):
            sent = self._http.build_request(
                "POST", self._absolute("/v1/turns"), content=body, headers=headers
            )
            response = self._http.send(sent, stream=True)
            self._answered = True
            if not response.is_success or _media_type(response) != FRAMES_MEDIA_TYPE:
                try:
                    response.read()
                finally:
                    response.close()
        if not response.is_success:
            raise _status_error(response, turn_id=None)
        return response

    def turn(self, turn_id: str) -> Turn:
        """The turn as the target knows it now."""
        response = self._request("GET", f"/v1/turns/{_segment(turn_id)}", turn_id=turn_id)
        return self._model(Turn, response, 200)

    def signal(self, turn_id: str, name: str) -> Turn:
        """Send ``name`` (INT, TERM, KILL or HUP) to every process of the turn."""
        try:
            body = SignalRequest.model_validate({"signal": name}).model_dump_json().encode()
        except ValidationError as exc:
            raise UsageError(f"signal {name!r} is not one of INT, TERM, KILL, HUP") from exc
        path = f"/v1/turns/{_segment(turn_id)}/signal"
        response = self._request("POST", path, content=body, turn_id=turn_id)
        return self._model(Turn, response, 202)

    def write_stdin(self, turn_id: str, data: bytes, *, eof: bool = False) -> Turn:
        """Send ``data`` to the stdin of a turn started with ``stdin: open``; ``eof`` closes it."""
        path = f"/v1/turns/{_segment(turn_id)}/stdin"
        response = self._request(
            "POST",
            path,
            content=data,
            params={"eof": "1"} if eof else None,
            content_type="application/octet-stream",
            turn_id=turn_id,
        )
        return self._model(Turn, response, 202)

    def resize(self, turn_id: str, rows: int, cols: int) -> Turn:
        """Set a terminal turn's window size (its foreground job is told)."""
        try:
            body = Resize(rows=rows, cols=cols).model_dump_json().encode()
        except ValidationError as exc:
            raise UsageError(f"a terminal of {rows}x{cols} is out of range: {exc}") from exc
        path = f"/v1/turns/{_segment(turn_id)}/resize"
        response = self._request("POST", path, content=body, turn_id=turn_id)
        return self._model(Turn, response, 202)

    def start_session(self, request: SessionRequest, idempotency_key: str | None = None) -> Session:
        """Start a session (answered once its shell is ready, or it was refused)."""
        headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        body = request.model_dump_json(exclude_none=True).encode()

        def attempt() -> Session:
            response = self._request("POST", "/v1/sessions", content=body, headers=headers)
            return self._model(Session, response, 201, 200)

        dropped: tuple[type[AgentError], ...] = (
            () if idempotency_key is None else (ConnectionDropped,)
        )
        return self._retrying(attempt, retry_on=dropped, while_busy=True)

    def session(self, session_id: str) -> Session:
        """The session as the target knows it now."""
        path = f"/v1/sessions/{_segment(session_id, 'session id')}"
        return self._model(Session, self._request("GET", path, session_id=session_id), 200)

    def sessions(self, limit: int = 50) -> list[Session]:
        """The newest ``limit`` sessions of this token's roles, newest first."""
        response = self._request("GET", "/v1/sessions", params={"limit": str(limit)})
        return self._model(_SessionList, response, 200).root

    def end_session(self, session_id: str) -> Session:
        """End the session: everything in it is killed (an ended one is answered as it is)."""
        path = f"/v1/sessions/{_segment(session_id, 'session id')}"
        return self._model(Session, self._request("DELETE", path, session_id=session_id), 200)

    def roles(self, token: str | None = None) -> list[str]:
        """The roles this token (or ``token``) holds, sorted (``GET /v1/roles``).

        ``AuthRejected`` when the target does not accept the token.
        """
        headers = None if token is None else {"Authorization": f"Bearer {_checked_token(token)}"}
        response = self._request("GET", "/v1/roles", headers=headers, accept=(404,))
        if response.status_code == 404:
            raise ProtocolError(
                "this target does not say which roles a token holds (it has no GET /v1/roles); "
                "name the role (--role R or PADDOCK_ROLE; role= in Python)"
            )
        return self._model(RoleList, response, 200).roles

    def turns(self, limit: int = 50) -> list[Turn]:
        """The newest ``limit`` turns of this token's roles, newest first."""
        response = self._request("GET", "/v1/turns", params={"limit": str(limit)})
        return self._model(_TurnList, response, 200).root

    def plan(self, request: TurnRequest) -> PlanResult:
        """The fence ``request`` would get, or its refusal; nothing is launched."""
        body = request.model_dump_json(exclude_none=True).encode()
        return self._model(PlanResult, self._request("POST", "/v1/plan", content=body), 200)

    def take_lease(
        self, role: str, seat: str | None = None, ttl_s: float = 60.0, *, supersede: bool = False
    ) -> Lease:
        """A lease on ``seat`` (default: the role's first workspace); ``SeatTaken`` while held.

        ``supersede`` takes a held seat over: its holder's generation is no longer current.
        """
        try:
            body = LeaseRequest(role=role, seat=seat, ttl_s=ttl_s, supersede=supersede)
        except ValidationError as exc:
            raise UsageError(f"the lease request is not valid: {_first_error(exc)}") from exc
        content = body.model_dump_json(exclude_none=True).encode()
        response = self._request("POST", "/v1/leases", content=content, accept=(409,))
        if response.status_code == 409:
            said = _problem_text(_problem(response), response)
            raise SeatTaken(f"{said} (paddock lease take --supersede takes it over)")
        return self._model(Lease, response, 201)

    def renew_lease(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        """Extend a held lease (``ttl_s`` from now, else its own); ``LeaseLost`` if it is not."""
        try:
            content = RenewRequest(ttl_s=ttl_s).model_dump_json(exclude_none=True).encode()
        except ValidationError as exc:
            raise UsageError(f"the renewal is not valid: {_first_error(exc)}") from exc
        path = f"/v1/leases/{_segment(lease_id, 'lease id')}/renew"
        return self._lease_answer(
            lease_id, self._request("POST", path, content=content, accept=(404, 409))
        )

    def release_lease(self, lease_id: str) -> Lease:
        """Give the seat up and forget the lease; its last state (``released`` if it held)."""
        path = f"/v1/leases/{_segment(lease_id, 'lease id')}"
        return self._lease_answer(lease_id, self._request("DELETE", path, accept=(404,)))

    def lease(self, lease_id: str) -> Lease:
        """The lease as the target knows it now; ``LeaseLost`` once released (or never known)."""
        path = f"/v1/leases/{_segment(lease_id, 'lease id')}"
        return self._lease_answer(lease_id, self._request("GET", path, accept=(404,)))

    def leases(self) -> list[Lease]:
        """The current lease of every seat of this token's roles."""
        return self._model(_LeaseList, self._request("GET", "/v1/leases"), 200).root

    def _lease_answer(self, lease_id: str, response: httpx.Response) -> Lease:
        if response.status_code == 404:
            raise LeaseLost(
                f"the target knows no lease {lease_id} of this token's roles: released, "
                "or never granted there"
            )
        if response.status_code == 409:
            said = _problem_text(_problem(response), response)
            raise LeaseLost(f"lease {lease_id} no longer holds its seat (409: {said})")
        return self._model(Lease, response, 200)

    def events(self, turn_id: str, after: int = 0, wait: float | None = None) -> Iterator[Event]:
        """The turn's events with seq > ``after``, as they arrive, until the stream ends.

        A broken connection raises ``ConnectionDropped``; ``follow`` resumes it.
        """
        self._require_open()
        params: dict[str, str] = {"after": str(after)}
        if wait is not None:
            params["wait"] = str(wait)
        path = f"/v1/turns/{_segment(turn_id)}/events"
        headers = {**self._auth, "Accept": self._accept}
        with (
            self._mapped(path),
            self._http.stream(
                "GET", self._absolute(path), params=params, headers=headers
            ) as response,
        ):
            self._answered = True
            if response.status_code != 200:
                response.read()
                raise _status_error(response, turn_id=turn_id)
            if _media_type(response) == FRAMES_MEDIA_TYPE:
                yield from _frame_events(response.iter_raw())
                return
            _require_event_stream(response)
            decoder = SSEDecoder()
            chunks = response.iter_bytes()
            for chunk in chunks:
                for frame in decoder.feed(chunk):
                    event = _event_of(frame)
                    if event.kind in TERMINAL_KINDS:
                        # Read the stream's last bytes before handing over the end: a
                        # response closed unread costs the pooled connection.
                        for _ in chunks:
                            pass
                    yield event
            decoder.close()

    def follow(self, turn_id: str, after: int = 0) -> Iterator[Event]:
        """Every event after ``after`` exactly once, through dropped connections, to the end.

        Stops after the terminal event (``exit`` or ``refused``), or when the
        turn is finished and the target has no terminal event to give.
        """
        cursor = after
        delays = self._retry.delays()
        quiet_passes = 0
        while True:
            progressed = False
            try:
                for event in self.events(turn_id, after=cursor):
                    if event.seq <= cursor:
                        continue  # a repeat must not reach the user twice
                    cursor, progressed = event.seq, True
                    delays = self._retry.delays()
                    yield event
                    if event.kind in TERMINAL_KINDS:
                        return
                # The stream ended cleanly with no terminal event: what became of the turn?
                turn = self.turn(turn_id)
            except (ConnectionDropped, TargetUnreachable) as exc:
                self._pause(delays, exc, f"following turn {turn_id} after event {cursor}")
                continue
            if turn.state == "lost":
                raise TurnLost(f"the target marked turn {turn_id} lost (it crashed or restarted)")
            quiet_passes = 0 if progressed else quiet_passes + 1
            if turn.finished and quiet_passes > 1:
                return  # finished, and two passes found no terminal event to deliver
            if not turn.finished and not progressed:
                self._pause(
                    delays,
                    ProtocolError("the event stream ended without a terminal event"),
                    f"following turn {turn_id} after event {cursor}",
                )

    def send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        content: bytes | Iterable[bytes] | IO[bytes] | None = None,
        content_type: str = "application/octet-stream",
    ) -> httpx.Response:
        """One request to ``path`` with the token, its whole answer read; an ``AgentError``
        unless it succeeded (a refused file operation is a ``FileRefused``). Never retried."""
        return self._request(
            method, path, params=params, content=content, content_type=content_type
        )

    @contextmanager
    def stream(
        self, method: str, path: str, *, params: dict[str, str] | None = None
    ) -> Iterator[httpx.Response]:
        """A response whose body is read as it comes (``iter_bytes``); an ``AgentError``
        unless it succeeded. A break mid-body is a ``ConnectionDropped``."""
        self._require_open()
        with (
            self._mapped(path),
            self._http.stream(
                method, self._absolute(path), params=params, headers=self._auth
            ) as response,
        ):
            self._answered = True
            if not response.is_success:
                response.read()
                raise _status_error(response, turn_id=None)
            yield response

    def _pause(self, delays: Iterator[float], exc: AgentError, doing: str) -> None:
        delay = next(delays, None)
        if delay is None:
            raise type(exc)(f"gave up {doing} after {self._retry.budget_s:g} s: {exc}") from exc
        self._sleep(delay)

    def _retrying(
        self,
        attempt: Callable[[], _Answer],
        retry_on: tuple[type[AgentError], ...],
        while_busy: bool = False,
    ) -> _Answer:
        delays = self._retry.delays()
        busy_left = self._retry.busy_s
        while True:
            try:
                return attempt()
            except TargetBusy as exc:
                # 429: the target started nothing, so asking again is safe, keyed or not.
                if not while_busy or exc.retry_after_s > busy_left:
                    raise TargetBusy(
                        f"{exc} (waited {self._retry.busy_s - busy_left:g} s of "
                        f"{self._retry.busy_s:g} s for room)",
                        exc.retry_after_s,
                    ) from exc
                busy_left -= exc.retry_after_s
                self._sleep(exc.retry_after_s)
            except retry_on as exc:
                self._pause(delays, exc, "retrying the request")

    def _request(
        self,
        method: str,
        path: str,
        *,
        auth: bool = True,
        content: bytes | Iterable[bytes] | IO[bytes] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        turn_id: str | None = None,
        session_id: str | None = None,
        accept: tuple[int, ...] = (),
    ) -> httpx.Response:
        """The response to one request; an ``AgentError`` unless it succeeded or is ``accept``ed."""
        self._require_open()
        all_headers = {**(self._auth if auth else {}), **(headers or {})}
        if content is not None:
            all_headers["Content-Type"] = content_type
        with self._mapped(path):
            response = self._http.request(
                method, self._absolute(path), content=content, headers=all_headers, params=params
            )
        self._answered = True
        if not response.is_success and response.status_code not in accept:
            raise _status_error(response, turn_id=turn_id, session_id=session_id)
        return response

    @staticmethod
    def _model(model: type[_Model], response: httpx.Response, *statuses: int) -> _Model:
        if response.status_code not in statuses:
            raise ProtocolError(
                f"{response.request.method} {response.request.url.path} answered "
                f"{response.status_code}, expected {' or '.join(map(str, statuses))}"
            )
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise ProtocolError(
                f"{response.request.url.path} answered a body that is not "
                f"a valid {model.__name__}: {_first_error(exc)}"
            ) from exc

    @contextmanager
    def _mapped(self, path: str) -> Iterator[None]:
        try:
            yield
        except httpx.HTTPError as exc:
            mapped = map_transport_error(exc, self._base_url + path)
            raise (self._wrong_scheme(mapped, exc) or mapped) from exc

    def _wrong_scheme(self, mapped: AgentError, exc: httpx.HTTPError) -> WrongScheme | None:
        """``WrongScheme`` if the first exchange failed because the URL's scheme is wrong."""
        backend = self._probe_backend
        if self._answered or backend is None:
            return None
        url = self._url
        port = url.port or (443 if url.scheme == "https" else 80)
        where = f"[{url.host}]:{port}" if ":" in url.host else f"{url.host}:{port}"
        if (
            url.scheme == "http"
            and isinstance(mapped, ConnectionDropped)
            and probe.speaks_tls(backend, url.host, port)
        ):
            return WrongScheme(
                f"{where} speaks HTTPS, not plain HTTP: give https://{where} as the target "
                "URL (with --cacert / PADDOCK_CACERT for the CA that signed its certificate)"
            )
        certificate_refused = isinstance(ssl_cause(exc), ssl.SSLCertVerificationError)
        if (
            url.scheme == "https"
            and isinstance(mapped, TlsFailure)
            and not certificate_refused
            and probe.speaks_plain_http(backend, url.host, port)
        ):
            return WrongScheme(
                f"{where} speaks plain HTTP, not HTTPS: give http://{where} as the target URL "
                "(plain HTTP is accepted only for loopback addresses and through --ssh)"
            )
        return None

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TargetClient is closed; make a new one")


def _checked_base_url(base_url: str, *, using_transport: bool) -> httpx.URL:
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise UsageError(f"target URL {base_url!r} is not a URL: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise UsageError(f"target URL {base_url!r} must look like https://HOST:PORT")
    if url.scheme == "http" and not using_transport and not is_loopback(url.host):
        raise UsageError(
            f"refusing to send the token over plain HTTP to {url.host}; "
            "use https:// (plain HTTP is only for loopback addresses)"
        )
    return url


def _checked_token(token: str) -> str:
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise UsageError("the token is empty or contains spaces or control characters")
    return token


def tls_context(cacert: str | None) -> ssl.SSLContext:
    """A verifying TLS context trusting ``cacert`` (the system's CAs when None)."""
    try:
        return ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load CA certificate {cacert}: {exc}") from exc


def pinned_tls_context(ca_pem: str, source: str) -> ssl.SSLContext:
    """A verifying TLS context trusting only the CA certificate(s) in ``ca_pem``."""
    try:
        return ssl.create_default_context(cadata=ca_pem)
    except (ssl.SSLError, ValueError) as exc:
        raise UsageError(f"{source} holds no usable CA certificate: {exc}") from exc


def _url_on(base_url: str, path: str) -> httpx.URL:
    return httpx.URL(base_url + path)


def _segment(ident: str, what: str = "turn id") -> str:
    # Ids are t-<hex> and s-<hex>; anything else must not be able to steer the request path.
    if not ident or any(c in ident for c in "/?#%") or ident in (".", ".."):
        raise UsageError(f"{ident!r} is not a {what}")
    return ident


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip().lower()


def _turn_id_at(response: httpx.Response) -> str:
    """The id of the turn a streamed submission started, from its ``Location``."""
    location = response.headers.get("location", "")
    prefix, _, turn_id = location.rpartition("/")
    if prefix != "/v1/turns" or not is_turn_id(turn_id):
        raise ProtocolError(
            f"a submission answered with frames but Location {location!r}, not /v1/turns/TURN"
        )
    return turn_id


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that keeps nothing: the token is the client's one credential, and whatever
    answers (a target, or something in the way) carries no state of its own into the next
    request. A response's headers are not even parsed for cookies."""

    def extract_cookies(self, response: object, request: object) -> None:
        pass

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        pass


def _require_event_stream(response: httpx.Response) -> None:
    media_type = _media_type(response)
    if media_type != "text/event-stream":
        raise ProtocolError(f"the events route answered {media_type or 'no content type'}")


def _frame_events(chunks: Iterator[bytes]) -> Iterator[Event]:
    """Events from a frame stream; output keeps its bytes as they came."""
    decoder = FrameDecoder()
    for chunk in chunks:
        try:
            found = decoder.feed(chunk)
        except FrameError as exc:
            raise ProtocolError(f"the frame stream is broken: {exc}") from exc
        for index, frame in enumerate(found):
            event = _event_of_frame(frame)
            if event.kind in TERMINAL_KINDS:
                # Read the stream's last bytes before handing over the end: a
                # response closed unread costs the pooled connection.
                for _ in chunks:
                    pass
                if index + 1 < len(found):
                    raise ProtocolError(f"frames follow the terminal event {event.seq}")
            yield event
    if decoder.pending:
        raise ProtocolError(f"the frame stream ended inside a frame ({decoder.pending} bytes)")


def _event_of_frame(frame: Frame) -> Event:
    if frame.is_output:
        return OutputEvent.of_bytes(frame.seq, moment(frame.at_us), frame.kind, frame.payload)
    try:
        event: Event = EVENTS.validate_json(frame.payload)
    except ValidationError as exc:
        raise ProtocolError(f"a frame is not a valid Event: {_first_error(exc)}") from exc
    if (event.kind, event.seq) != (frame.kind, frame.seq):
        raise ProtocolError(
            f"frame {frame.seq} ({frame.kind}) carries another event ({event.seq}, {event.kind})"
        )
    return event


def _event_of(frame: ServerSentEvent) -> Event:
    try:
        event: Event = EVENTS.validate_json(frame.data)
    except ValidationError as exc:
        raise ProtocolError(f"an event frame is not a valid Event: {_first_error(exc)}") from exc
    if frame.event not in ("message", event.kind) or frame.id not in (None, str(event.seq)):
        raise ProtocolError(
            f"event frame id={frame.id} event={frame.event} disagrees with its data "
            f"(seq {event.seq}, kind {event.kind})"
        )
    return event


def _status_error(
    response: httpx.Response, *, turn_id: str | None, session_id: str | None = None
) -> AgentError:
    status = response.status_code
    problem = _problem(response)
    said = _problem_text(problem, response)
    file_error = _file_error(problem, status, said)
    if file_error is not None:
        return file_error
    if problem is not None and problem.title == "Unknown session":
        session_id = session_id or "named"
        return UnknownSession(
            f"the target knows no session {session_id} of this role (404: {said}); "
            "'paddock sessions' lists them"
        )
    if status == 409 and problem is not None and problem.title.startswith("Session"):
        running = getattr(problem, "turn_id", None)
        return SessionUnavailable(f"{said}", running if isinstance(running, str) else None)
    if status == 401:
        return AuthRejected(
            f"the target rejected the token (401: {said}); "
            "check --token-file / PADDOCK_TOKEN holds a token minted for this target"
        )
    if status == 403:
        return AuthRejected(f"the token does not hold that role (403: {said}); check --role")
    if status == 404 and turn_id is not None:
        return UnknownTurn(
            f"the target does not know turn {turn_id} (404: {said}); "
            "'paddock turns' lists the turns it keeps"
        )
    if status == 429:
        return TargetBusy(f"the target is busy (429: {said})", _retry_after(response))
    if status == 503:
        return ServiceUnavailable(f"the target takes no new turn now (503: {said})")
    if 400 <= status < 500:
        return RequestRejected(f"the target rejected the request ({status}: {said})")
    return ProtocolError(
        f"{response.request.method} {response.request.url.path} failed with {status}: {said}"
    )


def _file_error(problem: Problem | None, status: int, said: str) -> AgentError | None:
    """A file operation's problem: a refusal by the fence, or what the host told the role."""
    extra = (problem.model_extra or {}) if problem is not None else {}
    if extra.get("refusal") is not None:
        try:
            refusal = Refusal.model_validate(extra["refusal"])
        except ValidationError:
            return ProtocolError(f"the target answered {status} with a malformed refusal")
        if status == 404:
            return FileFailed(refusal.detail, status)
        return FileRefused(refusal.detail, refusal, status)
    if isinstance(extra.get("errno"), str):
        return FileFailed(said, status, extra["errno"])
    return None


def _retry_after(response: httpx.Response) -> float:
    """Seconds a ``Retry-After`` header asks for (delta-seconds only), within sane bounds."""
    try:
        seconds = float(response.headers.get("retry-after", "1"))
    except ValueError:
        seconds = 1.0
    if not math.isfinite(seconds):
        seconds = 1.0
    return min(max(seconds, 0.1), _MAX_RETRY_AFTER_S)


def _problem(response: httpx.Response) -> Problem | None:
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in ("application/problem+json", "application/json"):
        return None
    try:
        return Problem.model_validate_json(response.content)
    except ValidationError:
        return None


def _problem_text(problem: Problem | None, response: httpx.Response) -> str:
    if problem is None:
        shown = response.text[:_MAX_SHOWN_BODY].strip()
        return shown or response.reason_phrase or "no detail"
    text = problem.detail or problem.title
    if problem.errors:
        fields = "; ".join(f"{e.field}: {e.message}" for e in problem.errors)
        text = f"{text}; {fields}"
    return text


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or "(body)"
    return f"{where}: {error['msg']}"
