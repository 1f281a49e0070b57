"""Running other programs: a minimal environment, a bounded time, a heartbeat, a clear error."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable

from paddock_deploy.errors import DeployError
from paddock_deploy.progress import HEARTBEAT_S

TRUSTED_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PIP_WITH_PYTHON_OPTION = (22, 3)
"""pip gained ``--python`` (install into another interpreter's environment) in 22.3."""


def base_env(**extra: str) -> dict[str, str]:
    """A minimal environment for the commands this script runs (never the caller's whole one)."""
    env = {"PATH": TRUSTED_PATH, "LANG": "C.UTF-8", "HOME": "/root"}
    env.update(extra)
    return env


def pip_env() -> dict[str, str]:
    """The operator's own PIP_* settings and proxies: they say where packages come from."""
    kept = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("PIP_") or k.lower() in {"http_proxy", "https_proxy", "no_proxy"}
    }
    return base_env(**kept)


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    show_stdout_on_error: bool = True,
    waiting: Callable[[float], None] | None = None,
    every: float = HEARTBEAT_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; on failure raise with the tail of its output (stdout only when harmless).

    ``waiting`` is called every ``every`` seconds while it runs, with the seconds so far.
    """
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or base_env(),
            cwd="/",
        )
    except FileNotFoundError as exc:
        raise DeployError(f"{argv[0]} is not installed") from exc
    with proc:
        try:
            out, err = _communicate(proc, argv, timeout, waiting, every)
        except BaseException:
            # A timeout, a signal or a lost output channel: the command must not run on.
            proc.kill()
            proc.wait()
            raise
    if proc.returncode != 0:
        said = err + (out if show_stdout_on_error else "")
        raise DeployError(f"{shown(argv)} failed (exit {proc.returncode}): {tail(said)}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _communicate(
    proc: subprocess.Popen[str],
    argv: list[str],
    timeout: float,
    waiting: Callable[[float], None] | None,
    every: float,
) -> tuple[str, str]:
    started = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - started)
        try:
            # communicate() may be called again after a timeout without losing output.
            return proc.communicate(timeout=max(0.0, min(left, every) if waiting else left))
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - started
            if elapsed >= timeout:
                raise DeployError(f"{shown(argv)} did not finish within {timeout:.0f}s") from None
            if waiting is not None:
                waiting(elapsed)


def shown(argv: list[str]) -> str:
    return " ".join(argv[:4]) + (" ..." if len(argv) > 4 else "")


def tail(text: str, lines: int = 12) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept) or "(no output)"


@functools.cache
def system_pip_version() -> tuple[int, ...]:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--version"],
        capture_output=True,
        text=True,
        check=False,
        env=base_env(),
        stdin=subprocess.DEVNULL,
    )
    found = re.match(r"pip (\d+)\.(\d+)", proc.stdout) if proc.returncode == 0 else None
    return (int(found[1]), int(found[2])) if found else (0,)
