"""Step 1: is this host fit, and are the arguments? Installs missing system packages only."""

from __future__ import annotations

import email.parser
import importlib.machinery
import os
import pwd
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from paddock_deploy.addresses import split_listen
from paddock_deploy.commands import (
    PIP_WITH_PYTHON_OPTION,
    TRUSTED_PATH,
    base_env,
    system_pip_version,
)
from paddock_deploy.context import DEFAULT_LISTEN, DEFAULT_STATE_ROOT, Context, Outcome, Wheel
from paddock_deploy.errors import DeployError, Refused
from paddock_deploy.files import sha256_file
from paddock_deploy.protocol import wheel_problem
from paddock_deploy.systemd_unit import render_launcher_unit, render_unit, under

ROLE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}")
BWRAP_PATH = "/usr/bin:/bin:/usr/local/bin"


def run(ctx: Context) -> Outcome:
    if os.geteuid() != 0:
        raise Refused(
            "run paddock-deploy as root: it creates a system user and writes "
            "below /etc, the prefix and the state root"
        )
    if sys.version_info < (3, 11):  # noqa: UP036 - the target's python3, not ours
        raise Refused(
            f"Python {sys.version.split()[0]} is too old; paddock needs 3.11 or "
            "newer (run this script with a newer python3)"
        )
    unreachable = interpreter_hidden_from_others(Path(sys.executable))
    if unreachable is not None:
        raise Refused(
            f"{sys.executable} lies under {unreachable}, which other users cannot "
            "enter, so the service user could not run the release built with it; "
            "run this script with the system python3 (e.g. /usr/bin/python3)"
        )
    ctx.wheel = wheel = inspect_wheel(Path(ctx.opts.wheel))
    ctx.existing = read_existing_config(ctx.config_file)
    check_arguments(ctx)
    adopt_existing_config(ctx)
    ctx.mode = service_mode(ctx)
    installed = install_packages(ctx)
    bwrap = shutil.which("bwrap", path=BWRAP_PATH)
    if bwrap is None:
        raise Refused(
            "bubblewrap is not installed and apt-get is not available: "
            "install bubblewrap, then run this again"
        )
    for tool in ("setpriv", *(() if user_exists(ctx.opts.user) else ("useradd", "userdel"))):
        if shutil.which(tool, path=TRUSTED_PATH) is None:
            raise Refused(f"{tool} is not installed (Debian: util-linux / passwd)")
    version = ctx.run([bwrap, "--version"]).stdout.strip()
    detail = (
        f"root, Python {sys.version.split()[0]}, {version} at {bwrap}, "
        f"wheel paddock {wheel.version} (sha256 {wheel.sha256[:12]}), "
        f"service: {ctx.mode}"
    )
    if installed:
        detail += f"; installed {', '.join(installed)}"
    return Outcome(bool(installed), detail)


def inspect_wheel(path: Path) -> Wheel:
    problem = wheel_problem(path)
    if problem is not None:
        raise Refused(problem)
    try:
        with zipfile.ZipFile(path) as wheel:
            meta = [
                n
                for n in wheel.namelist()
                if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
            ]
            if len(meta) != 1:
                raise Refused(f"{path} has no single METADATA file")
            headers = email.parser.HeaderParser().parsestr(wheel.read(meta[0]).decode())
    except zipfile.BadZipFile as exc:
        raise Refused(f"{path} is not a wheel (zip) file") from exc
    if headers.get("Name") != "paddock":
        raise Refused(f"{path} is {headers.get('Name')!r}, not paddock")
    version = headers.get("Version", "")
    if not VERSION.fullmatch(version):
        raise Refused(f"{path} has an unusable version {version!r}")
    return Wheel(path.resolve(), version, sha256_file(path))


def read_existing_config(path: Path) -> dict[str, Any] | None:
    import tomllib  # here, so that an older python3 reaches the version check

    if not path.exists():
        return None
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DeployError(
            f"{path} is not valid TOML ({exc}); fix it, or move it away to have a new one written"
        ) from exc


def check_arguments(ctx: Context) -> None:
    opts = ctx.opts
    if not USER_NAME.fullmatch(opts.user) or opts.user == "root":
        raise Refused(f"--user {opts.user!r} is not a usable system user name")
    for role in opts.role:
        if not ROLE_NAME.fullmatch(role):
            raise Refused(f"--role {role!r}: use letters, digits, '_', '.', '-' (at most 64)")
    if not opts.role and not ctx.config_file.exists():
        raise Refused(f"{ctx.config_file} does not exist yet: give at least one --role")
    split_listen(opts.listen or DEFAULT_LISTEN)
    if (opts.tls_cert is None) != (opts.tls_key is None):
        raise Refused("give both --tls-cert and --tls-key, or neither")
    for given in (opts.tls_cert, opts.tls_key):
        if given is not None and not Path(given).is_file():
            raise Refused(f"{given} does not exist")
    for find_links in opts.find_links:
        if not Path(find_links).is_dir():
            raise Refused(f"--find-links {find_links}: no such directory")


