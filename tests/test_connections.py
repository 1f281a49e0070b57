"""Half-sent requests: thousands of them neither starve ``/v1/health`` and new turns, nor take
every descriptor, nor flood the log; a connection that never finishes its request is closed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import trustme
from conftest import BUILDER_TOKEN, events, local_settings, make_settings, output
from process_support import TargetProcess, target_process, write_config

from shared.walk import canonical_path
from target_side.service.connections import MAX_HEAD_BYTES, ConnectionGuard
from target_side.service.server import ServerThread, listen, uvicorn_config

FLOOD = 2000
PARTIAL_HEAD = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
GARBAGE = 300
MAX_CONNECTIONS = 256


@contextlib.contextmanager
def _sockets(count: int, port: int, payload: bytes) -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            with contextlib.suppress(OSError):
                sock.sendall(payload)
            opened.append(sock)
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _log_lines(target: TargetProcess) -> int:
    return len(target.log.read_text().splitlines())


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def test_a_flood_of_half_sent_requests_leaves_health_and_turns_working(tmp_path: Path) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"max_connections": MAX_CONNECTIONS})
    port = int(url.rsplit(":", 1)[1])
    with target_process(config, url, root / "target.log") as target:
        lines_before = _log_lines(target)
        with (
            _sockets(FLOOD, port, PARTIAL_HEAD) as partial,
            _sockets(GARBAGE, port, b"NOT HTTP AT ALL\r\n\r\n"),
        ):
            assert len(partial) == FLOOD
            started = time.monotonic()
            with target.client(timeout=5) as c:
                assert c.get("/v1/health").status_code == 200
                turn = c.post("/v1/turns", json={"role": "builder", "argv": ["echo", "served"]})
                assert turn.status_code == 201
                assert events(c, turn.json()["turn_id"])[-1].exit_code == 0  # type: ignore[union-attr]
            assert time.monotonic() - started < 10
            # Descriptors stay near the connection cap, never one per half-sent request.
            assert target.fds() < MAX_CONNECTIONS + 100
        # Thousands of refused and closed connections, a handful of log lines.
        assert _log_lines(target) - lines_before < 40
        assert target.up()


def test_a_request_not_finished_in_time_is_closed(tmp_path: Path) -> None:
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"request_timeout_s": 1.0})
    port = int(url.rsplit(":", 1)[1])
    with (
        target_process(config, url, root / "target.log"),
        _sockets(1, port, PARTIAL_HEAD) as (slow,),
    ):
        assert _closed_by_peer(slow, timeout=15)


def test_a_kept_alive_connection_then_sending_half_a_request_is_closed(tmp_path: Path) -> None:
    """The clock starts again once a response is done: a client may not hold a connection
    with a second request it never finishes."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root, server={"request_timeout_s": 1.0})
    port = int(url.rsplit(":", 1)[1])
    whole = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with target_process(config, url, root / "target.log"), _sockets(1, port, whole) as (sock,):
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(PARTIAL_HEAD)
        assert _closed_by_peer(sock, timeout=15)


