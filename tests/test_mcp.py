"""``paddock mcp``: the MCP server on stdio, driven by the SDK's own client.

Each test starts ``paddock mcp`` as a subprocess against the session's real
target (uvicorn, TLS, bubblewrap) and talks to it as a harness would.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import BUILDER_TOKEN, Target, owned_by_role, wait_until
from mcp import ClientSession, StdioServerParameters, stdio_client

from agent_side.mcp_server import OUTPUT_LIMIT

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent
TOOLS = {"run", "read_file", "write_file", "list_dir", "session_start", "session_end"}


def environment(target: Target) -> dict[str, str]:
    return {
        "PYTHONPATH": str(REPO),
        "PADDOCK_TARGET": target.url,
        "PADDOCK_CACERT": target.cacert,
        "PADDOCK_TOKEN": BUILDER_TOKEN,
    }


@contextlib.asynccontextmanager
async def connected(
    *args: str, env: dict[str, str], cwd: Path | None = None
) -> AsyncIterator[ClientSession]:
    """``paddock mcp ARGS`` as a harness runs it: spawned, initialized, stdin closed at the end."""
    params = StdioServerParameters(command=CLI[0], args=[*CLI[1:], "mcp", *args], env=env, cwd=cwd)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def call(client: ClientSession, tool: str, /, **arguments: Any) -> dict[str, Any]:
    """A tool's structured result; the call must not be a tool error."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


@pytest.fixture
def paddock_env(target: Target) -> dict[str, str]:
    return environment(target)


@pytest.fixture
def workdir(target: Target) -> Path:
    """A directory of the builder's own in the target's workspace."""
    path = target.workspace / f"mcp-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return owned_by_role(path, target.settings)


async def test_tools_are_listed_with_typed_parameters(paddock_env: dict[str, str]) -> None:
    async with connected(env=paddock_env) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
    assert set(tools) == TOOLS
    run = tools["run"]
    assert run.description and "exit code" in run.description
    properties = run.input_schema["properties"]
    assert {"command", "cwd", "env", "timeout", "session"} <= set(properties)
    assert run.input_schema["required"] == ["command"]
    assert all(tool.description for tool in tools.values())


async def test_run_takes_argv_or_shell_and_keeps_the_streams_apart(
    paddock_env: dict[str, str], workdir: Path
) -> None:
    async with connected(env=paddock_env) as session:
        argv = await call(session, "run", command=["printf", "%s|", "a b", "$HOME"])
        shell = await call(
            session,
            "run",
            command='echo "out $GREETING"; echo oops >&2; pwd; exit 3',
            cwd=str(workdir),
            env={"GREETING": "hello"},
        )
        missing = await call(session, "run", command=["no-such-program-here"])
        timed_out = await call(session, "run", command="sleep 30", timeout=1)
    assert (argv["exit_code"], argv["stdout"]) == (0, "a b|$HOME|")
    assert argv["turn_id"].startswith("t-")
    assert shell["exit_code"] == 3
    assert shell["stdout"] == f"out hello\n{workdir}\n"
    assert shell["stderr"] == "oops\n"
    assert shell["refusal"] is None and shell["truncated"] is None
    assert missing["exit_code"] == 127 and missing["refusal"]["rule"] == "not-found"
    assert timed_out["exit_code"] == 124


async def test_a_refused_run_returns_the_rule_and_what_to_change(
    paddock_env: dict[str, str],
) -> None:
    async with connected(env=paddock_env) as session:
        refused = await call(session, "run", command=["true"], cwd="/etc")
    assert refused["exit_code"] == 126
    refusal = refused["refusal"]
    assert (refusal["rule"], refusal["subject"], refusal["path"]) == (
        "outside-workspace",
        "cwd",
        "/etc",
    )
    assert refusal["detail"]
    assert refusal["sentence"].startswith("refused (outside-workspace, cwd): ")


