"""What the deploy tests share: where the package is, the interpreter it runs with, its steps."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DEPLOY_DIR = REPO / "deploy"
SYSTEM_PYTHON = "/usr/bin/python3"
"""The target's own python3: a release built with it is one the service user can run."""
STEPS = (
    "preflight",
    "user",
    "dirs",
    "release",
    "tls",
    "config",
    "service",
    "switch",
    "restart",
    "health",
)
"""The deploy's steps, in order, written out here rather than read from the protocol module."""
FINISHED = {"changed", "unchanged", "failed"}


def from_checkout(*args: str) -> list[str]:
    """The argv that runs the deploy from this checkout (no zipapp), as deploy/README.md says."""
    return [SYSTEM_PYTHON, "-m", "paddock_deploy", *args]


def checkout_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(DEPLOY_DIR)}


def finished_steps(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step lines that say how a step ended (not its start or its heartbeats)."""
    return [
        line for line in lines if line.get("event") == "step" and line.get("status") in FINISHED
    ]


def print_unit(*extra: str) -> str:
    """The unit ``--print-unit`` gives for ``extra`` options (run from the checkout)."""
    import subprocess

    proc = subprocess.run(
        from_checkout("--wheel", "/nonexistent.whl", "--print-unit", "--user", "paddock", *extra),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env=checkout_env(),
    )
    return proc.stdout


def dependency_wheelhouse(factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """The wheels ``wheel`` depends on (not itself), fetched with the target's own pip.

    Every deploy then installs offline from it. Fetched once per run, by
    whichever test asks first: xdist's workers share the run's temporary root,
    and wait on a lock there while one of them downloads.
    """
    key = hashlib.sha256("\n".join(_requirements(wheel)).encode()).hexdigest()[:16]
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = factory.getbasetemp().parent if worker else factory.getbasetemp()
    ready = shared / f"wheelhouse-{key}"
    with open(shared / f"wheelhouse-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            partial = Path(tempfile.mkdtemp(prefix="wheelhouse-", dir=shared))
            subprocess.run(
                [SYSTEM_PYTHON, "-m", "pip", "download", "-q", "-d", str(partial), str(wheel)],
                check=True,
                capture_output=True,
                timeout=300,
            )
            (partial / wheel.name).unlink()  # the wheel itself goes up on its own
            partial.rename(ready)  # whole or not at all: a failed download leaves no wheelhouse
    return ready


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    return sorted(line for line in lines if line.startswith("Requires-Dist:"))
