"""A submit whose caller is cancelled while its turn starts (an in-process client that timed
out, a request ended by a stopping server) still leaves a turn like any other: followed, so
it can be ended; recorded; its seat freed; ended with the rest when the target stops. Cut
short, it left the fence running with nobody to end it, even past the server's own end."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
import pytest
import trustme
from conftest import make_settings, wait_until
from test_durability import served

from shared.walk import canonical_path
from shared.wire import Session, SessionRequest, Turn, TurnRequest
from target_side.config import Settings
from target_side.fence import pipes
from target_side.fence.held import FailureHook, no_failure
from target_side.fence.identity import InProcess
from target_side.fence.launch import StartingTurn
from target_side.fence.limits import Limiter
from target_side.fence.runner import RunningTurn
from target_side.service import sessions as sessions_module
from target_side.service.app import create_app
from target_side.service.sessions import SessionManager
from target_side.service.turns import TurnManager

T = TypeVar("T")
LINGER = "47.25"
"""The turn's ``sleep``: a number no other test's command uses, to find it by."""


@pytest.mark.parametrize("where", ["while_planned", "while_followed"])
@pytest.mark.parametrize("then", ["killed", "target_stops"])
async def test_a_turn_whose_submit_was_cancelled_is_followed_ended_and_recorded(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch, where: str, then: str
) -> None:
    settings = _one_turn_at_a_time(make_settings(Path(canonical_path(tmp_path)), ca))
    submits: list[asyncio.Task[Turn]] = []
    app = create_app(settings, _cancelling(where, lambda: submits[0], monkeypatch))
    async with served(app) as client:
        manager: TurnManager = app.state.manager
        request = TurnRequest(role="builder", argv=["sleep", LINGER])
        submits.append(asyncio.create_task(manager.submit(request)))
        with pytest.raises(asyncio.CancelledError):
            await submits[0]
        if then == "killed":
            assert await asyncio.to_thread(wait_until, lambda: bool(_lingering()), 10), "never ran"
            (turn,) = await _listed_within(manager, 10)
            url = f"/v1/turns/{turn.turn_id}/signal"
            assert (await client.post(url, json={"signal": "KILL"})).status_code == 202
            assert await _ended_within(manager, 10), "the turn never got an end"
            after = await client.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
            assert after.status_code == 201, after.text  # its seat under the cap is free
    # Stopped while its turn was still starting, the target waited for it and ended it.
    await asyncio.sleep(1)
    assert not _lingering(), "a fence outlived the server"
    again = create_app(settings)
    async with served(again):
        states = [t.state for t in await _turns(again.state.manager)]
    assert states and set(states) == {"exited"}, states  # recorded as ended, not found "lost"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()  # a pipe of the turn's left open would say so here


def test_the_probe_finds_a_running_sleep() -> None:
    """``_lingering`` does see such a process (a probe that cannot would pass the test)."""
    child = subprocess.Popen(["sleep", LINGER])
    try:
        assert wait_until(lambda: child.pid in _lingering(), 5)
    finally:
        child.kill()
        child.wait()


def _one_turn_at_a_time(settings: Settings) -> Settings:
    server = settings.server.model_copy(update={"max_turns": 1})
    return settings.model_copy(update={"server": server})


def _cancelling(
    where: str, submit: Callable[[], asyncio.Task[Turn]], monkeypatch: pytest.MonkeyPatch
) -> FailureHook:
    """The submit cancelled as its bubblewrap is about to start on its planning thread (the
    hook returned), or as the started turn is about to be followed on the loop."""
    if where == "while_planned":
        loop = asyncio.get_running_loop()

        def inject(step: str) -> None:
            if step == "open-to-launch":
                loop.call_soon_threadsafe(submit().cancel)

        return inject
    real_running = StartingTurn.running

    async def running(starting: StartingTurn) -> RunningTurn:
        submit().cancel()
        await asyncio.sleep(0)
        return await real_running(starting)

    monkeypatch.setattr(StartingTurn, "running", running)
    return no_failure


def _lingering() -> list[int]:
    """Processes running the turn's ``sleep`` (bubblewrap's included: it names it too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if LINGER.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def _turns(manager: TurnManager) -> list[Turn]:
    return await manager.recent(frozenset({"builder"}), 10)


async def _listed_within(manager: TurnManager, seconds: float) -> list[Turn]:
    """The turns listed, once there are any (its start is recorded once its fence runs)."""
    return await _polled(lambda: _turns(manager), bool, seconds)


async def _ended_within(manager: TurnManager, seconds: float) -> bool:
    return _all_ended(await _polled(lambda: _turns(manager), _all_ended, seconds))


def _all_ended(turns: list[Turn]) -> bool:
    return bool(turns) and all(t.state != "running" for t in turns)


