"""Unit tests of the agent side that need no paddock target.

Where a server is needed (error mapping, resuming, Ctrl-C) a small scripted
HTTP server runs on 127.0.0.1 in a thread: real sockets, real TLS, real
dropped connections, with each answer written out in the test.
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import re
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import pytest
import trustme
from hypothesis import given
from hypothesis import strategies as st

from agent_side import cli, sse
from agent_side.client import RetryPolicy, TargetClient
from agent_side.errors import (
    AgentError,
    AuthRejected,
    ConnectionDropped,
    ProtocolError,
    RequestRejected,
    TargetUnreachable,
    TlsFailure,
    TurnLost,
    UsageError,
    map_transport_error,
)
from agent_side.sse import ServerSentEvent, SSEDecoder
from shared.wire import Refusal, Turn, TurnRequest

TOKEN = "tok-" + "s3cret" * 6
TURN_ID = "t-" + "ab" * 16
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


# -- helpers: a scripted HTTP server ----------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


Route = Callable[["_Handler", Seen], None]


@dataclass
class Scripted:
    """Routes keyed by (METHOD, path); every request is recorded in ``seen``."""

    routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def paths(self, method: str, path: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path == path]


class _Handler(http.server.BaseHTTPRequestHandler):
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


def reply(handler: _Handler, status: int, body: bytes, content_type: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def reply_json(
    handler: _Handler, status: int, body: object, content_type: str = "application/json"
) -> None:
    text = body if isinstance(body, str) else json.dumps(body)
    reply(handler, status, text.encode(), content_type)


def reply_events(handler: _Handler, frames: bytes, *, drop: bool = False) -> None:
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


def start_stream(handler: _Handler) -> None:
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


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    yield from _serve(None)


def _serve(tls: ssl.SSLContext | None) -> Iterator[Scripted]:
    server = _Server(("127.0.0.1", 0), _Handler)
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


def fast_retry() -> RetryPolicy:
    return RetryPolicy(first_delay_s=0.01, max_delay_s=0.02, budget_s=0.2)


def client_for(script: Scripted, **kwargs: object) -> TargetClient:
    return TargetClient(script.url, TOKEN, retry=fast_retry(), **kwargs)  # type: ignore[arg-type]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def no_paddock_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PADDOCK_TARGET", "PADDOCK_TOKEN", "PADDOCK_CACERT", "PADDOCK_ROLE"):
        monkeypatch.delenv(name, raising=False)


# -- SSE decoding -----------------------------------------------------------------------


def decode(*chunks: bytes) -> list[ServerSentEvent]:
    return list(sse.iter_sse(chunks))


STREAM = (
    b": ping\n\n"
    b'id: 1\nevent: stdout\ndata: {"a": 1}\n\n'
    b"id: 2\r\nevent: stderr\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"id: 3\revent: exit\rdata: caf\xc3\xa9 \xe2\x80\xa8 done\r\r"
)
EXPECTED = [
    ServerSentEvent(event="stdout", data='{"a": 1}', id="1"),
    ServerSentEvent(event="stderr", data="line one\nline two", id="2"),
    ServerSentEvent(event="exit", data="caf\u00e9 \u2028 done", id="3"),
]


def test_sse_decoder_reads_lf_crlf_and_cr_streams() -> None:
    assert decode(STREAM) == EXPECTED


def test_sse_decoder_same_events_at_every_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        assert decode(STREAM[:cut], STREAM[cut:]) == EXPECTED, cut


def test_sse_decoder_same_events_one_byte_at_a_time() -> None:
    assert decode(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_sse_decoder_same_events_for_any_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode(*chunks) == EXPECTED


def test_sse_decoder_crlf_split_across_chunks_is_one_line_end() -> None:
    events = decode(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n")
    assert events == [ServerSentEvent(data="a\nb")]


def test_sse_decoder_cr_at_chunk_end_dispatches_without_waiting() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == [ServerSentEvent(data="a")]


def test_sse_decoder_multi_line_data_joined_with_newline() -> None:
    assert decode(b"data: one\ndata:two\ndata\ndata:  three\n\n") == [
        ServerSentEvent(data="one\ntwo\n\n three")
    ]


def test_sse_decoder_ignores_comments_and_heartbeats() -> None:
    assert decode(b": ping\n\n: ping\n\n:\n\ndata: x\n: inside\n\n") == [ServerSentEvent(data="x")]


def test_sse_decoder_keeps_unicode_line_separators_inside_data() -> None:
    text = "a\u2028b\u2029c\x85d\x0be"
    assert decode(f"data: {text}\n\n".encode()) == [ServerSentEvent(data=text)]


def test_sse_decoder_utf8_character_split_across_chunks() -> None:
    body = "data: é€😀\n\n".encode()
    for cut in range(len(body)):
        assert decode(body[:cut], body[cut:]) == [ServerSentEvent(data="é€😀")]


def test_sse_decoder_discards_unterminated_event_at_end() -> None:
    assert decode(b"data: complete\n\ndata: cut off\n") == [ServerSentEvent(data="complete")]


def test_sse_decoder_event_without_data_is_not_dispatched() -> None:
    assert decode(b"event: stdout\nid: 7\n\ndata: x\n\n") == [ServerSentEvent(data="x", id="7")]


def test_sse_decoder_last_id_carries_over_and_retry_is_read() -> None:
    events = decode(b"id: 5\nretry: 250\ndata: a\n\nretry: soon\ndata: b\n\n")
    assert events == [
        ServerSentEvent(data="a", id="5", retry=250),
        ServerSentEvent(data="b", id="5", retry=250),
    ]


def test_sse_decoder_strips_one_leading_bom() -> None:
    assert decode(b"\xef\xbb\xbf", b"data: x\n\n") == [ServerSentEvent(data="x")]


def test_sse_decoder_refuses_an_endless_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_EVENT_CHARS", 64)
    decoder = SSEDecoder()
    with pytest.raises(ProtocolError, match="line exceeds"):
        for _ in range(10):
            decoder.feed(b"data: " + b"x" * 10)


def test_sse_decoder_refuses_endless_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_EVENT_CHARS", 64)
    with pytest.raises(ProtocolError, match="data exceeds"):
        decode(b"data: 0123456789\n" * 10)


# -- command line: parsing and precedence ---------------------------------------------


def parse(*argv: str) -> object:
    return cli.build_parser().parse_args(["run", *argv])


def test_cli_run_takes_the_command_after_double_dash() -> None:
    args = parse("--cwd", "/w", "--", "ls", "-la", "--", "--cwd")
    request = cli.build_request(args, "default", None)
    assert request.argv == ["ls", "-la", "--", "--cwd"]
    assert request.cwd == "/w"


def test_cli_run_takes_a_command_without_double_dash() -> None:
    request = cli.build_request(parse("make", "-j2"), "default", None)
    assert request.argv == ["make", "-j2"]


def test_cli_run_maps_flags_to_the_request() -> None:
    args = parse(
        "-e", "A=1", "--env", "B=x=y", "-e", "EMPTY=",
        "--read", "/r1", "--read", "/r2", "--write", "/w",
        "--net", "--timeout", "2.5", "--", "true",
    )  # fmt: skip
    request = cli.build_request(args, "builder", None)
    assert request.role == "builder"
    assert request.env == {"A": "1", "B": "x=y", "EMPTY": ""}
    assert request.fs.read == ["/r1", "/r2"]
    assert request.fs.write == ["/w"]
    assert request.network == "host"
    assert request.limits.wall_s == 2.5
    assert request.cwd is None


def test_cli_run_defaults_to_no_network_and_no_limits() -> None:
    request = cli.build_request(parse("--", "true"), "default", None)
    assert request.network == "none"
    assert request.limits.wall_s is None


@pytest.mark.parametrize("flag", ["--cwd", "--read", "--write"])
def test_cli_relative_path_refused_for_a_remote_target(flag: str) -> None:
    with pytest.raises(UsageError, match=f"{flag} 'src' is relative; give an absolute path"):
        cli.build_request(parse(flag, "src", "--", "true"), "default", None)


def test_cli_relative_paths_joined_to_local_cwd_without_normalising() -> None:
    args = parse("--cwd", "sub/../x", "--read", "r", "--write", "./w", "--", "true")
    request = cli.build_request(args, "default", "/home/me/proj")
    # ".." is left for the target's walk, which resolves it physically.
    assert request.cwd == "/home/me/proj/sub/../x"
    assert request.fs.read == ["/home/me/proj/r"]
    assert request.fs.write == ["/home/me/proj/./w"]


def test_cli_local_cwd_is_the_default_cwd() -> None:
    request = cli.build_request(parse("--", "true"), "default", "/home/me/proj")
    assert request.cwd == "/home/me/proj"


@pytest.mark.parametrize("pair", ["NOEQUALS", "=value"])
def test_cli_env_pair_needs_a_name_and_equals(pair: str) -> None:
    with pytest.raises(UsageError, match="is not NAME=VALUE"):
        cli.build_request(parse("-e", pair, "--", "true"), "default", None)


def test_cli_run_without_command_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="give the command to run after '--'"):
        cli.build_request(parse("--"), "default", None)


def test_cli_invalid_request_names_the_field() -> None:
    with pytest.raises(UsageError, match="argv"):
        cli.build_request(parse("--", "nul\0byte"), "default", None)


def test_cli_env_supplies_target_token_cacert_and_role() -> None:
    environ = {
        "PADDOCK_TARGET": "https://t.example:8443",
        "PADDOCK_TOKEN": f"  {TOKEN}\n",
        "PADDOCK_CACERT": "/etc/ca.pem",
        "PADDOCK_ROLE": "builder",
    }
    args = parse("--", "true")
    connection = cli.resolve_connection(args, environ)
    assert connection == cli.Connection("https://t.example:8443", TOKEN, "/etc/ca.pem")
    assert cli.resolve_role(args, environ) == "builder"


def test_cli_flags_beat_env(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    environ = {
        "PADDOCK_TARGET": "https://env:1",
        "PADDOCK_TOKEN": "from-env",
        "PADDOCK_CACERT": "/env/ca.pem",
        "PADDOCK_ROLE": "env-role",
    }
    args = parse(
        "--target", "https://flag:2", "--token-file", str(token_file),
        "--cacert", "/flag/ca.pem", "--role", "flag-role", "--", "true",
    )  # fmt: skip
    connection = cli.resolve_connection(args, environ)
    assert connection == cli.Connection("https://flag:2", "from-file", "/flag/ca.pem")
    assert cli.resolve_role(args, environ) == "flag-role"


def test_cli_role_defaults_to_default() -> None:
    assert cli.resolve_role(parse("--", "true"), {}) == "default"


def test_cli_connection_repr_hides_the_token() -> None:
    assert TOKEN not in repr(cli.Connection("https://t:1", TOKEN, None))


def test_cli_missing_target_and_token_are_named() -> None:
    with pytest.raises(UsageError, match="--target URL or set PADDOCK_TARGET"):
        cli.resolve_connection(parse("--", "true"), {"PADDOCK_TOKEN": TOKEN})
    with pytest.raises(UsageError, match="--token-file F or set PADDOCK_TOKEN"):
        cli.resolve_connection(parse("--", "true"), {"PADDOCK_TARGET": "https://t:1"})


def test_cli_token_file_problems_are_named(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(UsageError, match="is empty"):
        cli.read_token(str(empty))
    with pytest.raises(UsageError, match="cannot read token file"):
        cli.read_token(str(tmp_path / "missing"))


def test_cli_token_file_readable_by_others_is_warned_about(tmp_path, capsys) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    assert cli.read_token(str(token_file)) == TOKEN
    err = capsys.readouterr().err
    assert "open to group or others (mode 644); chmod 600 it" in err
    assert TOKEN not in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "required: COMMAND"),
        (["run", "--bogus", "--", "true"], "unrecognized arguments: --bogus"),
        (["run", "--timeout", "0", "--", "true"], "positive number of seconds"),
        (["run", "--timeout", "soon", "--", "true"], "not a number of seconds"),
        (["run", "--local", "--target", "https://t:1", "--", "true"], "drop --target"),
        (["run", "--local", "--role", "builder", "--", "true"], "one role, 'default'"),
    ],
)
def test_cli_usage_errors_exit_125(argv, says, capsys, no_paddock_env) -> None:
    assert cli.main(argv) == 125
    err = capsys.readouterr().err
    assert err.startswith("paddock: usage: ")
    assert says in err


def test_cli_help_and_version_exit_0(capsys) -> None:
    assert cli.main(["--help"]) == 0
    assert cli.main(["--version"]) == 0
    assert "paddock" in capsys.readouterr().out


# -- refusals and exit statuses -------------------------------------------------------


def test_refusal_sentence_names_rule_subject_path_and_resolution() -> None:
    refusal = Refusal(
        rule="forbidden-path",
        subject="fs.read[0]",
        path="/home/u/keys",
        resolved="/home/u/.ssh",
        detail="/home/u/.ssh is forbidden: it holds credentials; drop it from --read.",
    )
    assert cli.refusal_sentence(refusal) == (
        "refused (forbidden-path, fs.read[0]): /home/u/.ssh is forbidden: it holds credentials; "
        "drop it from --read (path /home/u/keys resolves to /home/u/.ssh)."
    )


def test_refusal_sentence_with_one_path_or_none() -> None:
    same = Refusal(rule="bad-mount", subject="cwd", path="/x", resolved="/x", detail="No such dir")
    assert cli.refusal_sentence(same) == "refused (bad-mount, cwd): No such dir (path /x)."
    bare = Refusal(rule="reserved-env", subject="env.PADDOCK_X", detail="PADDOCK_ is reserved.")
    expected = "refused (reserved-env, env.PADDOCK_X): PADDOCK_ is reserved."
    assert cli.refusal_sentence(bare) == expected


def test_say_makes_control_characters_visible(capsys) -> None:
    cli.say("refused: \x1b[2Jgone\nfake line\r")
    assert capsys.readouterr().err == "paddock: refused: \\x1b[2Jgone\\nfake line\\r\n"


def _turn(**fields: object) -> Turn:
    return Turn.model_validate_json(turn_json(**fields))


def test_exit_status_prefers_the_terminal_event() -> None:
    from shared.wire import ExitEvent

    event = ExitEvent(seq=3, at=NOW, exit_code=137, signal=9)
    assert cli.exit_status(_turn(state="running"), event) == 137
    assert cli.exit_status(_turn(state="exited", exit_code=124), None) == 124


def test_exit_status_of_a_lost_or_statusless_turn_is_a_paddock_failure() -> None:
    with pytest.raises(TurnLost):
        cli.exit_status(_turn(state="lost"), None)
    with pytest.raises(ProtocolError, match="without an exit status"):
        cli.exit_status(_turn(state="exited"), None)
    with pytest.raises(ProtocolError, match=r"not 0\.\.255"):
        cli.exit_status(_turn(state="exited", exit_code=300), None)


# -- error mapping ---------------------------------------------------------------------


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


@pytest.mark.parametrize("exc_type", _all_subclasses(httpx.HTTPError), ids=lambda c: c.__name__)
def test_every_httpx_error_maps_to_an_agent_error(exc_type: type[httpx.HTTPError]) -> None:
    if issubclass(exc_type, httpx.HTTPStatusError):
        request = httpx.Request("GET", "https://t/")
        exc: httpx.HTTPError = exc_type(
            "x", request=request, response=httpx.Response(500, request=request)
        )
    else:
        exc = exc_type("boom")
    mapped = map_transport_error(exc, "https://t/v1/x")
    assert isinstance(mapped, AgentError)
    assert type(mapped) is not AgentError


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ConnectError("refused"), TargetUnreachable),
        (httpx.ConnectTimeout("slow"), TargetUnreachable),
        (httpx.ReadError("reset"), ConnectionDropped),
        (httpx.ReadTimeout("quiet"), ConnectionDropped),
        (httpx.RemoteProtocolError("incomplete body"), ConnectionDropped),
        (httpx.UnsupportedProtocol("ftp"), UsageError),
        (httpx.DecodingError("gzip"), ProtocolError),
    ],
)
def test_httpx_errors_map_by_meaning(exc: httpx.HTTPError, expected: type) -> None:
    assert type(map_transport_error(exc, "https://t/v1/x")) is expected


def test_connect_error_caused_by_ssl_is_a_tls_failure() -> None:
    try:
        try:
            raise ssl.SSLCertVerificationError(1, "certificate verify failed")
        except ssl.SSLError as inner:
            raise httpx.ConnectError("handshake") from inner
    except httpx.ConnectError as exc:
        mapped = map_transport_error(exc, "https://t/v1/x")
    assert isinstance(mapped, TlsFailure)
    assert "--cacert / PADDOCK_CACERT" in str(mapped)


def test_run_against_a_closed_port_exits_125_target_unreachable(
    capsys, monkeypatch, no_paddock_env
) -> None:
    url = f"https://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    assert cli.main(["run", "--target", url, "--", "true"]) == 125
    err = capsys.readouterr().err
    assert err.startswith(f"paddock: target unreachable: cannot connect to {url}/v1/turns")
    assert "check the target is running" in err
    assert TOKEN not in err


def test_client_raises_target_unreachable_for_a_closed_port() -> None:
    client = TargetClient(f"http://127.0.0.1:{closed_port()}", TOKEN)
    with client, pytest.raises(TargetUnreachable) as caught:
        client.health()
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


@pytest.fixture(scope="module")
def target_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_scripted(target_ca: trustme.CA) -> Iterator[Scripted]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    target_ca.issue_cert("127.0.0.1").configure_cert(context)
    yield from _serve(context)


def test_run_against_an_untrusted_certificate_exits_125_tls_failure(
    tls_scripted, tmp_path, capsys, monkeypatch, no_paddock_env
) -> None:
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    argv = ["run", "--target", tls_scripted.url, "--cacert", str(other_ca), "--", "true"]
    assert cli.main(argv) == 125
    err = capsys.readouterr().err
    assert err.startswith(f"paddock: TLS failure: TLS handshake with {tls_scripted.url}")
    assert "certificate not trusted" in err
    assert "check --cacert / PADDOCK_CACERT" in err
    assert tls_scripted.seen == []


def test_client_without_cacert_does_not_trust_a_private_ca(tls_scripted) -> None:
    with TargetClient(tls_scripted.url, TOKEN) as client, pytest.raises(TlsFailure):
        client.health()


def test_health_over_tls_with_the_right_cacert(tls_scripted, target_ca, tmp_path, capsys) -> None:
    ca_file = tmp_path / "ca.pem"
    target_ca.cert_pem.write_to_path(str(ca_file))
    body = {"status": "degraded", "causes": [], "version": "0.1.0", "backend": "none"}
    tls_scripted.routes["GET", "/v1/health"] = lambda h, s: reply_json(h, 200, body)
    assert cli.main(["health", "--target", tls_scripted.url, "--cacert", str(ca_file)]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "degraded"
    assert "authorization" not in {k.lower() for k in tls_scripted.seen[0].headers}


def test_client_refuses_plain_http_to_a_remote_host() -> None:
    with pytest.raises(UsageError, match="refusing to send the token over plain HTTP"):
        TargetClient("http://target.example:8443", TOKEN)


def test_client_refuses_a_token_with_whitespace() -> None:
    with pytest.raises(UsageError, match="token"):
        TargetClient("https://t:1", "two words")


def test_client_refuses_an_unreadable_cacert(tmp_path) -> None:
    with pytest.raises(UsageError, match="cannot load CA certificate"):
        TargetClient("https://t:1", TOKEN, cacert=str(tmp_path / "missing.pem"))


def test_client_refuses_use_after_close(scripted) -> None:
    client = client_for(scripted)
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.health()
    with pytest.raises(RuntimeError, match="closed"), client:
        pass


# -- answers the client refuses ---------------------------------------------------------


def problem(status: int, detail: str, errors: list[dict[str, str]] | None = None) -> Route:
    body = {"title": "t", "status": status, "detail": detail, "errors": errors or []}
    return lambda h, s: reply_json(h, status, body, "application/problem+json")


@pytest.mark.parametrize(
    ("status", "expected", "says"),
    [
        (401, AuthRejected, "rejected the token (401: bad token); check --token-file"),
        (403, AuthRejected, "does not hold that role (403: bad token); check --role"),
        (404, TurnLost, f"does not know turn {TURN_ID}"),
        (500, ProtocolError, "failed with 500: bad token"),
    ],
)
def test_client_maps_problem_statuses(scripted, status, expected, says) -> None:
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = problem(status, "bad token")
    with client_for(scripted) as client, pytest.raises(expected, match=re.escape(says)):
        client.turn(TURN_ID)


def test_client_names_the_fields_of_a_rejected_request(scripted) -> None:
    errors = [{"field": "body.argv", "message": "argv is empty"}]
    scripted.routes["POST", "/v1/turns"] = problem(422, "the request is invalid", errors)
    request = TurnRequest(role="default", argv=["true"])
    with client_for(scripted) as client, pytest.raises(RequestRejected) as caught:
        client.submit(request)
    assert "the request is invalid; body.argv: argv is empty" in str(caught.value)


def test_client_rejects_a_body_that_is_not_the_model(scripted) -> None:
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(h, 200, {"x": 1})
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="not a valid Turn"):
        client.turn(TURN_ID)


def test_client_rejects_an_unexpected_success_status(scripted) -> None:
    scripted.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 202, turn_json())
    request = TurnRequest(role="default", argv=["true"])
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="expected 201 or 200"):
        client.submit(request)


def test_client_rejects_events_that_are_not_an_event_stream(scripted) -> None:
    path = f"/v1/turns/{TURN_ID}/events"
    scripted.routes["GET", path] = lambda h, s: reply_json(h, 200, [])
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="application/json"):
        list(client.events(TURN_ID))


def test_client_rejects_a_frame_whose_id_disagrees_with_its_seq(scripted) -> None:
    bad = frame({"seq": 2, "kind": "started"}).replace(b"id: 2", b"id: 9")
    scripted.routes["GET", f"/v1/turns/{TURN_ID}/events"] = lambda h, s: reply_events(h, bad)
    with client_for(scripted) as client, pytest.raises(ProtocolError, match="disagrees"):
        list(client.events(TURN_ID))


def test_client_refuses_a_turn_id_that_would_steer_the_path() -> None:
    with TargetClient("https://t:1", TOKEN) as client, pytest.raises(UsageError):
        client.turn("../health")


# -- following a turn through dropped connections --------------------------------------

STARTED = {"seq": 1, "kind": "started"}
OUT = {"seq": 2, "kind": "stdout", "data": "hello\n"}
ERR_B64 = {"seq": 3, "kind": "stderr", "data_b64": "/wo="}
EXIT = {"seq": 4, "kind": "exit", "exit_code": 3, "signal": None}


def scripted_stream(script: Scripted, *passes: tuple[bytes, bool]) -> None:
    """Each events request gets the next (frames, drop) pass; the last repeats."""
    remaining = list(passes)

    def route(handler: _Handler, seen: Seen) -> None:
        frames, drop = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        reply_events(handler, frames, drop=drop)

    script.routes["GET", f"/v1/turns/{TURN_ID}/events"] = route


def after_values(script: Scripted) -> list[str]:
    return [s.query for s in script.paths("GET", f"/v1/turns/{TURN_ID}/events")]


def test_follow_resumes_after_a_dropped_connection_exactly_once(scripted) -> None:
    scripted_stream(
        scripted,
        (b": ping\n\n" + frame(STARTED) + frame(OUT), True),
        (frame(ERR_B64) + frame(EXIT), False),
    )
    with client_for(scripted) as client:
        events = list(client.follow(TURN_ID))
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert after_values(scripted) == ["after=0", "after=2"]
    headers = scripted.seen[0].headers
    assert headers["Authorization"] == f"Bearer {TOKEN}"


def test_follow_drops_events_a_target_repeats(scripted) -> None:
    scripted_stream(
        scripted,
        (frame(STARTED) + frame(OUT), True),
        (frame(OUT) + frame(ERR_B64) + frame(EXIT), False),
    )
    with client_for(scripted) as client:
        assert [e.seq for e in client.follow(TURN_ID)] == [1, 2, 3, 4]


def test_follow_gives_up_after_its_budget(scripted) -> None:
    scripted_stream(scripted, (b": ping\n\n", True))
    with client_for(scripted) as client, pytest.raises(ConnectionDropped, match="gave up"):
        list(client.follow(TURN_ID, after=7))
    attempts = after_values(scripted)
    assert 2 <= len(attempts) <= 12
    assert set(attempts) == {"after=7"}


def test_follow_reports_a_turn_the_target_marked_lost(scripted) -> None:
    scripted_stream(scripted, (frame(STARTED), False))
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(
        h, 200, turn_json(state="lost")
    )
    with client_for(scripted) as client, pytest.raises(TurnLost, match="marked turn"):
        list(client.follow(TURN_ID))


def test_follow_ends_for_a_finished_turn_with_no_terminal_event(scripted) -> None:
    scripted_stream(scripted, (frame(STARTED), False), (b"", False))
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(
        h, 200, turn_json(state="exited", exit_code=0)
    )
    with client_for(scripted) as client:
        assert [e.seq for e in client.follow(TURN_ID)] == [1]


def test_submit_with_a_key_is_retried_after_a_dropped_exchange(scripted) -> None:
    calls: list[str] = []

    def route(handler: _Handler, seen: Seen) -> None:
        calls.append(seen.headers["Idempotency-Key"])
        if len(calls) == 1:
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        reply_json(handler, 201, turn_json())

    scripted.routes["POST", "/v1/turns"] = route
    request = TurnRequest(role="default", argv=["true"])
    with client_for(scripted) as client:
        assert client.submit(request, idempotency_key="key-1").turn_id == TURN_ID
    assert calls == ["key-1", "key-1"]


# -- paddock run against a scripted target ------------------------------------------------


def script_turn(script: Scripted, frames: bytes, final: str) -> None:
    script.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 201, turn_json())
    script.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(h, 200, final)
    scripted_stream(script, (frames, False))


def run_main(script: Scripted, monkeypatch, *argv: str) -> int:
    monkeypatch.setenv("PADDOCK_TARGET", script.url)
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    return cli.main(["run", *argv])


def test_run_streams_output_bytes_and_exits_with_the_turn_status(
    scripted, monkeypatch, capfd, no_paddock_env
) -> None:
    notice = {"seq": 4, "kind": "notice", "message": "output truncated"}
    exit_ = {**EXIT, "seq": 5}
    err_text = {"seq": 3, "kind": "stderr", "data": "warning: x\n"}
    frames = b"".join(frame(e) for e in (STARTED, OUT, err_text, notice, exit_))
    script_turn(scripted, frames, turn_json(state="exited", exit_code=3))
    assert run_main(scripted, monkeypatch, "--cwd", "/w", "-e", "A=1", "--", "make") == 3
    out, err = capfd.readouterr()
    assert out == "hello\n"
    assert err == "warning: x\npaddock: notice: output truncated\n"
    posted = json.loads(scripted.paths("POST", "/v1/turns")[0].body)
    assert posted["argv"] == ["make"]
    assert posted["cwd"] == "/w"
    assert posted["env"] == {"A": "1"}
    assert scripted.paths("POST", "/v1/turns")[0].headers["Idempotency-Key"]


def test_run_writes_undecodable_stderr_bytes_as_they_are(
    scripted, monkeypatch, capfdbinary, no_paddock_env
) -> None:
    frames = b"".join(frame(e) for e in (STARTED, ERR_B64, {**EXIT, "exit_code": 0}))
    script_turn(scripted, frames, turn_json(state="exited", exit_code=0))
    assert run_main(scripted, monkeypatch, "--", "true") == 0
    assert capfdbinary.readouterr().err == b"\xff\n"


def test_run_json_prints_events_then_the_turn(scripted, monkeypatch, capfd, no_paddock_env) -> None:
    final = turn_json(state="exited", exit_code=3)
    script_turn(scripted, b"".join(frame(e) for e in (STARTED, OUT, EXIT)), final)
    assert run_main(scripted, monkeypatch, "--json", "--", "make") == 3
    lines = capfd.readouterr().out.splitlines()
    assert [json.loads(line).get("kind") for line in lines[:3]] == ["started", "stdout", "exit"]
    assert json.loads(lines[3])["turn_id"] == TURN_ID
    assert len(lines) == 4


def test_run_refused_prints_one_sentence_and_exits_126(
    scripted, monkeypatch, capfd, no_paddock_env
) -> None:
    refusal = {
        "rule": "outside-workspace",
        "subject": "cwd",
        "path": "/etc",
        "resolved": "/etc",
        "detail": "/etc is outside the role's workspaces (/srv/work); pick a cwd inside one.",
    }
    refused = {"seq": 1, "kind": "refused", "refusal": refusal, "exit_code": 126}
    final = turn_json(state="refused", exit_code=126, refusal=refusal)
    script_turn(scripted, frame(refused), final)
    assert run_main(scripted, monkeypatch, "--cwd", "/etc", "--", "ls") == 126
    out, err = capfd.readouterr()
    assert out == ""
    assert err == (
        "paddock: refused (outside-workspace, cwd): /etc is outside the role's workspaces "
        "(/srv/work); pick a cwd inside one (path /etc).\n"
    )


def test_run_auth_rejected_exits_125(scripted, monkeypatch, capfd, no_paddock_env) -> None:
    scripted.routes["POST", "/v1/turns"] = problem(401, "unknown token")
    assert run_main(scripted, monkeypatch, "--", "true") == 125
    err = capfd.readouterr().err
    assert err.startswith("paddock: auth rejected: the target rejected the token (401")
    assert TOKEN not in err


def test_run_forwards_ctrl_c_as_int(scripted, monkeypatch, capfd, no_paddock_env) -> None:
    streaming = threading.Event()
    signalled = threading.Event()

    def events(handler: _Handler, seen: Seen) -> None:
        start_stream(handler)
        handler.wfile.write(frame(STARTED))
        handler.wfile.flush()
        streaming.set()
        signalled.wait(10)
        handler.wfile.write(frame({"seq": 2, "kind": "exit", "exit_code": 130, "signal": 2}))

    def signal_route(handler: _Handler, seen: Seen) -> None:
        signalled.set()
        reply_json(handler, 202, turn_json())

    final = turn_json(state="exited", exit_code=130, signal=2)
    scripted.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 201, turn_json())
    scripted.routes["GET", f"/v1/turns/{TURN_ID}"] = lambda h, s: reply_json(h, 200, final)
    scripted.routes["GET", f"/v1/turns/{TURN_ID}/events"] = events
    scripted.routes["POST", f"/v1/turns/{TURN_ID}/signal"] = signal_route

    def press_ctrl_c() -> None:
        if streaming.wait(10):
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    try:
        assert run_main(scripted, monkeypatch, "--", "sleep", "60") == 130
    finally:
        presser.join(10)
    sent = scripted.paths("POST", f"/v1/turns/{TURN_ID}/signal")
    assert [json.loads(s.body) for s in sent] == [{"signal": "INT"}]
    # Whatever handled SIGINT before the run (ignored, in a background job) does again.
    assert signal.getsignal(signal.SIGINT) is before


def test_run_third_ctrl_c_stops_waiting_and_exits_130(
    scripted, monkeypatch, capfd, no_paddock_env
) -> None:
    streaming = threading.Event()
    released = threading.Event()
    signals: list[str] = []
    two_sent = threading.Event()

    def events(handler: _Handler, seen: Seen) -> None:
        start_stream(handler)
        handler.wfile.write(frame(STARTED))
        handler.wfile.flush()
        streaming.set()
        released.wait(10)  # a target that never ends the turn

    def signal_route(handler: _Handler, seen: Seen) -> None:
        signals.append(json.loads(seen.body)["signal"])
        reply_json(handler, 202, turn_json())
        if len(signals) == 2:
            two_sent.set()

    scripted.routes["POST", "/v1/turns"] = lambda h, s: reply_json(h, 201, turn_json())
    scripted.routes["GET", f"/v1/turns/{TURN_ID}/events"] = events
    scripted.routes["POST", f"/v1/turns/{TURN_ID}/signal"] = signal_route

    def press_ctrl_c() -> None:
        if not streaming.wait(10):
            return
        os.kill(os.getpid(), signal.SIGINT)
        while not signals:
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        if two_sent.wait(10):
            os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    try:
        assert run_main(scripted, monkeypatch, "--", "sleep", "60") == 130
    finally:
        released.set()
        presser.join(10)
    assert signals == ["INT", "KILL"]
    assert "paddock: interrupted; the turn may still be running" in capfd.readouterr().err
