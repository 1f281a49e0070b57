"""Planning a session: the fence a turn with the same fields would get, running the session host.

A session's fence is planned by ``plan_turn`` itself, from the session
request's own fields (``SessionRequest.fence_request``): the same walk, the
same forbidden list, protected names, per-role uid and limits, the same
refusals. Its program is the fence's own ``python3`` (found on the fence's
PATH and checked as any turn's program is), running the session host, which
is handed in from memory as a script turn's body is; the host runs the
``bash`` the planner found and checked the same way. Only then come the
session's own limits: how long it may live (``session_s``) and stay idle
(``session_idle_s``), each at most the role's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from shared.wire import SessionRequest, SessionTimes
from target_side.config import Settings
from target_side.errors import RefusedError
from target_side.policy import refusals
from target_side.policy.executables import resolve_executable
from target_side.policy.plan import FencePlan, plan_turn

HOST_PROGRAM = "python3"
SHELL = "bash"
HOST_PATH = "/run/paddock/session-host.py"
"""Where the session host appears inside the fence (read-only, from memory)."""
HOST_SOURCE = (Path(__file__).parent.parent / "fence" / "session_host.py").read_bytes()
"""The host's own source, read once: handed to every session's fence by descriptor."""


@dataclass(frozen=True)
class SessionPlan:
    """A session's fence, and the limits of its life and of its turns."""

    fence: FencePlan
    times: SessionTimes


def plan_session(
    request: SessionRequest, settings: Settings, session_id: str, etc_dir: str | None = None
) -> SessionPlan:
    """The session ``request`` would get, or the ``RefusedError`` a turn like it would get."""
    maxima = settings.roles[request.role].limits
    session_s = _within("session_s", request.limits.session_s, maxima.session_s)
    idle_s = _within("session_idle_s", request.limits.session_idle_s, maxima.session_idle_s)
    fence_request = request.fence_request([HOST_PROGRAM, "-I", "-S", HOST_PATH])
    try:
        plan = plan_turn(fence_request, settings, session_id, etc_dir=etc_dir)
    except RefusedError as exc:
        if exc.refusal.subject == "argv[0]":
            raise RefusedError(refusals.no_session_host(HOST_PROGRAM, exc.refusal.detail)) from exc
        raise
    try:
        shell, _ = resolve_executable(SHELL, plan.env["PATH"], plan.cwd, plan.mounts, plan.uid)
    except RefusedError as exc:
        raise RefusedError(refusals.no_session_host(SHELL, exc.refusal.detail)) from exc
    times = SessionTimes(
        session_s=session_s,
        session_idle_s=idle_s,
        wall_s=plan.limits.wall_s,
        output_mb=plan.limits.output_mb,
    )
    fence = replace(
        plan,
        argv=(*plan.argv, "--bash", shell),
        script=HOST_SOURCE,
        script_path=HOST_PATH,
        # The fence lives as long as the session; each turn's own time is the runner's.
        limits=plan.limits.model_copy(update={"wall_s": session_s}),
        stdin_open=True,
    )
    return SessionPlan(fence, times)


def _within(name: str, asked: float | None, most: float) -> float:
    if asked is not None and asked > most:
        raise RefusedError(refusals.limit_exceeds_role(name, asked, most))
    return most if asked is None else asked
