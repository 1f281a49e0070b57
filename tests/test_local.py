"""``paddock run --local`` run by someone who is not root: the embedded target is theirs."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
PURELIB = sysconfig.get_paths()["purelib"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or shutil.which("setpriv") is None,
    reason="needs root (to make a user), the system python3 and setpriv",
)


@pytest.fixture
def user(tmp_path: Path) -> Iterator[pwd.struct_passwd]:
    name = f"pl{uuid.uuid4().hex[:6]}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True
    )
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def test_local_as_a_user_runs_turns_as_that_user_still_fenced(
    user: pwd.struct_passwd, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, user.pw_uid, user.pw_gid)
    # root's, 0700, as /tmp holds: neither the user nor a turn of theirs can go there, so
    # the protected-name scan (running as the user too) leaves it alone.
    subprocess.run(["git", "init", "-q", str(work / "closed" / "repo")], check=True)
    (work / "closed").chmod(0o700)
    command = "id -u; echo made > f; cat /etc/shadow 2>&1 | head -c 0; ls /"
    result = subprocess.run(
        [
            "setpriv",
            f"--reuid={user.pw_uid}",
            f"--regid={user.pw_gid}",
            "--clear-groups",
            SYSTEM_PYTHON,
            "-m",
            "agent_side.cli",
            "run",
            "--local",
            "--no-mux",
            "--",
            "sh",
            "-c",
            command,
        ],
        cwd=work,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{REPO}:{REPO}/deploy:{PURELIB}",
            "HOME": str(tmp_path),  # not the workspace: that would hold ~/.ssh, forbidden
            "LANG": "C.UTF-8",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[0] == str(user.pw_uid)
    assert "shadow" not in lines and "root" not in lines  # still a fence: /, not the host's
    assert (work / "f").stat().st_uid == user.pw_uid
    assert "not run as root, so the embedded target's turns run as you" in result.stderr
