"""A small scripted HTTP server on 127.0.0.1 for the agent side's tests.

Real sockets, real TLS, real dropped connections, with each answer written out
in the test: routes keyed by (METHOD, path) write what the test says, and
every request is recorded. The ``scripted`` and ``tls_scripted`` fixtures in
conftest.py start one per test.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from agent_side.client import RetryPolicy, TargetClient
from shared.wire import Turn

TOKEN = "tok-" + "s3cret" * 6
TURN_ID = "t-" + "ab" * 16
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

STARTED = {"seq": 1, "kind": "started"}
OUT = {"seq": 2, "kind": "stdout", "data": "hello\n"}
ERR_B64 = {"seq": 3, "kind": "stderr", "data_b64": "/wo="}
EXIT = {"seq": 4, "kind": "exit", "exit_code": 3, "signal": None}


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


Route = Callable[["Handler", Seen], None]


@dataclass
class Scripted:
    """Routes keyed by (METHOD, path); every request is recorded in ``seen``."""

    routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def paths(self, method: str, path: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path == path]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        path, _, query = self.path.partition("?")
        length = int(self.headers.get("Content-Length") or 0)
        seen = Seen(self.command, path, query, dict(self.headers.items()), self.rfile.read(length))
        script = self.server.script
        script.seen.append(seen)
        route = script.routes.get((self.command, path))
        if route is None:
            reply_json(self, 599, {"unexpected": f"{self.command} {path}"})
        else:
            route(self, seen)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    script: Scripted

    def handle_error(self, request: object, client_address: object) -> None:
        # Clients hanging up mid-answer is what several tests are about; stay quiet.
        pass


@contextlib.contextmanager
def serving(tls: ssl.SSLContext | None = None) -> Iterator[Scripted]:
    """A scripted server for the block, over TLS when ``tls`` is a server context."""
    server = _Server(("127.0.0.1", 0), Handler)
    server.script = Scripted()
    scheme = "http"
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    server.script.url = f"{scheme}://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.script
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def reply(handler: Handler, status: int, body: bytes, content_type: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def reply_json(
    handler: Handler, status: int, body: object, content_type: str = "application/json"
) -> None:
    text = body if isinstance(body, str) else json.dumps(body)
    reply(handler, status, text.encode(), content_type)


def problem(status: int, detail: str, errors: list[dict[str, str]] | None = None) -> Route:
    """A route answering an RFC 9457 problem."""
    body = {"title": "t", "status": status, "detail": detail, "errors": errors or []}
    return lambda h, s: reply_json(h, status, body, "application/problem+json")


def reply_events(handler: Handler, frames: bytes, *, drop: bool = False) -> None:
    """An event stream; with ``drop`` the connection dies before the body promised ends."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Content-Length", str(len(frames) + (4096 if drop else 0)))
    handler.end_headers()
    handler.wfile.write(frames)
    handler.wfile.flush()
    if drop:
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)


def start_stream(handler: Handler) -> None:
    """Headers of an event stream that runs until the handler closes the connection."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.close_connection = True


def frame(event: dict[str, object]) -> bytes:
    data = json.dumps({"at": NOW.isoformat(), **event})
    return f"id: {event['seq']}\nevent: {event['kind']}\ndata: {data}\n\n".encode()


def turn_json(**fields: object) -> str:
    values: dict[str, object] = {
        "turn_id": TURN_ID,
        "role": "default",
        "state": "running",
        "created_at": NOW,
        **fields,
    }
    return Turn.model_validate(values).model_dump_json()


def scripted_stream(script: Scripted, *passes: tuple[bytes, bool]) -> None:
    """Each events request gets the next (frames, drop) pass; the last repeats."""
    remaining = list(passes)

    def route(handler: Handler, seen: Seen) -> None:
        frames, drop = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        reply_events(handler, frames, drop=drop)

    script.routes["GET", f"/v1/turns/{TURN_ID}/events"] = route


def script_turn(script: Scripted, frames: bytes, final: str) -> None:
    """A target whose one turn streams ``frames`` and then reads as ``final``."""
    script.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 201, turn_json())
    script.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(h, 200, final)
    scripted_stream(script, (frames, False))


def fast_retry() -> RetryPolicy:
    return RetryPolicy(first_delay_s=0.01, max_delay_s=0.02, budget_s=0.2)


def client_for(script: Scripted, **kwargs: object) -> TargetClient:
    return TargetClient(script.url, TOKEN, retry=fast_retry(), **kwargs)  # type: ignore[arg-type]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