async def test_files_round_trip_text_and_binary_and_list(
    paddock_env: dict[str, str], workdir: Path
) -> None:
    blob = bytes(range(256)) * 3
    async with connected(env=paddock_env) as session:
        text = await call(
            session, "write_file", path=f"{workdir}/notes.txt", content="héllo\n", mode="0600"
        )
        binary = await call(
            session,
            "write_file",
            path=f"{workdir}/blob.bin",
            content=base64.b64encode(blob).decode(),
            encoding="base64",
        )
        read_text = await call(session, "read_file", path=f"{workdir}/notes.txt")
        read_binary = await call(session, "read_file", path=f"{workdir}/blob.bin")
        first = await call(session, "read_file", path=f"{workdir}/notes.txt", limit=2)
        rest = await call(session, "read_file", path=f"{workdir}/notes.txt", offset=1)
        listing = await call(session, "list_dir", path=str(workdir))
        refused = await call(session, "read_file", path="/etc/shadow")
        missing = await session.call_tool("read_file", {"path": f"{workdir}/absent"})
    assert (text["size"], text["mode"], text["created"]) == (7, "0600", True)
    assert binary["size"] == len(blob)
    assert (workdir / "blob.bin").read_bytes() == blob
    assert (read_text["content"], read_text["encoding"]) == ("héllo\n", "utf-8")
    assert read_binary["encoding"] == "base64"
    assert base64.b64decode(read_binary["content"]) == blob
    # Two bytes would split the é: the part stops before it and says where to go on.
    assert first["content"] == "h"
    assert first["truncated"] == "6 more bytes: call read_file with offset=1"
    assert rest["content"] == "éllo\n" and rest["truncated"] is None
    entries = {entry["name"]: entry for entry in listing["entries"]}
    assert set(entries) == {"notes.txt", "blob.bin"}
    assert (entries["blob.bin"]["type"], entries["blob.bin"]["size"]) == ("file", len(blob))
    assert listing["entry"]["type"] == "directory"
    assert refused["refusal"]["rule"] == "forbidden-path"
    assert refused["refusal"]["sentence"].startswith("refused (forbidden-path")
    assert missing.is_error and "absent" in missing.content[0].text


async def test_a_session_keeps_its_shell_until_ended(
    paddock_env: dict[str, str], workdir: Path
) -> None:
    async with connected(env=paddock_env) as session:
        started = await call(session, "session_start", cwd=str(workdir), env={"A": "1"})
        session_id = started["session_id"]
        moved = "mkdir -p sub && cd sub && export B=2"
        await call(session, "run", command=moved, session=session_id)
        there = await call(session, "run", command='pwd; echo "$A$B"', session=session_id)
        mixed = await session.call_tool(
            "run", {"command": "true", "session": session_id, "cwd": str(workdir)}
        )
        ended = await call(session, "session_end", session_id=session_id)
        after = await session.call_tool("run", {"command": "true", "session": session_id})
        still = await call(session, "run", command=["true"])
        refused = await call(session, "session_start", cwd="/etc")
    assert (started["state"], started["cwd"]) == ("open", str(workdir))
    assert there["stdout"] == f"{workdir}/sub\n12\n"
    assert there["session_id"] == session_id
    assert mixed.is_error and "leave out cwd and env" in mixed.content[0].text
    assert ended["state"] == "closed"
    # paddock's own failure is the call's error; the server goes on serving.
    assert after.is_error and "session" in after.content[0].text
    assert still["exit_code"] == 0
    assert (refused["state"], refused["session_id"]) == ("refused", None)
    assert refused["refusal"]["rule"] == "outside-workspace"


async def test_sessions_started_here_end_when_the_server_does(
    paddock_env: dict[str, str], target: Target
) -> None:
    async with connected(env=paddock_env) as session:
        started = await call(session, "session_start")
        await call(session, "run", command="sleep 600 &", session=started["session_id"])
    with target.client() as client:
        response = client.get(f"/v1/sessions/{started['session_id']}")
    assert response.json()["state"] == "closed"


