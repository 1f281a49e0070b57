"""A root server's worker thread starts a turn as the role's ids and takes root back: the
process it starts has the role's ids, no groups and no capabilities, and nothing else of the
server (no other thread, not the thread afterwards, not ptrace by the role) is the role's."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from process_support import REPO

from target_side.fence import thread_ids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching ids needs root")

UID = 1_900_004_242
"""A uid no account has, as a role of the default pool has."""

# Run apart from the test process: it gives itself a supplementary group and capabilities
# to hand on (inheritable and ambient), as a server under a service manager may have.
HARNESS = """
import ctypes, json, os, subprocess, sys, threading
from target_side.fence import raw_syscalls, thread_ids
from target_side.errors import ThreadIdsError

UID = int(sys.argv[1])
CAP_NET_RAW = 13
libc = ctypes.CDLL(None, use_errno=True)
os.setgroups([4242])
header, data = raw_syscalls.capabilities()
data[0].inheritable |= 1 << CAP_NET_RAW
thread_ids._call("capset", ctypes.byref(header), data)
assert libc.prctl(47, 2, CAP_NET_RAW, 0, 0) == 0  # PR_CAP_AMBIENT_RAISE
found = {}

def worker():
    thread_ids.mark_one_shot()
    with thread_ids.acting_as(UID, UID):
        child = subprocess.Popen(["/bin/cat", "/proc/self/status"], stdout=subprocess.PIPE)
    found["child"] = child.communicate()[0].decode()
    found["after"] = open("/proc/thread-self/status").read()

thread = threading.Thread(target=worker)
thread.start()
thread.join()
found["main"] = open("/proc/thread-self/status").read()
found["dumpable"] = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
try:
    thread_ids.acting_as(UID, UID).__enter__()
    found["elsewhere"] = "switched"
except ThreadIdsError as exc:
    found["elsewhere"] = str(exc)
print(json.dumps(found))
"""


def _fields(status: str) -> dict[str, str]:
    return dict(line.split(":", 1) for line in status.splitlines() if ":" in line)


SUID_DUMPABLE = Path("/proc/sys/fs/suid_dumpable")


@pytest.fixture(scope="module")
def found() -> dict[str, object]:
    before = SUID_DUMPABLE.read_text()
    SUID_DUMPABLE.write_text("0")
    try:
        done = subprocess.run(
            [sys.executable, "-c", HARNESS, str(UID)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        SUID_DUMPABLE.write_text(before)
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_process_started_has_the_roles_ids_and_nothing_more(found: dict[str, str]) -> None:
    child = _fields(found["child"])
    assert child["Uid"].split() == [str(UID)] * 4
    assert child["Gid"].split() == [str(UID)] * 4
    assert child["Groups"].split() == []
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(child[caps], 16) == 0, caps


def test_the_thread_takes_root_back_and_no_other_thread_ever_left_it(
    found: dict[str, str],
) -> None:
    for who in ("after", "main"):
        status = _fields(found[who])
        assert status["Uid"].split() == ["0"] * 4, who
        assert status["Gid"].split() == ["0"] * 4, who
        assert status["Groups"].split() == ["4242"], who


def test_a_server_that_switched_cannot_be_traced_by_the_role(found: dict[str, object]) -> None:
    assert found["dumpable"] == 0


@pytest.mark.parametrize(("setting", "usable"), [("0", True), ("2", True), ("1", False)])
def test_no_thread_switches_where_the_kernel_would_leave_the_server_traceable(
    setting: str, usable: bool
) -> None:
    # Under suid_dumpable 1 a process that changed ids stays dumpable: the role's uid could
    # ptrace the server while a thread holds it. setpriv starts those turns instead.
    before = SUID_DUMPABLE.read_text()
    SUID_DUMPABLE.write_text(setting)
    try:
        assert thread_ids.usable_for(UID) is usable
    finally:
        SUID_DUMPABLE.write_text(before)


def test_a_uid_with_a_host_account_is_left_to_setpriv() -> None:
    # For the instant a thread holds it, a process of that uid could signal the thread.
    assert not thread_ids.usable_for(pwd.getpwnam("nobody").pw_uid)


def test_only_a_turns_own_worker_thread_may_switch(found: dict[str, str]) -> None:
    assert "worker thread" in found["elsewhere"]
