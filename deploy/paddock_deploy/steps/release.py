"""Step 4: a virtual environment of its own for this wheel, ``PREFIX/releases/VERSION-HASH``.

A release is complete once its marker is written; one built before for the
same wheel (by hash) is reused, so a re-run with the same wheel builds nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from paddock_deploy.commands import PIP_WITH_PYTHON_OPTION, pip_env, system_pip_version
from paddock_deploy.context import Context, Outcome, Wheel
from paddock_deploy.errors import DeployError
from paddock_deploy.files import write_file
from paddock_deploy.service_user import as_user, user_env

RELEASE_MARKER = ".paddock-release.json"
KEEP_OLD_RELEASES = 2


def run(ctx: Context) -> Outcome:
    wheel = ctx.need_wheel()
    removed = remove_leftovers(ctx)
    ctx.previous = current_release(ctx.current_link)
    release = ctx.releases / wheel.release_id
    ctx.release = release
    note = f" (removed {', '.join(removed)}, left by an interrupted run)" if removed else ""
    if release_complete(release, wheel):
        if release == ctx.previous:
            said = f"nothing to do (release {release.name} is current){note}"
        else:
            said = f"release {release.name} was built before; reusing it{note}"
        return Outcome(bool(removed), said)
    started = time.monotonic()
    ctx.tx.after_failure(
        f"remove release {release.name}", lambda: shutil.rmtree(release, ignore_errors=True)
    )
    installer = build_venv(ctx, release, wheel)
    smoke_test(ctx, release, wheel)
    marker = {
        "version": wheel.version,
        "wheel_sha256": wheel.sha256,
        "built_at": time.time(),
        "python": sys.executable,
        "installer": installer,
    }
    write_file(release / RELEASE_MARKER, (json.dumps(marker) + "\n").encode(), 0o644)
    return Outcome(
        True,
        f"built release {release.name} with {installer} in {time.monotonic() - started:.0f}s{note}",
    )


def remove_leftovers(ctx: Context) -> list[str]:
    removed = []
    for entry in sorted(ctx.prefix.glob(".current-*")):
        entry.unlink(missing_ok=True)
    current = current_release(ctx.current_link)
    for entry in sorted(ctx.releases.iterdir()):
        if entry.is_dir() and entry != current and not (entry / RELEASE_MARKER).is_file():
            shutil.rmtree(entry)
            removed.append(entry.name)
    return removed


def build_venv(ctx: Context, release: Path, wheel: Wheel) -> str:
    """A virtual environment at ``release`` with the wheel and its dependencies.

    The system pip installs into a venv made without pip when it is new
    enough (no pip inside the release, and no ensurepip run); otherwise the
    venv gets its own pip.
    """
    python = sys.executable
    pip_args = [
        "install",
        "--no-input",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        *(f"--find-links={d}" for d in ctx.opts.find_links),
        *(["--no-index"] if ctx.opts.no_index else []),
        str(wheel.path),
    ]
    installing = f"pip installs paddock {wheel.version} and its dependencies"
    if system_pip_version() >= PIP_WITH_PYTHON_OPTION:
        ctx.run([python, "-m", "venv", "--without-pip", str(release)], what="python3 -m venv")
        ctx.run(
            [python, "-m", "pip", "--python", str(release / "bin" / "python"), *pip_args],
            env=pip_env(),
            what=installing,
        )
        return "the system pip"
    ctx.run([python, "-m", "venv", str(release)], what="python3 -m venv (with its own pip)")
    ctx.run(
        [str(release / "bin" / "python"), "-m", "pip", *pip_args], env=pip_env(), what=installing
    )
    return "the venv's own pip"


def smoke_test(ctx: Context, release: Path, wheel: Wheel) -> None:
    """As the service user: the interpreter is reachable and the package imports."""
    account = ctx.need_account()
    probe = (
        "import importlib.metadata as m, target_side.service.app, target_side.tools.cli; "
        "print(m.version('paddock'))"
    )
    found = ctx.run(
        [*as_user(account), str(release / "bin" / "python"), "-c", probe],
        env=user_env(account),
        what="the new release imports, as the service user",
    ).stdout.strip()
    if found != wheel.version:
        raise DeployError(f"the release reports paddock {found}, not {wheel.version}")


def current_release(link: Path) -> Path | None:
    if not link.is_symlink():
        return None
    return Path(os.path.realpath(link))


def release_complete(release: Path, wheel: Wheel) -> bool:
    try:
        marker = json.loads((release / RELEASE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("wheel_sha256") == wheel.sha256


def releases_to_prune(
    releases: Path, current: Path | None, keep: int = KEEP_OLD_RELEASES
) -> list[Path]:
    """Complete releases beyond the current one and the ``keep`` most recently built others."""
    built = []
    for entry in releases.iterdir():
        try:
            marker = json.loads((entry / RELEASE_MARKER).read_text())
        except (OSError, ValueError):
            continue
        if entry != current:
            built.append((float(marker.get("built_at", 0)), entry))
    built.sort(reverse=True)
    return [entry for _, entry in built[keep:]]
