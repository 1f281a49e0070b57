"""Shared fixtures: a real target (uvicorn, TLS from trustme, bubblewrap) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import hashlib
import os
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trustme
from scripted_server import Scripted, serving

from bench.common import mux_pids
from bench.common import stop_muxes as stop_mux_daemons
from shared.walk import canonical_path
from shared.wire import EVENTS, Event, Turn, TurnRequest
from target_side.config import RoleConfig, RoleLimits, ServerConfig, Settings
from target_side.fence.held import no_failure
from target_side.fence.home import open_state_root, prepare_home
from target_side.fence.launch import find_bwrap, launch_turn
from target_side.fence.limits import Limiter
from target_side.fence.runner import Outcome
from target_side.policy.plan import plan_turn
from target_side.service.server import ServerThread

BUILDER_TOKEN = "builder-token-for-tests"
OTHER_TOKEN = "other-token-for-tests"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class Target:
    """A running target and what a test needs to talk to it."""

    url: str
    cacert: str
    settings: Settings
    workspace: Path

    def client(self, token: str | None = BUILDER_TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify = ssl.create_default_context(cafile=self.cacert)
        return httpx.Client(base_url=self.url, verify=verify, headers=headers, timeout=30)


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's own, searchable by every uid: turns reach what they mount by path."""
    return reachable(tmp_path)


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


def reachable(path: Path) -> Path:
    """Let every uid search ``path`` and the directories above it (pytest makes them 0700).

    Turns run as their role's own uid, and bubblewrap reaches what it mounts by path.
    """
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if not mode & 0o001:
            directory.chmod((mode & 0o7777) | 0o011)
    return path


def owned_by_role(path: Path, settings: Settings, role: str = "builder") -> Path:
    """Hand ``path`` to ``role``'s host uid, as an operator (or deploy) does for a workspace."""
    uid, gid = settings.role_ids(role)
    os.chown(path, uid, gid)
    path.chmod(0o700)
    return path


def local_settings(root: Path, **role: object) -> Settings:
    """Plain-HTTP settings with one role, ``builder``, owning ``root/ws`` (made here)."""
    reachable(root)
    workspace = root / "ws"
    workspace.mkdir(exist_ok=True)
    config = RoleConfig(token_sha256=sha(BUILDER_TOKEN), workspaces=(str(workspace),), **role)
    settings = Settings(
        server=ServerConfig(listen="127.0.0.1:0", state_root=str(root / "state")),
        roles={"builder": config},
    )
    owned_by_role(workspace, settings)
    return settings


async def launch_planned(
    settings: Settings,
    request: TurnRequest,
    *,
    inject: Callable[[str], None] = no_failure,
    limiter: Limiter | None = None,
    busy_loop_s: float = 0.0,
) -> tuple[Outcome, list[tuple[str, dict[str, object]]]]:
    """Plan, prepare and launch one turn without a server, as the turn manager does; with
    ``busy_loop_s``, the event loop is kept from everything else that long after the launch
    (as a burst of turns keeps it)."""
    plan = plan_turn(request, settings, f"t-{uuid.uuid4().hex}")
    open_state_root(settings.state_root)
    prepare_home(settings.state_root, plan.role, plan.uid, plan.gid)
    seen: list[tuple[str, dict[str, object]]] = []
    running = await launch_turn(
        find_bwrap(),
        plan,
        lambda kind, **f: seen.append((kind, _as_text(f))),
        limiter if limiter is not None else Limiter.detect(),
        inject,
    )
    time.sleep(busy_loop_s)
    outcome = await running.wait()
    await running.cleanup()
    return outcome, seen


def _as_text(fields: dict[str, object]) -> dict[str, object]:
    """An output event's fields as tests read them: ``data`` text (the runner emits bytes)."""
    raw = fields.get("raw")
    if isinstance(raw, bytes):
        return {"data": raw.decode(errors="replace")}
    return fields


