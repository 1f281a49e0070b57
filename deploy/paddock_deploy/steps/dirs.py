"""Step 3: the prefix, the config dir, the command dir, the state root, the directories the
roles' workspaces go in, and the launcher socket's directory.

The roles' own workspaces (``DIR/ROLE``) belong to the role's uid; they are made
by the config step, once the config says which uid each role has."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from paddock_deploy.context import Context, Outcome
from paddock_deploy.errors import DeployError
from paddock_deploy.files import existing_ancestors, trusted_dir_problem
from paddock_deploy.service_user import Account


def run(ctx: Context) -> Outcome:
    account = ctx.need_account()
    root_dirs = [
        ctx.prefix,
        ctx.releases,
        ctx.prefix / "bin",
        Path(ctx.opts.config_dir),
        Path(ctx.opts.bin_dir),
        ctx.launcher_socket.parent,
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
    # Searchable by every role's uid, listable by all: the roles' own directories go below.
    said += [_made(ctx.ensure_dir(Path(w), 0o755, 0, 0), "workspaces") for w in to_make]
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


def _made(said: str | None, what: str) -> str | None:
    return f"{said} ({what}, root, 0755)" if said else None
