"""What the deploy tests share: where the package is, the interpreter it runs with, its steps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
