"""schemathesis against a real target: every operation, every check, bounded.

The whole schema the target serves goes through ``st run --checks all``
(coverage, fuzzing and stateful phases; all but ``use_after_free``, since an
ended session stays readable by design): no 5xx; every status, header,
content type and body as the schema declares them; invalid data refused,
valid data taken; undeclared methods answered 405 with ``Allow``. The run is
bounded in examples per operation and seeded, so CI runs the same cases every
time; ``PADDOCK_SCHEMATHESIS_SEED`` and ``PADDOCK_SCHEMATHESIS_EXAMPLES`` widen
it by hand.

The target is real (uvicorn, TLS, bubblewrap), and its role's limits are
small: a generated turn that happens to name a real program ends within
seconds. ``schemathesis_hooks.py`` narrows ``role`` to the token's own, so
generated turns really start and the stateful phase follows them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from conftest import BUILDER_TOKEN, Target, running_target

from shared.walk import canonical_path
from target_side.config import RoleLimits

HERE = Path(__file__).parent
SEED = os.environ.get("PADDOCK_SCHEMATHESIS_SEED", "20261130")
EXAMPLES = os.environ.get("PADDOCK_SCHEMATHESIS_EXAMPLES", "25")
RUN_TIMEOUT_S = 600
"""A hang, not a slow run: the run is bounded by examples, not by time."""

SMALL = RoleLimits(
    wall_s=5,
    memory_mb=512,
    pids=64,
    cpu=1.0,
    output_mb=1,
    scratch_mb=16,
    session_s=20,
    session_idle_s=3,
)
"""Generated sessions end by themselves within seconds, so they never fill the turn caps."""


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    root = Path(canonical_path(tmp_path_factory.mktemp("fuzzed")))
    yield from running_target(root, ca, limits=SMALL)


def schemathesis_run(target: Target, workdir: Path) -> tuple[int, dict, str]:
    """``st run --checks all`` over the target's whole schema: exit status, report, output."""
    report = workdir / "report.json"
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(HERE / "schemathesis.toml"),
        "run",
        f"{target.url}/openapi.json",
        "--checks",
        "all",
        # DELETE /v1/sessions/{id} ends a session; its record stays readable (state "closed",
        # and why it ended), as a finished turn's does: "deleted yet still there" is by design.
        "--exclude-checks",
        "use_after_free",
        "--header",
        f"Authorization: Bearer {BUILDER_TOKEN}",
        "--tls-verify",
        target.cacert,
        "--max-examples",
        EXAMPLES,
        "--seed",
        SEED,
        "--workers",
        "1",
        "--generation-database",
        "none",
        "--continue-on-failure",
        "--no-color",
        "--output-truncate",
        "true",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HERE / "schemathesis_hooks.py")}
    done = subprocess.run(
        command,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    found = json.loads(report.read_text()) if report.exists() else {}
    return done.returncode, found, done.stdout + done.stderr


def test_schemathesis_finds_no_failure(fuzzed: Target, tmp_path: Path) -> None:
    status, report, output = schemathesis_run(fuzzed, tmp_path)
    summary = output[output.rfind("SUMMARY") :] if "SUMMARY" in output else output[-3000:]
    # Each kind of failure, its count and operations: short enough to read in a CI log.
    failures = [
        f"{f['code']} {f['title']} x{f['count']}: {', '.join(map(str, f['operations']))}"
        for f in report.get("failures", [])
    ]
    assert status == 0, "\n".join([*failures, *map(str, report.get("errors", [])), summary[:3000]])
    operations = report["operations"]
    assert operations["tested"] == operations["total"] > 0, operations
    assert report["test_cases"]["unique_failures"] == 0
    for phase in ("coverage", "fuzzing", "stateful"):
        assert report["phases"][phase]["status"] == "success", report["phases"]
    print(
        f"schemathesis: {operations['tested']} operations, "
        f"{report['test_cases']['generated']} cases, 0 failures, seed {SEED}"
    )
