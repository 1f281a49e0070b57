"""What the deploy tests share: where the script is, the interpreter it runs with, its steps."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "paddock-deploy"
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
"""The deploy script's steps, in order, written out here rather than read from the script."""
