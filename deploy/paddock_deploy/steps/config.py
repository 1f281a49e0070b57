"""Step 6: ``CONFIG_DIR/target.toml``: written when absent, else only extended with new roles;
then each role's workspaces, owned by the role's uid.

A token is minted for each new role (only its hash is kept), and the file is
checked as the service user before it is installed ``root:USER 0640``. The
check also says which host uid each role's turns run as; a role's workspace
that is missing is made for it: owner the role's uid, group the service
user's, mode 2750 (deploy/README.md, "Turns as role uids", says why).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from paddock_deploy.commands import tail
from paddock_deploy.context import CONFIG_NAME, Context, Outcome
from paddock_deploy.errors import DeployError
from paddock_deploy.files import restore, snapshot, write_file
from paddock_deploy.service_user import Account, as_user, user_env
from paddock_deploy.supervisor import SERVER_PATH

FENCE_PATH = SERVER_PATH
"""The PATH turns get: the one the server itself runs with."""


def run(ctx: Context) -> Outcome:
    account = ctx.need_account()
    dest = ctx.config_file
    existing = ctx.existing
    if existing is None:
        if ctx.cert_file is None or ctx.key_file is None:
            raise DeployError("internal: the TLS paths are not known yet")
        new_roles = list(dict.fromkeys(ctx.opts.role))
        text = render_config(
            listen=ctx.listen,
            cert=ctx.cert_file,
            key=ctx.key_file,
            state_root=ctx.state_root,
            launcher=ctx.launcher_socket,
            roles=new_roles,
            workspaces=ctx.opts.workspace,
        )
    else:
        have = existing.get("roles", {})
        new_roles = [r for r in dict.fromkeys(ctx.opts.role) if r not in have]
        if not new_roles:
            made = settle(ctx, dest, account)
            return Outcome(
                bool(made),
                "; ".join(made)
                if made
                else f"nothing to do ({dest} has role(s) {', '.join(have)}; "
                "it checks clean as the service user)",
            )
        added = render_roles(new_roles, ctx.opts.workspace)
        text = dest.read_text().rstrip("\n") + "\n" + added
    made = install_config(ctx, dest, text, new_roles, account)
    ctx.restart_reasons.append("config")
    verb = "wrote" if existing is None else "added role(s) to"
    return Outcome(
        True,
        "; ".join(
            [
                f"{verb} {dest} (root:{account.name} 0640) with role(s) "
                f"{', '.join(new_roles)}; minted a token for each (shown at the end)",
                *made,
            ]
        ),
    )


def toml_str(value: str) -> str:
    # JSON's escapes are valid in a TOML basic string.
    return json.dumps(value, ensure_ascii=False)


def render_config(
    *,
    listen: str,
    cert: Path,
    key: Path,
    state_root: Path,
    launcher: Path,
    roles: list[str],
    workspaces: list[str],
) -> str:
    return (
        "# paddock target configuration, written by paddock-deploy.\n"
        "# Check it after an edit: paddock-target config check FILE (then restart the server).\n"
        "[server]\n"
        f"listen = {toml_str(listen)}\n"
        f"tls_cert = {toml_str(str(cert))}\n"
        f"tls_key = {toml_str(str(key))}\n"
        f"state_root = {toml_str(str(state_root))}\n"
        "\n[fence]\n"
        "# Turns run as their role's own uid, started by the privileged launcher listening here.\n"
        f"launcher = {toml_str(str(launcher))}\n"
        f"path = {toml_str(FENCE_PATH)}\n"
        "forbidden = []\n" + render_roles(roles, workspaces)
    )


def render_roles(roles: list[str], workspaces: list[str]) -> str:
    """A table per role; its workspaces are its own directories below each ``--workspace``."""
    # A placeholder hash nobody holds the token for; ``token mint`` replaces it before install.
    return "".join(
        f"\n[roles.{role}]\n"
        f'token_sha256 = "{hashlib.sha256(secrets.token_bytes(32)).hexdigest()}"\n'
        f"workspaces = [{', '.join(toml_str(f'{w}/{role}') for w in workspaces)}]\n"
        for role in roles
    )


def install_config(
    ctx: Context, dest: Path, text: str, new_roles: list[str], account: Account
) -> list[str]:
    """Stage, mint, check as the service user, then install atomically root:USER 0640.

    ``config apply`` is not used: run as root it refuses a key the service
    user owns, and it writes 0600 root, which the server could not read.
    """
    staging = Path(ctx.opts.config_dir) / f".staging-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o700)
    try:
        os.chown(staging, 0, account.gid)
        os.chmod(staging, 0o750)  # noqa: S103 - root and the service user's group only
        staged = staging / CONFIG_NAME
        write_file(staged, text.encode(), 0o640, 0, account.gid)
        tokens = {role: mint(ctx, role, staged) for role in new_roles}
        # mint rewrites the file 0600 root; the check must read it as the server will.
        os.chown(staged, 0, account.gid)
        os.chmod(staged, 0o640)
        made = settle(ctx, staged, account)
        before = snapshot(dest)
        ctx.tx.on_failure(f"{dest} as it was", lambda: restore(dest, before))
        write_file(dest, staged.read_bytes(), 0o640, 0, account.gid)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    ctx.tokens.update(tokens)
    return made


def mint(ctx: Context, role: str, staged: Path) -> str:
    out = ctx.run(
        [ctx.target_bin(), "token", "mint", role, "--config", str(staged)],
        show_stdout_on_error=False,
    ).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if not lines or " " in lines[-1]:
        raise DeployError(f"token mint for role {role} printed no token")
    return lines[-1]


def settle(ctx: Context, path: Path, account: Account) -> list[str]:
    """Check ``path`` as the service user, making the roles' missing workspaces on the way.

    The check says each role's uid even while a workspace is missing (a problem
    it reports): the workspaces are made for those uids, then it must pass.
    """
    report = check_config(ctx, path, account)
    roles = report.get("roles") or {}
    if not roles:
        raise DeployError(_not_clean(account, report))
    ctx.role_ids = {name: (int(r["uid"]), int(r["gid"])) for name, r in roles.items()}
    made = ensure_workspaces(ctx, {n: list(r["workspaces"]) for n, r in roles.items()}, account)
    if made or not report.get("ok"):
        report = check_config(ctx, path, account)
    if not report.get("ok"):
        raise DeployError(_not_clean(account, report))
    return made


def _not_clean(account: Account, report: dict[str, Any]) -> str:
    said = "; ".join(report.get("problems", [])) or report.get("stderr", "")
    return f"the config does not check clean as {account.name}: {said}"


def check_config(ctx: Context, path: Path, account: Account) -> dict[str, Any]:
    """``config check --json`` as the service user: exactly what the server will be able to
    read; its report (problems, notes, each role's host ids and workspaces)."""
    proc = subprocess.run(
        [*as_user(account), ctx.target_bin(), "config", "check", "--json", str(path)],
        capture_output=True,
        text=True,
        env=user_env(account),
        check=False,
        cwd="/",
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    try:
        report: dict[str, Any] = json.loads(proc.stdout)
    except ValueError:
        report = {}
    if proc.returncode != 0:
        report["ok"] = False
    report["stderr"] = tail(proc.stderr)
    return report


WORKSPACE_MODE = 0o2750
"""Owner the role (writes), group the service user (plans: searches and reads), nobody else;
setgid, so what the role makes keeps the group and the server can still read it."""


def ensure_workspaces(
    ctx: Context, workspaces: dict[str, list[str]], account: Account
) -> list[str]:
    """Make each role's missing workspace its own; say where an existing one is not."""
    said = []
    shared = _shared(workspaces)
    for role, paths in workspaces.items():
        uid, _ = ctx.role_ids[role]
        for workspace in map(Path, paths):
            if workspace in shared:
                # Listed by several roles on purpose: the operator arranges who may write.
                ctx.progress.note(
                    f"workspace {workspace} is shared by several roles: each one's uid needs "
                    "write access there (a gid the roles share, set as [roles.NAME] gid), and "
                    f"{account.name} read access; deploy leaves it as it is"
                )
                continue
            made = ctx.ensure_dir(workspace, WORKSPACE_MODE, uid, account.gid)
            if made:
                said.append(
                    f"{made} (role {role}'s workspace: uid {uid}, group {account.name}, 2750)"
                )
                continue
            st = workspace.stat()
            if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != (
                uid,
                account.gid,
                WORKSPACE_MODE,
            ):
                ctx.progress.note(
                    f"warning: workspace {workspace} of role {role} is uid {st.st_uid}, gid "
                    f"{st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}; its turns run as uid "
                    f"{uid} and the server plans as {account.name}: chown {uid}:{account.name} "
                    f"{workspace} && chmod 2750 {workspace}"
                )
    return said


def _shared(workspaces: dict[str, list[str]]) -> set[Path]:
    seen: dict[Path, int] = {}
    for paths in workspaces.values():
        for path in set(map(Path, paths)):
            seen[path] = seen.get(path, 0) + 1
    return {path for path, count in seen.items() if count > 1}