def test_a_request_head_past_its_limit_is_refused_before_it_is_kept(tmp_path: Path) -> None:
    """However long a head grows, the server holds at most ``MAX_HEAD_BYTES`` of it: a
    header of megabytes, or thousands of headers, are refused with 431 and the limit."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    port = int(url.rsplit(":", 1)[1])
    start = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    fits = start + b"X-Pad: " + b"a" * (MAX_HEAD_BYTES - len(start) - 20) + b"\r\n\r\n"
    heads = [
        start + b"X-Big: " + b"a" * (4 << 20) + b"\r\n\r\n",
        start + b"X-Big: " + b"a" * (6 * MAX_HEAD_BYTES) + b"\r\n\r\n",  # whole in a read
        start + b"X-A: b\r\n" * 100_000 + b"\r\n",
    ]
    with target_process(config, url, root / "target.log") as target:
        before = target.rss_kib()
        for head in heads:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                with contextlib.suppress(OSError):  # closed while still sending
                    sock.sendall(head)
                answer = _answer(sock)
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
            assert f"longer than {MAX_HEAD_BYTES} bytes".encode() in answer
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(fits)
            assert _answer(sock).startswith(b"HTTP/1.1 200 ")
        assert target.rss_kib() - before < 4096


def _answer(sock: socket.socket) -> bytes:
    """What the peer sent until it closed (or 5 s passed), a reset after its answer ignored."""
    sock.settimeout(5)
    got = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            got += chunk
            if b"\r\n\r\n" in got and b"content-length" in got.lower():
                head, _, body = got.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    return got


def test_a_tls_connection_that_never_says_hello_is_closed(tmp_path: Path, ca: trustme.CA) -> None:
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    quick = settings.server.model_copy(update={"request_timeout_s": 1.0})
    with ServerThread(settings.model_copy(update={"server": quick})) as server:
        with _sockets(1, server.port, b"") as (silent,):
            assert _closed_by_peer(silent, timeout=15)
        context = ssl.create_default_context(cafile=None)
        ca.configure_trust(context)
        with httpx.Client(base_url=server.url, verify=context) as c:
            assert c.get("/v1/health").status_code == 200


def test_a_stream_longer_than_the_request_timeout_is_not_cut(
    tmp_path: Path, ca: trustme.CA
) -> None:
    """The clock runs while a request is being sent, not while its response is."""
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    quick = settings.server.model_copy(update={"request_timeout_s": 1.0})
    with ServerThread(settings.model_copy(update={"server": quick})) as server:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        headers = {"Authorization": f"Bearer {BUILDER_TOKEN}"}
        with httpx.Client(base_url=server.url, verify=context, headers=headers) as c:
            script = "sleep 2.5; echo done"
            turn = c.post("/v1/turns", json={"role": "builder", "argv": ["sh", "-c", script]})
            evs = events(c, turn.json()["turn_id"])
            assert (output(evs), evs[-1].kind) == ("done\n", "exit")
            time.sleep(1.5)  # idle between requests on the kept-alive connection
            assert c.get("/v1/health").status_code == 200


async def test_accepted_connections_send_without_delay(tmp_path: Path) -> None:
    """TCP_NODELAY on every accepted connection: without it each response waits ~40 ms for a
    delayed ACK. asyncio sets it only on sockets whose protocol says TCP."""
    settings = local_settings(tmp_path)
    listener = listen(settings, ConnectionGuard(4, 5.0))
    seen: list[int] = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await asyncio.get_running_loop().create_server(Record, sock=listener)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
    assert seen == [1]


async def test_a_late_report_of_a_closed_connection_leaves_its_successor_on_the_clock() -> None:
    """TLS reports a connection lost one loop turn after its socket closed; by then a new
    connection may hold the same descriptor number. The late report must not take the new
    connection off the clock (it would then never be closed, however long it dawdles)."""
    guard = ConnectionGuard(4, 0.2)
    first, first_peer = socket.socketpair()
    guard.accepted(first)
    old = guard.entry(first.fileno())
    assert old is not None
    number = first.fileno()
    first.close()  # the descriptor is free; its protocol has not said so yet
    second, second_peer = socket.socketpair()
    if second.fileno() != number:
        os.dup2(second.fileno(), number)  # make the reuse certain
        second.close()
        second = socket.socket(fileno=number)
    guard.accepted(second)
    try:
        guard.closed(old)  # the first connection's report arrives now
        assert guard.entry(number) is not None
        second_peer.settimeout(2)
        await asyncio.sleep(0.4)
        assert second_peer.recv(16) == b""  # the successor's clock ran out: it was closed
    finally:
        for sock in (first_peer, second, second_peer):
            sock.close()


def test_the_server_keeps_to_asyncios_own_loop_even_where_uvloop_is_installed(
    tmp_path: Path,
) -> None:
    # uvicorn's "auto" takes uvloop wherever it is importable; under it a burst of turns met
    # closed descriptors when starting bubblewrap. Pinned, whatever a deployment installs.
    config = uvicorn_config(local_settings(tmp_path))
    assert config.loop == "asyncio"
