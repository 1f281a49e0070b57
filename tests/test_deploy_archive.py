"""paddock_deploy.archive: the deploy package as one file, from a checkout or an installed
paddock, run by a target's python3 with nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deploy_support import DEPLOY_DIR, REPO, SYSTEM_PYTHON

from agent_side.deploy import build_wheel
from paddock_deploy.archive import build_archive
from paddock_deploy.protocol import ARCHIVE_NAME

needs_system_python = pytest.mark.skipif(
    not os.path.exists(SYSTEM_PYTHON), reason="no system python3"
)


def test_archive_holds_the_package_and_no_caches(tmp_path: Path) -> None:
    archive = build_archive(tmp_path / ARCHIVE_NAME)
    assert archive.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    names = zipfile.ZipFile(archive).namelist()
    assert "__main__.py" in names and "paddock_deploy/supervisor.py" in names
    assert "paddock_deploy/steps/release.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@needs_system_python
def test_archive_runs_with_the_targets_python_alone(tmp_path: Path) -> None:
    archive = build_archive(tmp_path / ARCHIVE_NAME)
    helped = subprocess.run(
        [SYSTEM_PYTHON, "-I", str(archive), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert helped.returncode == 0 and "--bin-dir" in helped.stdout, helped.stderr
    # The supervisor it installs is read from inside the archive, byte for byte the module.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from paddock_deploy.steps.service import supervisor_source; "
        "sys.stdout.buffer.write(supervisor_source())"
    )
    read = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", code, str(archive)], capture_output=True, timeout=30, check=True
    )
    assert read.stdout == (DEPLOY_DIR / "paddock_deploy" / "supervisor.py").read_bytes()


def test_archive_builds_from_the_checkout_on_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "x.pyz"
    proc = subprocess.run(
        [sys.executable, "-m", "paddock_deploy.archive", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(DEPLOY_DIR)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{out} (") and zipfile.is_zipfile(out)


@needs_system_python
def test_archive_builds_from_an_installed_paddock_too(tmp_path: Path) -> None:
    wheel = build_wheel(REPO, tmp_path / "dist")
    installed = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", installed, wheel],
        check=True,
        capture_output=True,
        timeout=120,
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "import paddock_deploy.archive as a; "
        "assert a.PACKAGE == Path(sys.argv[1]) / 'paddock_deploy', a.PACKAGE; "
        "a.build_archive(Path(sys.argv[2]))"
    )
    out = tmp_path / ARCHIVE_NAME
    subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", code, str(installed), str(out)], check=True, timeout=60
    )
    assert "paddock_deploy/cli.py" in zipfile.ZipFile(out).namelist()