async def _polled(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], seconds: float
) -> T:
    """What ``probe`` says, once ``done`` with it or after ``seconds`` (the last it said)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not done(seen := await probe()) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return seen


@pytest.mark.parametrize("when", ["before_it_is_handed_over", "while_its_pipes_connect"])
async def test_a_spawn_nobody_follows_any_more_is_killed_and_its_pipes_closed(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Below the turn manager (a file operation's or a session's launch): the process its
    waiter gave up on is killed once it is there, and nothing of it stays open."""
    if when == "while_its_pipes_connect":
        real_read_end = pipes.read_end
        connected: list[object] = []

        async def read_end(pipe: IO[bytes]) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
            if connected:
                raise asyncio.CancelledError  # stdin and stdout connected, stderr next
            connected.append(pipe)
            return await real_read_end(pipe)

        monkeypatch.setattr(pipes, "read_end", read_end)
    loop = asyncio.get_running_loop()
    ids = (os.getuid(), os.getgid())
    spawning = InProcess().start(loop, ids, ["sleep", LINGER], (), stdin_open=True)
    waiting = asyncio.create_task(spawning.process())
    if when == "before_it_is_handed_over":
        await asyncio.sleep(0)
        waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    status = await asyncio.wait_for(asyncio.shield(spawning.worker.ended), 10)
    assert status == -signal.SIGKILL
    await asyncio.sleep(0.05)  # the transports' last callbacks
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()


@pytest.mark.parametrize("where", ["while_planned", "while_its_shell_starts"])
async def test_a_session_whose_create_was_cancelled_opens_and_can_be_ended(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The same for a session: cut short, it stayed open for ever, its seat under the caps
    taken, with no shell, or with a shell that nothing would end when idle."""
    settings = _one_turn_at_a_time(make_settings(Path(canonical_path(tmp_path)), ca))
    creates: list[asyncio.Task[Session]] = []
    _cancel_session_create(where, lambda: creates[0], monkeypatch)
    app = create_app(settings)
    async with served(app) as client:
        manager: TurnManager = app.state.manager
        creates.append(asyncio.create_task(manager.sessions.create(SessionRequest(role="builder"))))
        with pytest.raises(asyncio.CancelledError):
            await creates[0]
        (session,) = manager.sessions.listed(frozenset({"builder"}), 10)
        url = f"/v1/sessions/{session.session_id}"
        opened = await _session_within(client, url, lambda s: s["started_at"] is not None, 10)
        assert opened["state"] == "open" and opened["started_at"], opened  # and its idle clock
        assert (await client.delete(url)).status_code == 200
        assert await _session_within(client, url, lambda s: s["state"] == "closed", 10)
        after = await client.post("/v1/turns", json={"role": "builder", "argv": ["true"]})
        assert after.status_code == 201, after.text  # its seat under the cap is free


def _cancel_session_create(
    where: str, create: Callable[[], asyncio.Task[Session]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create cancelled while its session is planned on a thread, or while it waits
    for the session's shell to say it is ready."""
    manager = SessionManager
    if where == "while_planned":
        real_plan = manager._plan

        def plan(sessions: SessionManager, *args: object) -> object:
            create().get_loop().call_soon_threadsafe(create().cancel)
            return real_plan(sessions, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(manager, "_plan", plan)
        return
    real_launch_turn = sessions_module.launch_turn

    async def launch_turn(*args: object, **kwargs: object) -> RunningTurn:
        launched = await real_launch_turn(*args, **kwargs)  # type: ignore[arg-type]
        create().cancel()  # the shell started, its hello not yet read
        return launched

    monkeypatch.setattr(sessions_module, "launch_turn", launch_turn)


async def _session_within(
    client: httpx.AsyncClient, url: str, done: Callable[[dict[str, Any]], bool], seconds: float
) -> dict[str, Any]:
    async def seen() -> dict[str, Any]:
        return (await client.get(url)).json()

    return await _polled(seen, done, seconds)


KILLED_AT_START_ROUNDS = 16
"""Turns killed the moment they start: 7 in 20 outlived the kill without the fix."""


@pytest.mark.parametrize("fence", ["born_inside_its_cgroups", "moved_in_at_its_gate"])
async def test_a_turn_killed_as_it_starts_ends_at_once(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch, fence: str
) -> None:
    """Killed before its fence is held, only bubblewrap was killed: its child, not yet
    asking for its parent-death signal, ran on (its command too) until the turn's cgroups
    were emptied, 5 s later."""
    if fence == "moved_in_at_its_gate":
        monkeypatch.setattr(Limiter, "start_nursery", lambda limiter, loop: None)
    app = create_app(make_settings(Path(canonical_path(tmp_path)), ca))
    builder = frozenset({"builder"})
    async with served(app):
        manager: TurnManager = app.state.manager
        for _ in range(KILLED_AT_START_ROUNDS):
            turn = await manager.submit(TurnRequest(role="builder", argv=["sleep", LINGER]))
            manager.signal(manager.get(turn.turn_id, builder), "KILL")
            assert await _ended_within(manager, 2), "a turn outlived its kill"
            assert not _lingering()
