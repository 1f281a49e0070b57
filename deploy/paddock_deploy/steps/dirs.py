"""Step 3: the prefix, the config dir, the command dir, the state root and the workspaces."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from paddock_deploy.context import Context, Outcome
from paddock_deploy.errors import DeployError
from paddock_deploy.files import existing_ancestors, trusted_dir_problem
from paddock_deploy.service_user import Account, writable_by


def run(ctx: Context) -> Outcome:
    account = ctx.need_account()
    root_dirs = [
        ctx.prefix,
        ctx.releases,
        ctx.prefix / "bin",
        Path(ctx.opts.config_dir),
        Path(ctx.opts.bin_dir),
    ]
    # Root creates and chowns these: nobody else may be able to swap a directory above them.
    to_make = [Path(w) for w in ctx.opts.workspace if not Path(w).exists()]
    for top in (*root_dirs, ctx.state_root, *to_make):
        for ancestor in existing_ancestors(top):
            problem = trusted_dir_problem(ancestor)
            if problem:
                raise DeployError(f"{problem} (it is above {top})")
    said = [ctx.ensure_dir(p, 0o755, 0, 0) for p in root_dirs]
    said.append(ensure_state_root(ctx, account))
    said += [ensure_workspace(ctx, Path(w), account) for w in ctx.opts.workspace]
    done = [d for d in said if d]
    return Outcome(bool(done), "; ".join(done) if done else "nothing to do")


STATE_MODE = 0o711


def ensure_state_root(ctx: Context, account: Account) -> str | None:
    state = ctx.state_root
    # Searchable, never listable: turns (as their role's uid) reach their home by path.
    made = ctx.ensure_dir(state, STATE_MODE, account.uid, account.gid)
    if made:
        return f"{made} (0711, {account.name})"
    st = state.lstat()
    if st.st_uid != account.uid:
        raise DeployError(
            f"{state} belongs to uid {st.st_uid}, not {account.name}: the server could not "
            f"write there (chown -R {account.name}: {state}, or choose another --state-root)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != STATE_MODE:
        ctx.tx.on_failure(f"mode of {state} back to {mode:04o}", lambda: os.chmod(state, mode))
        os.chmod(state, STATE_MODE)
        return f"{state}: mode {mode:04o} set to 0711"
    return None


def ensure_workspace(ctx: Context, workspace: Path, account: Account) -> str | None:
    made = ctx.ensure_dir(workspace, 0o750, account.uid, account.gid)
    if made:
        return f"{made} (workspace, {account.name}, 0750)"
    if not writable_by(workspace.stat(), account):
        ctx.progress.note(
            f"warning: workspace {workspace} is not writable by {account.name}; "
            f"turns can read it but not write there (chown or chmod it)"
        )
    return None
