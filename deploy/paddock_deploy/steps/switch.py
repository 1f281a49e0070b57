"""Step 8: ``PREFIX/current`` to the new release, atomically, and ``paddock-target`` on root's
PATH (``BIN_DIR/paddock-target`` -> ``PREFIX/current/bin/paddock-target``)."""

from __future__ import annotations

import os
import stat

from paddock_deploy.context import Context, Outcome
from paddock_deploy.files import link_target, point_link
from paddock_deploy.steps.release import current_release


def run(ctx: Context) -> Outcome:
    done = [d for d in (switch_current(ctx), link_command(ctx)) if d]
    if not done:
        return Outcome(
            False,
            f"nothing to do ({ctx.current_link} -> {ctx.need_release().name}; "
            f"{ctx.command_link} -> {ctx.current_command})",
        )
    return Outcome(True, "; ".join(done))


def switch_current(ctx: Context) -> str | None:
    release = ctx.need_release()
    link = ctx.current_link
    if current_release(link) == release:
        return None
    previous = ctx.previous
    was = os.path.relpath(previous, link.parent) if previous else None
    ctx.tx.on_failure(
        f"{link} back to {previous.name if previous else 'nothing'}",
        lambda: point_link(link, was),
    )
    point_link(link, os.path.relpath(release, link.parent))
    ctx.restart_reasons.append("release")
    return f"{link} -> {release.name} (was {previous.name if previous else 'nothing'})"


def link_command(ctx: Context) -> str | None:
    """The operator types ``paddock-target doctor``; a file that is not a link is left alone."""
    link, wanted = ctx.command_link, str(ctx.current_command)
    before = link_target(link)
    if before == wanted:
        return None
    try:
        st = link.lstat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISLNK(st.st_mode):
        ctx.progress.note(
            f"{link} exists and is not a symlink, so it is left as it is; "
            f"the deployed command is {wanted}"
        )
        return None
    ctx.tx.on_failure(f"{link} as it was", lambda: point_link(link, before))
    point_link(link, wanted)
    return f"{link} -> {wanted}" + (f" (was -> {before})" if before else "")