def test_term_ends_the_sessions_started_here_though_stdin_stays_open(
    paddock_env: dict[str, str], target: Target
) -> None:
    """A harness that signals rather than closing stdin: the raw protocol, to hold stdin."""
    server = subprocess.Popen(
        [*CLI, "mcp"],
        env=paddock_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for message in (
            {
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "test", "version": "0"},
                },
            },
            {"method": "notifications/initialized"},
            {"id": 2, "method": "tools/call", "params": {"name": "session_start", "arguments": {}}},
        ):
            server.stdin.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
            server.stdin.flush()
        server.stdout.readline()  # initialized
        started = json.loads(server.stdout.readline())["result"]["structuredContent"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdin.close()
    assert "SIGTERM" in server.stderr.read()
    server.stdout.close()
    server.stderr.close()
    with target.client() as client:
        response = client.get(f"/v1/sessions/{started['session_id']}")
    assert response.json()["state"] == "closed"


async def test_a_run_in_flight_is_killed_when_the_server_ends(
    paddock_env: dict[str, str], target: Target, workdir: Path
) -> None:
    started = workdir / "started"

    async def run_long(session: ClientSession) -> None:
        with contextlib.suppress(Exception):  # its answer never comes: the server ends first
            await session.call_tool("run", {"command": f"touch {started}; sleep 60"})

    def running_now() -> list[dict[str, Any]]:
        with target.client() as client:
            return [t for t in client.get("/v1/turns").json() if t["state"] == "running"]

    # The target is the session's: turns other tests left running are not this one.
    others = {t["turn_id"] for t in running_now()}
    async with anyio.create_task_group() as tasks:
        async with connected(env=paddock_env) as session:
            tasks.start_soon(run_long, session)
            with anyio.fail_after(20):
                while not started.exists():
                    await anyio.sleep(0.05)
            running = [t for t in running_now() if t["turn_id"] not in others]
        tasks.cancel_scope.cancel()
    assert len(running) == 1

    def turn_state() -> str:
        with target.client() as client:
            return client.get(f"/v1/turns/{running[0]['turn_id']}").json()["state"]

    assert wait_until(lambda: turn_state() != "running", timeout=10)


async def test_long_output_is_cut_in_the_middle_with_a_note(paddock_env: dict[str, str]) -> None:
    size = 3 * OUTPUT_LIMIT
    async with connected(env=paddock_env) as session:
        script = f"echo first; head -c {size} /dev/zero | tr '\\0' x; echo; echo last"
        long = await call(session, "run", command=script)
    stdout = long["stdout"]
    assert len(stdout.encode()) < OUTPUT_LIMIT + 100
    assert stdout.startswith("first\n") and stdout.endswith("\nlast\n")
    cut = len("first\n") + size + len("\nlast\n") - OUTPUT_LIMIT
    assert f"[... {cut} bytes cut here ...]" in stdout
    note = long["truncated"]
    assert f"{cut} bytes of stdout" in note and "stderr" not in note
    assert f"paddock logs {long['turn_id']}" in note and "read_file" in note
    assert long["exit_code"] == 0 and long["stderr"] == ""


async def test_an_unreachable_target_is_a_tool_error_not_a_crash(
    paddock_env: dict[str, str],
) -> None:
    env = paddock_env | {"PADDOCK_TARGET": "https://127.0.0.1:9"}
    async with connected(env=env) as session:
        first = await session.call_tool("run", {"command": ["true"]})
        again = await session.call_tool("list_dir", {"path": "/"})
    assert first.is_error and "target unreachable" in first.content[0].text
    assert again.is_error and "target unreachable" in again.content[0].text


def test_a_usage_error_ends_it_at_once_with_nothing_on_stdout(
    paddock_env: dict[str, str],
) -> None:
    env = {k: v for k, v in paddock_env.items() if k != "PADDOCK_TOKEN"}
    done = subprocess.run(
        [*CLI, "mcp"], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.PIPE
    )
    assert (done.returncode, done.stdout) == (125, "")
    assert "no token" in done.stderr


async def test_local_serves_the_current_directory(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "")}
    async with connected("--local", env=env, cwd=tmp_path) as session:
        ran = await call(session, "run", command=["pwd"])
    assert (ran["exit_code"], ran["stdout"]) == (0, f"{tmp_path}\n")
    assert "paddock logs" not in (ran["truncated"] or "")


async def test_lease_is_carried_by_every_call_until_superseded(
    target: Target, workdir: Path, tmp_path: Path
) -> None:
    env = environment(target) | {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    seat = f"mcp-{uuid.uuid4().hex[:8]}"

    def lease(*args: str) -> dict[str, Any]:
        taken = subprocess.run(
            [*CLI, "lease", "take", "--json", "--seat", seat, *args],
            env=os.environ | env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode == 0, taken.stderr
        return dict(json.loads(taken.stdout))

    first = lease()
    async with connected("--lease", first["lease_id"], env=env) as client:
        shown = await call(client, "run", command='echo "$PADDOCK_LEASE_GENERATION"')
        assert shown["stdout"] == "1\n"
        await call(client, "write_file", path=str(workdir / "f"), content="held")
        session = await call(client, "session_start", cwd=str(workdir))
        assert session["state"] == "open", session
        # The session's own shell was started under the lease.
        sid = session["session_id"]
        shell = await call(client, "run", command='echo "$PADDOCK_LEASE_GENERATION"', session=sid)
        assert shell["stdout"] == "1\n"
        lease("--supersede")
        late = await call(client, "run", command=["true"])
        assert late["refusal"]["rule"] == "stale-lease"
        in_session = await call(client, "run", command=["true"], session=session["session_id"])
        assert in_session["refusal"]["rule"] == "stale-lease"
        written = await call(client, "write_file", path=str(workdir / "f"), content="zombie")
        assert written["refusal"]["rule"] == "stale-lease"
    assert (workdir / "f").read_text() == "held"
