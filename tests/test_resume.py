"""Resume under fire: a proxy cuts the connection at random points of a 10 MB stream."""

from __future__ import annotations

import contextlib
import hashlib
import random
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest
from conftest import BUILDER_TOKEN, Target

from agent_side.client import TargetClient
from agent_side.turns import output_bytes
from shared.wire import OutputEvent, TurnRequest


class CuttingProxy:
    """Forwards 127.0.0.1 TCP to the target, cutting each connection after a random byte count."""

    def __init__(self, upstream_port: int, seed: int, cuts: int) -> None:
        self._upstream = upstream_port
        self._random = random.Random(seed)
        self.cuts_left = cuts
        self._clients: list[socket.socket] = []
        """Every connection accepted, listed before it is served (``close`` waits for the list)."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            self._clients.append(client)
            budget = None
            if self.cuts_left > 0:
                self.cuts_left -= 1
                budget = self._random.randint(50_000, 2_000_000)
            threading.Thread(target=self._serve, args=(client, budget), daemon=True).start()

    def _serve(self, client: socket.socket, budget: int | None) -> None:
        upstream = socket.create_connection(("127.0.0.1", self._upstream))
        threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
        self._pipe(upstream, client, budget)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, budget: int | None) -> None:
        try:
            while data := src.recv(65536):
                if budget is not None:
                    data = data[:budget]
                    budget -= len(data)
                dst.sendall(data)
                if budget == 0:
                    break
        except OSError:
            pass
        finally:
            for end in (src, dst):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()


@pytest.fixture
def proxy(target: Target) -> Iterator[CuttingProxy]:
    port = int(target.url.rsplit(":", 1)[1])
    p = CuttingProxy(port, seed=20261129, cuts=6)
    yield p
    p.close()


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "event-stream"])
def test_follow_through_dropped_connections_delivers_every_byte_once(
    target: Target, proxy: CuttingProxy, frames: bool
) -> None:
    count = 1_500_000  # `seq` prints about 10.9 MB
    expected = hashlib.sha256(
        subprocess.run(["seq", str(count)], capture_output=True, check=True).stdout
    )
    got = hashlib.sha256()
    seqs: list[int] = []
    framings: set[bool] = set()
    with TargetClient(
        f"https://127.0.0.1:{proxy.port}", BUILDER_TOKEN, cacert=target.cacert, frames=frames
    ) as client:
        request = TurnRequest(role="builder", argv=["seq", str(count)])
        turn = client.submit(request, idempotency_key=f"resume-test-{frames}")
        for event in client.follow(turn.turn_id):
            seqs.append(event.seq)
            if isinstance(event, OutputEvent) and event.kind == "stdout":
                framings.add(event.output is not None)  # only frames bring the bytes themselves
                got.update(output_bytes(event))
            if event.kind == "exit":
                assert event.exit_code == 0
    assert got.hexdigest() == expected.hexdigest()
    assert seqs == list(range(1, len(seqs) + 1))
    assert proxy.cuts_left == 0, "the proxy never cut the stream: the test proved nothing"
    assert framings == {frames}


def test_a_turn_run_in_one_request_resumes_through_dropped_connections(
    target: Target, proxy: CuttingProxy
) -> None:
    """The submission's own stream cut: the rest comes by the events route, every byte once."""
    count = 1_500_000
    expected = hashlib.sha256(
        subprocess.run(["seq", str(count)], capture_output=True, check=True).stdout
    )
    got = hashlib.sha256()
    seqs: list[int] = []
    paths: list[str] = []
    submitted: list[str] = []
    with TargetClient(
        f"https://127.0.0.1:{proxy.port}", BUILDER_TOKEN, cacert=target.cacert
    ) as client:
        client._http.event_hooks["request"].append(lambda r: paths.append(r.url.path))
        events = client.submit_and_follow(
            TurnRequest(role="builder", argv=["seq", str(count)]), "resume-one", submitted.append
        )
        for event in events:
            seqs.append(event.seq)
            if isinstance(event, OutputEvent) and event.kind == "stdout":
                got.update(output_bytes(event))
    assert got.hexdigest() == expected.hexdigest()
    assert seqs == list(range(1, len(seqs) + 1))
    assert proxy.cuts_left == 0, "the proxy never cut the stream: the test proved nothing"
    assert len(submitted) == 1 and paths[-1] == f"/v1/turns/{submitted[0]}/events"
