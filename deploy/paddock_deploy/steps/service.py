"""Step 7: how the server and its launcher are run: two hardened systemd units where systemd is
PID 1, else the supervisor (``PREFIX/bin/paddock-supervise`` and its settings beside it)."""

from __future__ import annotations

import functools
import grp
import importlib.resources
import json
import sys
from pathlib import Path

from paddock_deploy.context import Context, Outcome
from paddock_deploy.files import restore, snapshot, write_file
from paddock_deploy.systemd_unit import (
    LAUNCHER_UNIT_NAME,
    UNIT_NAME,
    render_launcher_unit,
    render_unit,
    systemctl,
    systemctl_says_yes,
)


def run(ctx: Context) -> Outcome:
    if ctx.mode == "systemd":
        return install_unit(ctx)
    return install_supervisor(ctx)


def install_unit(ctx: Context) -> Outcome:
    account = ctx.need_account()
    launcher = render_launcher_unit(
        prefix=ctx.prefix,
        config=ctx.config_file,
        state_root=ctx.state_root,
        workspaces=ctx.opts.workspace,
        socket=ctx.launcher_socket,
    )
    server = render_unit(
        user=account.name,
        group=grp.getgrgid(account.gid).gr_name,
        prefix=ctx.prefix,
        config=ctx.config_file,
        state_root=ctx.state_root,
        workspaces=ctx.opts.workspace,
    )
    done = []
    for name, unit, text in (
        (LAUNCHER_UNIT_NAME, ctx.launcher_unit_file, launcher),
        (UNIT_NAME, ctx.unit_file, server),
    ):
        done += _install_one(ctx, name, unit, text)
    said = (
        "; ".join(done) if done else f"nothing to do ({ctx.unit_file} and its launcher are current)"
    )
    return Outcome(bool(done), said)


def _install_one(ctx: Context, name: str, unit: Path, text: str) -> list[str]:
    before = snapshot(unit)
    done = []
    if before is None or before.data != text.encode():

        def put_back() -> None:
            restore(unit, before)
            systemctl("daemon-reload")

        ctx.tx.on_failure(f"{unit} as it was (and systemctl daemon-reload)", put_back)
        write_file(unit, text.encode(), 0o644)
        systemctl("daemon-reload")
        ctx.service_changed = True
        done.append(f"wrote {unit}")
    if not systemctl_says_yes("is-enabled", unit=name):
        ctx.tx.on_failure(
            f"systemctl disable {name}", lambda: systemctl("disable", "--quiet", name)
        )
        systemctl("enable", "--quiet", name)
        done.append(f"enabled {name}")
    return done


def supervisor_source() -> bytes:
    """``paddock_deploy/supervisor.py`` as it is, read from the package (or the zipapp)."""
    return importlib.resources.files("paddock_deploy").joinpath("supervisor.py").read_bytes()


def supervisor_settings(ctx: Context) -> bytes:
    account = ctx.need_account()
    settings = {
        "user": account.name,
        "prefix": str(ctx.prefix),
        "config": str(ctx.config_file),
        "run_dir": str(ctx.state_root / "supervisor"),
        "launcher_dir": str(ctx.launcher_dir),
        "python": sys.executable,
    }
    return (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode()


def install_supervisor(ctx: Context) -> Outcome:
    wanted = {
        ctx.supervisor: (supervisor_source(), 0o755),
        ctx.supervisor_settings: (supervisor_settings(ctx), 0o644),
    }
    written = []
    for path, (data, mode) in wanted.items():
        before = snapshot(path)
        if before is not None and (before.data, before.mode, before.uid) == (data, mode, 0):
            continue
        ctx.tx.on_failure(f"{path} as it was", functools.partial(restore, path, before))
        write_file(path, data, mode)
        written.append(str(path))
    if not written:
        return Outcome(False, f"nothing to do ({ctx.supervisor} is current)")
    ctx.service_changed = True
    return Outcome(
        True,
        f"wrote {' and '.join(written)} (no systemd here: the server and its launcher run "
        "under this supervisor instead of units)",
    )
