"""Step 9: start the server and its launcher, or restart both when their release, config or
service changed.

An unchanged install keeps its processes (same pids). Under systemd the units
are (re)started, the launcher's first; elsewhere the supervisor is asked
through ``paddock-supervise``, which starts the launcher before the server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from paddock_deploy.context import Context, Outcome
from paddock_deploy.steps.release import current_release
from paddock_deploy.systemd_unit import (
    LAUNCHER_UNIT_NAME,
    UNIT_NAME,
    systemctl,
    systemctl_says_yes,
    unit_pid,
)

UNITS = (LAUNCHER_UNIT_NAME, UNIT_NAME)
"""In the order they start: the server's turns need the launcher."""


def run(ctx: Context) -> Outcome:
    if ctx.mode == "systemd":
        return restart_unit(ctx)
    return restart_supervised(ctx)


def restart_unit(ctx: Context) -> Outcome:
    retire_supervisor(ctx)
    active = systemctl_says_yes("is-active")
    both = active and systemctl_says_yes("is-active", unit=LAUNCHER_UNIT_NAME)
    ctx.was_running = active
    if both and not ctx.service_changed and not ctx.restart_reasons:
        return Outcome(
            False,
            f"nothing to do ({UNIT_NAME} is active, pid {unit_pid()}; its launcher, pid "
            f"{unit_pid(LAUNCHER_UNIT_NAME)})",
        )
    if active:
        ctx.tx.after_failure(
            f"restart {' and '.join(UNITS)} on the previous install",
            lambda: systemctl("restart", *UNITS),
        )
    else:
        ctx.tx.on_failure(f"stop {' and '.join(UNITS)}", lambda: systemctl("stop", *UNITS))
    systemctl("restart" if active else "start", *UNITS)
    ctx.server_pid = unit_pid()
    why = ", ".join(ctx.restart_reasons + (["unit"] if ctx.service_changed else []))
    verb = f"restarted ({why} changed)" if active else "started"
    return Outcome(
        True,
        f"{verb} {UNIT_NAME} under systemd, pid {ctx.server_pid}, and {LAUNCHER_UNIT_NAME}, "
        f"pid {unit_pid(LAUNCHER_UNIT_NAME)}",
    )


def retire_supervisor(ctx: Context) -> None:
    """A host that ran supervised and now has systemd: the unit takes the server over."""
    if not supervisor_ran_before(ctx) or not supervise(ctx, "status").get("supervisor_pid"):
        return
    ctx.tx.on_failure("start the supervised server again", lambda: supervise(ctx, "start"))
    supervise(ctx, "stop")
    ctx.restart_reasons.append("service")
    ctx.progress.note(
        f"stopped the supervised server ({ctx.supervisor}): systemd runs it from now on"
    )


def supervise(ctx: Context, command: str) -> dict[str, Any]:
    """Run ``paddock-supervise COMMAND``; its last line is its status as JSON."""
    proc = ctx.run(
        [sys.executable, str(ctx.supervisor), command],
        timeout=90,
        what=f"paddock-supervise {command}",
    )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def restart_supervised(ctx: Context) -> Outcome:
    status = supervise(ctx, "status") if supervisor_ran_before(ctx) else {}
    running = bool(status.get("supervisor_pid"))
    server = status.get("server") or {}
    ctx.was_running = running
    launcher = status.get("launcher") or {}
    current = str(current_release(ctx.current_link))
    stale = any(p.get("release") != current or not p.get("alive") for p in (server, launcher))
    reasons = ctx.restart_reasons + (["release"] if stale and running else [])
    if running and not ctx.service_changed and not reasons:
        ctx.server_pid = server.get("pid")
        return Outcome(
            False,
            f"nothing to do (supervised server pid {ctx.server_pid} runs {Path(current).name})",
        )
    register_supervised_undo(ctx, running)
    if running and ctx.service_changed:
        supervise(ctx, "stop")
        status = supervise(ctx, "start")
        verb = "restarted the supervisors, the launcher and the server"
    elif running:
        status = supervise(ctx, "restart")
        verb = (
            f"restarted the launcher and the server ({', '.join(dict.fromkeys(reasons))} changed)"
        )
    else:
        status = supervise(ctx, "start")
        verb = "started the launcher and the server"
    ctx.server_pid = (status.get("server") or {}).get("pid")
    return Outcome(
        True,
        f"{verb}: NO systemd here (PID 1 is not systemd), so it runs as a "
        f"supervised background process as {ctx.opts.user}: supervisor pid "
        f"{status.get('supervisor_pid')}, server pid {ctx.server_pid}, log "
        f"{status.get('log')}; its launcher runs as root, pid "
        f"{(status.get('launcher') or {}).get('pid')}, log {status.get('launcher_log')}; "
        "neither starts at boot by itself "
        f"(add '@reboot {sys.executable} {ctx.supervisor} start' to root's crontab)",
    )


def supervisor_ran_before(ctx: Context) -> bool:
    return ctx.supervisor.exists() and ctx.state_root.joinpath("supervisor").exists()


def register_supervised_undo(ctx: Context, running: bool) -> None:
    if not running:
        ctx.tx.on_failure("stop the supervised server", lambda: supervise(ctx, "stop"))
        return

    def back() -> None:
        if ctx.service_changed:
            supervise(ctx, "stop")
            supervise(ctx, "start")
        else:
            supervise(ctx, "restart")

    ctx.tx.after_failure("restart the previous install's server", back)
