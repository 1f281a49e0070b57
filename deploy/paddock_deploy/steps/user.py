"""Step 2: the system user the server runs as (created when missing)."""

from __future__ import annotations

import os
import pwd

from paddock_deploy.context import Context, Outcome
from paddock_deploy.errors import DeployError
from paddock_deploy.service_user import Account, remove_user


def run(ctx: Context) -> Outcome:
    name = ctx.opts.user
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        pass
    else:
        if pw.pw_uid == 0:
            raise DeployError(f"user {name} has uid 0; the server must not run as root")
        ctx.account = Account(name, pw.pw_uid, pw.pw_gid, pw.pw_dir)
        return Outcome(False, f"nothing to do (user {name} exists, uid {pw.pw_uid})")
    shell = next(
        (s for s in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(s)), "/bin/false"
    )
    ctx.tx.on_failure(f"remove user {name}", lambda: remove_user(name))
    ctx.run(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            str(ctx.state_root),
            "--shell",
            shell,
            "--comment",
            "paddock target",
            name,
        ]
    )
    pw = pwd.getpwnam(name)
    ctx.account = Account(name, pw.pw_uid, pw.pw_gid, pw.pw_dir)
    return Outcome(
        True,
        f"created system user {name} (uid {pw.pw_uid}), shell {shell}, home {ctx.state_root}",
    )
