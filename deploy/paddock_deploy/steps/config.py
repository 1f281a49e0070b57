"""Step 6: ``CONFIG_DIR/target.toml``: written when absent, else only extended with new roles.

A token is minted for each new role (only its hash is kept), and the file is
checked as the service user before it is installed ``root:USER 0640``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

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
            roles=new_roles,
            workspaces=ctx.opts.workspace,
        )
    else:
        have = existing.get("roles", {})
        new_roles = [r for r in dict.fromkeys(ctx.opts.role) if r not in have]
        if not new_roles:
            check_config(ctx, dest, account)
            return Outcome(
                False,
                f"nothing to do ({dest} has role(s) {', '.join(have)}; "
                "it checks clean as the service user)",
            )
        added = render_roles(new_roles, ctx.opts.workspace)
        text = dest.read_text().rstrip("\n") + "\n" + added
    install_config(ctx, dest, text, new_roles, account)
    ctx.restart_reasons.append("config")
    verb = "wrote" if existing is None else "added role(s) to"
    return Outcome(
        True,
        f"{verb} {dest} (root:{account.name} 0640) with role(s) "
        f"{', '.join(new_roles)}; minted a token for each (shown at the end)",
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
        'identity = "server"\n'
        f"path = {toml_str(FENCE_PATH)}\n"
        "forbidden = []\n" + render_roles(roles, workspaces)
    )


def render_roles(roles: list[str], workspaces: list[str]) -> str:
    # A placeholder hash nobody holds the token for; ``token mint`` replaces it before install.
    listed = ", ".join(toml_str(w) for w in workspaces)
    return "".join(
        f"\n[roles.{role}]\n"
        f'token_sha256 = "{hashlib.sha256(secrets.token_bytes(32)).hexdigest()}"\n'
        f"workspaces = [{listed}]\n"
        for role in roles
    )


def install_config(
    ctx: Context, dest: Path, text: str, new_roles: list[str], account: Account
) -> None:
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
        check_config(ctx, staged, account)
        before = snapshot(dest)
        ctx.tx.on_failure(f"{dest} as it was", lambda: restore(dest, before))
        write_file(dest, staged.read_bytes(), 0o640, 0, account.gid)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    ctx.tokens.update(tokens)


def mint(ctx: Context, role: str, staged: Path) -> str:
    out = ctx.run(
        [ctx.target_bin(), "token", "mint", role, "--config", str(staged)],
        show_stdout_on_error=False,
    ).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if not lines or " " in lines[-1]:
        raise DeployError(f"token mint for role {role} printed no token")
    return lines[-1]


def check_config(ctx: Context, path: Path, account: Account) -> None:
    """``config check`` as the service user: exactly what the server will be able to read."""
    proc = subprocess.run(
        [*as_user(account), ctx.target_bin(), "config", "check", str(path)],
        capture_output=True,
        text=True,
        env=user_env(account),
        check=False,
        cwd="/",
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    if proc.returncode != 0:
        raise DeployError(f"the config does not check clean as {account.name}: {tail(proc.stderr)}")
