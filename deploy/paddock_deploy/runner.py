"""Runs the steps in order; on any failure rolls this run's changes back; reports the result.

The result line is the commit point: once it is delivered (with any new
token), the run stands. Until then a failure anywhere, a signal, or a lost
output channel undoes every change in reverse order, so the previous install
keeps serving.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from paddock_deploy.context import Context
from paddock_deploy.errors import InjectedFailure, Interrupted, Refused
from paddock_deploy.protocol import STEPS, Exit, certificate_sha256, failure_result
from paddock_deploy.steps import RUN
from paddock_deploy.steps.health import base_url, check_previous
from paddock_deploy.steps.release import current_release, releases_to_prune
from paddock_deploy.transaction import signals_ignored


def deploy(ctx: Context) -> Exit:
    name = STEPS[0]
    try:
        for name in STEPS:
            started = time.monotonic()
            ctx.progress.started(name)
            outcome = RUN[name](ctx)
            if ctx.opts.fail_at == name:
                raise InjectedFailure(f"failure injected after step {name!r} did its work")
            ctx.progress.finished(name, outcome.changed, outcome.detail, time.monotonic() - started)
        report_result(ctx)  # the commit point: the result (and any token) was delivered
    except Exception as exc:  # whatever went wrong, this run's changes must be undone
        ctx.progress.failed(name, str(exc) or type(exc).__name__)
        return fail(ctx, name, exc)
    prune(ctx)
    return Exit.OK


def fail(ctx: Context, step: str, exc: BaseException) -> Exit:
    with signals_ignored():
        changed = ctx.tx.changed
        problems = ctx.tx.roll_back(ctx.progress.rollback) if changed else []
        serving = check_previous(ctx) if changed and not problems else None
    if not changed:
        code, summary = Exit.REFUSED, "nothing was changed"
    elif problems:
        code = Exit.ROLLBACK_INCOMPLETE
        summary = "ROLLBACK INCOMPLETE; the host needs a look: " + "; ".join(problems)
    else:
        code = Exit.ROLLED_BACK
        summary = "rolled back: " + (serving or "this run's changes are undone")
    event = failure_result(
        step, str(exc), rolled_back=changed and not problems, problems=problems, summary=summary
    )
    text = f"paddock-deploy failed at {step}: {exc}\n  {summary}"
    ctx.progress.emit(event, text, must_arrive=False)
    return code


def report_result(ctx: Context) -> None:
    url = base_url(ctx)[0]
    ca_pem = ctx.ca_file.read_text() if ctx.ca_file else None
    release = ctx.need_release()
    changed = ctx.tx.changed
    result: dict[str, Any] = {
        "event": "result",
        "ok": True,
        "changed": changed,
        "release": release.name,
        "previous_release": ctx.previous.name if ctx.previous else None,
        "url": url,
        "listen": ctx.listen,
        "config": str(ctx.config_file),
        "ca_file": str(ctx.ca_file) if ctx.ca_file else None,
        "ca_pem": ca_pem,
        "ca_sha256": certificate_sha256(ca_pem) if ca_pem else None,
        "cert_sha256": certificate_sha256(ctx.cert_file.read_text()) if ctx.cert_file else None,
        "service": {
            "mode": ctx.mode,
            "pid": ctx.server_pid,
            "supervisor": str(ctx.supervisor) if ctx.mode == "supervised" else None,
        },
        "command": str(ctx.command_link),
        "health": ctx.health,
        "tokens": ctx.tokens,
    }
    ctx.progress.emit(result, "\n".join(result_lines(ctx, result)), must_arrive=True)


def result_lines(ctx: Context, result: dict[str, Any]) -> list[str]:
    release = ctx.need_release()
    was = f" (was {ctx.previous.name})" if ctx.previous and ctx.previous != release else ""
    done = "deployed" if result["changed"] else "unchanged (nothing to do)"
    lines = [
        f"paddock target {done}: release {release.name}{was}",
        f"  url:             {result['url']}",
        f"  health:          {ctx.health.get('status')}",
        f"  service:         {ctx.mode}, server pid {ctx.server_pid}",
        f"  config:          {ctx.config_file}",
        f"  command:         {ctx.command_link} (e.g. paddock-target doctor)",
    ]
    if result["ca_pem"]:
        lines += [
            f"  CA certificate:  {ctx.ca_file}",
            f"  CA SHA-256:      {result['ca_sha256']}",
        ]
    else:
        lines += [f"  certificate SHA-256 (operator's, pin it): {result['cert_sha256']}"]
    lines += [
        f"  token for role {role} (shown once; only its hash is kept): {token}"
        for role, token in ctx.tokens.items()
    ]
    if not ctx.tokens:
        lines.append("  no new roles: existing roles keep their tokens")
    return lines


def prune(ctx: Context) -> None:
    """Keep the current release and the two before it; failures here are only reported."""
    try:
        for old in releases_to_prune(ctx.releases, current_release(ctx.current_link)):
            shutil.rmtree(old)
            ctx.progress.note(f"removed old release {old.name}")
    except OSError as exc:
        ctx.progress.note(f"warning: could not remove old releases: {exc}")


def interrupted(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(f"stopped by signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def deploy_lock(prefix: Path) -> Iterator[None]:
    """One deploy per prefix at a time (the lock lives outside the prefix, which may not exist).

    The lock file is removed on the way out; whoever locks it checks afterwards
    that the name still leads to the file it locked, or starts over.
    """
    directory = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/run")
    name = hashlib.sha256(str(prefix).encode()).hexdigest()[:16]
    path = directory / f"paddock-deploy.{name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise Refused(f"another paddock-deploy is running for {prefix}") from exc
        try:
            held, named = os.fstat(fd), os.stat(path)
        except FileNotFoundError:
            named = None
        if named is not None and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
            break
        os.close(fd)  # unlinked by the deploy before us while we waited: take the new one
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