def adopt_existing_config(ctx: Context) -> None:
    """An existing config wins over the flags: it is what the server runs with."""
    opts = ctx.opts
    server = (ctx.existing or {}).get("server", {})
    given = {
        "--listen": (opts.listen, server.get("listen")),
        "--state-root": (opts.state_root, server.get("state_root")),
    }
    for flag, (wanted, kept) in given.items():
        if wanted is not None and kept is not None and wanted != kept:
            ctx.progress.note(
                f"{ctx.config_file} exists and says {kept}; {flag} {wanted} "
                "is not applied (edit the file to change it)"
            )
    fence = (ctx.existing or {}).get("fence", {})
    kept = fence.get("launcher")
    if isinstance(kept, str):
        if opts.given_launcher_socket not in (None, kept):
            ctx.progress.note(
                f"{ctx.config_file} exists and says launcher = {kept}; --launcher-socket "
                f"{opts.given_launcher_socket} is not applied (edit the file to change it)"
            )
        opts.launcher_socket = kept
    if fence.get("identity") == "server":
        ctx.progress.note(
            f'{ctx.config_file} says identity = "server": every turn runs as {opts.user}, not '
            f"as its role's uid. To change that, replace it in [fence] with launcher = "
            f'"{opts.launcher_socket}", give each role\'s workspace to its uid (deploy/README.md, '
            '"Turns as role uids"), and re-run'
        )
    ctx.listen = server.get("listen") or opts.listen or DEFAULT_LISTEN
    ctx.state_root = Path(server.get("state_root") or opts.state_root or DEFAULT_STATE_ROOT)
    if ctx.existing is not None and opts.tls_cert is not None:
        ctx.progress.note(
            f"{ctx.config_file} exists: --tls-cert/--tls-key are not applied "
            "(its TLS files are kept)"
        )


def service_mode(ctx: Context) -> str:
    systemd = Path("/run/systemd/system").is_dir()
    wanted = ctx.opts.service
    if wanted == "systemd" and not systemd:
        raise Refused(
            "--service systemd: systemd is not PID 1 here "
            "(/run/systemd/system is missing); use --service supervised"
        )
    mode = "systemd" if wanted == "systemd" or (wanted == "auto" and systemd) else "supervised"
    if mode == "systemd":
        for what, path in (
            *(("workspace", w) for w in ctx.opts.workspace),
            ("launcher socket", ctx.opts.launcher_socket),
        ):
            if under(path, "/tmp", "/var/tmp"):  # noqa: S108 - checking, not using
                raise Refused(
                    f"{what} {path} would be invisible to the services "
                    "(PrivateTmp=yes gives each a /tmp of its own): "
                    "choose another place"
                )
        # Rendered once here so that a path the units cannot carry is refused before any change.
        render_launcher_unit(
            prefix=ctx.prefix,
            config=ctx.config_file,
            state_root=ctx.state_root,
            workspaces=ctx.opts.workspace,
            socket=ctx.launcher_socket,
        )
        render_unit(
            user=ctx.opts.user,
            group=ctx.opts.user,
            prefix=ctx.prefix,
            config=ctx.config_file,
            state_root=ctx.state_root,
            workspaces=ctx.opts.workspace,
        )
    return mode


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def install_packages(ctx: Context) -> list[str]:
    """apt-get what the target needs and lacks; packages stay installed even on rollback."""
    need = []
    if shutil.which("bwrap", path=BWRAP_PATH) is None:
        need.append("bubblewrap")
    if not seccomp_binding_present():
        need.append("python3-seccomp")
    if system_pip_version() < PIP_WITH_PYTHON_OPTION and not ensurepip_present():
        need.append("python3-venv")
    if not need:
        return []
    if shutil.which("apt-get", path=TRUSTED_PATH) is None:
        if "python3-venv" in need:
            raise Refused(
                "this Python has no ensurepip and no pip >= 22.3: install the "
                "venv module (Debian: python3-venv), then run this again"
            )
        ctx.progress.note(f"cannot install {', '.join(need)}: no apt-get here")
        return []
    apt_env = base_env(DEBIAN_FRONTEND="noninteractive")
    ctx.run(["apt-get", "update", "-qq"], env=apt_env, what="apt-get update")
    ctx.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *need],
        env=apt_env,
        what=f"apt-get install {' '.join(need)}",
    )
    return need


def interpreter_hidden_from_others(python: Path) -> Path | None:
    """The first directory on the interpreter's real path that others cannot enter, if any.

    A release's venv runs this interpreter as the service user; a pyenv under
    /root, say, would build a release that user cannot start.
    """
    real = python.resolve()
    for directory in reversed(real.parents):
        if not os.stat(directory).st_mode & 0o001:
            return directory
    return None


def seccomp_binding_present() -> bool:
    return any(
        Path(f"/usr/lib/python3/dist-packages/seccomp{suffix}").exists()
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def ensurepip_present() -> bool:
    proc = subprocess.run(
        [sys.executable, "-c", "import ensurepip"],
        capture_output=True,
        check=False,
        env=base_env(),
        stdin=subprocess.DEVNULL,
    )
    return proc.returncode == 0