def make_settings(root: Path, ca: trustme.CA, **role_overrides: object) -> Settings:
    """Settings for a TLS target whose state and one workspace live under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    reachable(root)
    workspace = root / "ws"
    workspace.mkdir(exist_ok=True)
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = root / "cert.pem", root / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    key_file.chmod(0o600)  # a key others can read is a config problem the target reports
    limits = role_overrides.pop("limits", RoleLimits(wall_s=60))
    builder = RoleConfig(
        token_sha256=sha(BUILDER_TOKEN),
        workspaces=(canonical_path(workspace),),
        limits=limits,
        **role_overrides,
    )
    other = RoleConfig(token_sha256=sha(OTHER_TOKEN), workspaces=(canonical_path(workspace),))
    settings = Settings(
        server=ServerConfig(
            listen="127.0.0.1:0",
            tls_cert=str(cert_file),
            tls_key=str(key_file),
            state_root=str(root / "state"),
            heartbeat_s=1.0,
            stop_grace_s=2.0,
        ),
        roles={"builder": builder, "other": other},
    )
    owned_by_role(workspace, settings)
    return settings


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    """One TLS target for the whole session (tests that need other settings start their own)."""
    root = Path(canonical_path(tmp_path_factory.mktemp("target")))
    yield from running_target(root, ca)


def running_target(root: Path, ca: trustme.CA, **role_overrides: object) -> Iterator[Target]:
    settings = make_settings(root, ca, **role_overrides)
    ca_file = root / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with ServerThread(settings) as server:
        try:
            yield Target(server.url, str(ca_file), settings, root / "ws")
        finally:
            stop_session_muxes()


MUX_PERSIST_IN_TESTS = "20s"
"""Multiplexers started by tests leave soon after their last run; the session stops the rest."""


@pytest.fixture(scope="session", autouse=True)
def mux_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every ``paddock run`` of the session keeps its multiplexers here, never in the real HOME.

    ``paddock run`` (in-process or as a subprocess inheriting this environment)
    starts one per target; they are all stopped when the session ends.
    """
    runtime = tmp_path_factory.mktemp("xdg-runtime")
    runtime.chmod(0o700)
    saved = {name: os.environ.get(name) for name in ("XDG_RUNTIME_DIR", "PADDOCK_MUX_PERSIST")}
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    os.environ["PADDOCK_MUX_PERSIST"] = MUX_PERSIST_IN_TESTS
    try:
        yield runtime
    finally:
        stop_muxes(runtime)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop_session_muxes() -> None:
    """Stop the session's multiplexers: before a target stops, as its clients leave first.

    They keep connections open to the targets they served (over SSH too); a
    server stopped under them would leave those connections to the collector.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        stop_muxes(Path(runtime))


def mux_daemons(runtime: Path) -> list[int]:
    """Pids of the live ``paddock mux serve`` processes whose sockets are under ``runtime``."""
    return sorted(mux_pids(runtime))


def stop_muxes(runtime: Path) -> None:
    """SIGTERM every multiplexer under ``runtime`` and wait until they are gone."""
    stop_mux_daemons(runtime, timeout=15.0)


@pytest.fixture
def client(target: Target) -> Iterator[httpx.Client]:
    with target.client() as c:
        yield c


def submit(client: httpx.Client, **request: object) -> Turn:
    request.setdefault("role", "builder")
    response = client.post("/v1/turns", json=request)
    assert response.status_code == 201, response.text
    return Turn.model_validate(response.json())


def events(client: httpx.Client, turn_id: str, after: int = 0, **params: object) -> list[Event]:
    """Every event of the stream, parsed from the SSE frames."""
    found = []
    with client.stream(
        "GET", f"/v1/turns/{turn_id}/events", params={"after": after, **params}
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                found.append(EVENTS.validate_json(line[len("data: ") :]))
    return found


def finished(client: httpx.Client, turn_id: str) -> Turn:
    events(client, turn_id)
    return Turn.model_validate(client.get(f"/v1/turns/{turn_id}").json())


def output(evs: list[Event], kind: str = "stdout") -> str:
    return "".join(getattr(e, "data", "") or "" for e in evs if e.kind == kind)


def run(client: httpx.Client, argv: list[str], **request: object) -> tuple[Turn, list[Event]]:
    turn = submit(client, argv=argv, **request)
    evs = events(client, turn.turn_id)
    return Turn.model_validate(client.get(f"/v1/turns/{turn.turn_id}").json()), evs


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def processes_with(*argv: str) -> list[int]:
    """Host pids whose command line is exactly ``argv``."""
    wanted = b"\0".join(a.encode() for a in argv) + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline == wanted:
            found.append(int(entry))
    return found


def zombies_of(pid: int) -> list[str]:
    """The names of the children of process ``pid`` that have ended and wait to be reaped."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as children:
            for child in children.read().split():
                with contextlib.suppress(OSError), open(f"/proc/{child}/stat") as stat:
                    name, _, rest = stat.read().rpartition(")")
                    if rest.split()[0] == "Z":
                        found.append(name.partition("(")[2])
    return found


# -- the agent side's scripted HTTP server (tests/scripted_server.py) ---------------------


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    """A scripted plain-HTTP server on 127.0.0.1 for one test."""
    with serving() as script:
        yield script


@pytest.fixture(scope="session")
def scripted_ca() -> trustme.CA:
    """The CA that signs the scripted TLS server's certificate."""
    return trustme.CA()


@pytest.fixture
def tls_scripted(scripted_ca: trustme.CA) -> Iterator[Scripted]:
    """A scripted HTTPS server on 127.0.0.1, its certificate signed by ``scripted_ca``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    scripted_ca.issue_cert("127.0.0.1").configure_cert(context)
    with serving(context) as script:
        yield script


@pytest.fixture
def no_paddock_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the PADDOCK_* variables of whoever runs the tests."""
    for name in ("PADDOCK_TARGET", "PADDOCK_TOKEN", "PADDOCK_CACERT", "PADDOCK_ROLE"):
        monkeypatch.delenv(name, raising=False)


PIDS_PROBE = """
import os, subprocess
children = []
for _ in range(100):
    try:
        children.append(subprocess.Popen(["sleep", "30"]))
    except OSError:
        break
print(sum(1 for entry in os.listdir("/proc") if entry.isdigit()))
"""
"""Starts up to 100 processes and prints how many the fence's own /proc then shows."""
