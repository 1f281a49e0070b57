"""What the ``paddock`` command loads: only what the command it runs needs.

httpx, the wire models (pydantic), paramiko, asyncio and the MCP SDK cost a
command hundreds of milliseconds to import; each may load only where it is used.
Through a multiplexer, ``paddock run`` loads none of them (test_mux.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Target

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("httpx", "pydantic", "shared.wire", "paramiko", "asyncio", "cryptography", "mcp")


def loaded_by(
    argv: list[str],
    env: dict[str, str] | None = None,
    watch: tuple[str, ...] = HEAVY,
    executable: bool = False,
) -> tuple[int, list[str]]:
    """``cli.main(argv)`` in a fresh interpreter: its status, and the ``watch`` modules it
    loaded; with ``executable``, set up as the ``paddock`` executable sets it up first."""
    probe = (
        "import json, sys\n"
        "from agent_side import cli\n"
        f"{'cli.skip_httpx_command_line()' if executable else ''}\n"
        f"status = cli.main({argv!r})\n"
        f"heavy = [m for m in {watch!r} if sys.modules.get(m) is not None]\n"
        "print(json.dumps([status, heavy]), file=sys.stderr)\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("PADDOCK_")}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**base, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    status, heavy = json.loads(done.stderr.splitlines()[-1])
    return status, heavy


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["run", "--help"], ["mux", "status"], ["mcp", "--help"]]
)
def test_cli_without_a_target_loads_nothing_heavy(argv: list[str]) -> None:
    assert loaded_by(argv) == (0, [])


def test_cli_usage_errors_load_nothing_heavy() -> None:
    assert loaded_by(["run", "--cwd", "relative", "--", "true"]) == (125, [])


def test_cli_health_loads_no_ssh_and_no_asyncio(target: Target) -> None:
    env = {"PADDOCK_TARGET": target.url, "PADDOCK_CACERT": target.cacert}
    status, heavy = loaded_by(["health"], env)
    assert status in (0, 1)
    assert set(heavy) == {"httpx", "pydantic", "shared.wire"}


def test_the_executable_loads_httpx_without_its_command_line(target: Target) -> None:
    """httpx's own command line brings click and rich (installed here, as on many machines)."""
    env = {"PADDOCK_TARGET": target.url, "PADDOCK_CACERT": target.cacert}
    watch = ("httpx", "httpx._main", "click", "rich")
    status, heavy = loaded_by(["health"], env, watch, executable=True)
    assert status in (0, 1) and heavy == ["httpx"]
