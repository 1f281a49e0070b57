"""The fence's system-call filter, observed from inside a real fence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import output, run, running_target

from shared.walk import canonical_path
from target_side.fence import syscall_filter

PROBE = r"""
import ctypes, errno, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
byte = ctypes.create_string_buffer(b"x")
name = ctypes.create_string_buffer(b"tmpfs")
params = ctypes.create_string_buffer(120)

def call(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return errno.errorcode[ctypes.get_errno()] if result == -1 else "ok"

addr = ctypes.addressof(byte)
found = {
    "tiocsti": call(16, 0, 0x5412, addr),
    "tiocsti_high_bits": call(16, 0, 0x5412 | (1 << 32), addr),
    "tioclinux": call(16, 0, 0x541C, addr),
    "clone3": call(435, 0, 0),
    "open_tree": call(428, -100, ctypes.addressof(name), 0),
    "move_mount": call(429, -100, addr, -100, addr, 0),
    "fsopen": call(430, ctypes.addressof(name), 0),
    "fsconfig": call(431, -1, 0, 0, 0, 0),
    "fsmount": call(432, -1, 0, 0),
    "fspick": call(433, -100, addr, 0),
    "mount_setattr": call(442, -100, addr, 0, 0, 0),
    "io_uring_setup": call(425, 8, ctypes.addressof(params)),
    "io_uring_enter": call(426, -1, 0, 0, 0, 0, 0),
    "io_uring_register": call(427, -1, 0, 0, 0),
}
seen = []
thread = threading.Thread(target=seen.append, args=("thread",))
thread.start(); thread.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
found["thread"] = seen == ["thread"]
found["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
print(json.dumps(found))
"""


def _probe(client: httpx.Client) -> dict[str, object]:
    turn, evs = run(client, ["python3", "-c", PROBE])
    assert turn.exit_code == 0, output(evs, "stderr")
    return json.loads(output(evs))


def test_filter_answers_terminal_injection_with_eperm(client: httpx.Client) -> None:
    # Without the filter, fd 0 (/dev/null) would answer ENOTTY.
    found = _probe(client)
    assert found["tiocsti"] == "EPERM"
    assert found["tiocsti_high_bits"] == "EPERM"  # compared on the low 32 bits, as the kernel does
    assert found["tioclinux"] == "EPERM"


def test_filter_answers_new_mount_api_and_clone3_with_enosys(client: httpx.Client) -> None:
    # Without the filter: EPERM or EINVAL/EBADF from the kernel, never ENOSYS on this kernel.
    found = _probe(client)
    for call in (*syscall_filter.NEW_MOUNT_API, "clone3"):
        assert found[call] == "ENOSYS", (call, found[call])


def test_filter_answers_io_uring_with_enosys(client: httpx.Client) -> None:
    """io_uring is a second way into the kernel, beside the system calls the filter sees, and
    where most of its recent holes were; programs fall back to plain calls on ENOSYS. Without
    the filter this kernel sets up a ring (and answers EBADF to a ring that is not one)."""
    found = _probe(client)
    for call in syscall_filter.IO_URING:
        assert found[call] == "ENOSYS", (call, found[call])


def test_threads_and_fork_still_work_under_the_filter(client: httpx.Client) -> None:
    # clone3 answers ENOSYS precisely so that glibc falls back to clone.
    found = _probe(client)
    assert found["thread"] is True
    assert found["fork"] is True


def test_no_new_user_namespace_inside_the_fence(client: httpx.Client) -> None:
    _, evs = run(client, ["sh", "-c", "unshare --user --map-root-user true 2>&1; echo rc=$?"])
    assert "rc=0" not in output(evs)


@pytest.fixture
def unfiltered_target(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> Iterator[httpx.Client]:
    def missing() -> bytes:
        raise syscall_filter.FilterUnavailable("libseccomp's Python binding is not installed")

    monkeypatch.setattr(syscall_filter, "filter_program", missing)
    root = Path(canonical_path(tmp_path))
    for target in running_target(root, ca):
        with target.client() as client:
            yield client


def test_missing_filter_is_reported_by_health_and_turns_still_run(
    unfiltered_target: httpx.Client,
) -> None:
    causes = {c["cause"]: c["detail"] for c in unfiltered_target.get("/v1/health").json()["causes"]}
    assert "seccomp" in causes.get("backend", "")
    turn, evs = run(unfiltered_target, ["echo", "still runs"])
    assert (turn.exit_code, output(evs)) == (0, "still runs\n")
