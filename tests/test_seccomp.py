"""The fence's system-call filter, observed from inside a real fence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import output, run, running_target
from hypothesis import given
from hypothesis import strategies as st

from shared.walk import canonical_path
from target_side.fence import syscall_filter

PROBE = r"""
import ctypes, errno, json, os, struct, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
byte = ctypes.create_string_buffer(b"x")
name = ctypes.create_string_buffer(b"tmpfs")
params = ctypes.create_string_buffer(120)
# perf_event_attr: a software clock counting this process in user space only (size 128,
# exclude_kernel and exclude_hv), and bpf's map_create: an array of one 4-byte value.
attr = ctypes.create_string_buffer(
    struct.pack("<IIQQQQQ", 1, 128, 0, 0, 0, 0, 0b1100000) + bytes(80)
)
ctypes.memmove(params, struct.pack("<IIII", 2, 4, 4, 1), 16)

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
    "bpf": call(321, 0, ctypes.addressof(params), 72),
    "perf_event_open": call(298, ctypes.addressof(attr), 0, -1, -1, 0),
    "userfaultfd": call(323, 1),
    "syslog": call(103, 10, 0, 0),
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


def _probe(client: httpx.Client, probe: str = PROBE) -> dict[str, object]:
    turn, evs = run(client, ["python3", "-c", probe])
    assert turn.exit_code == 0, output(evs, "stderr")
    return json.loads(output(evs))


SOCKETS = r"""
import ctypes, errno, fcntl, json, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
pair = (ctypes.c_int * 2)()

def call(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return errno.errorcode[ctypes.get_errno()] if result == -1 else "ok"

def tiocsetd():
    master, follower = os.openpty()
    try:
        fcntl.ioctl(follower, 0x5423, struct.pack("i", 0))  # N_TTY, the discipline it has
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]

print(json.dumps({
    "unix": call(41, 1, 1, 0),
    "inet": call(41, 2, 1, 0),
    "inet6": call(41, 10, 2, 0),
    "netlink_route": call(41, 16, 3, 0),
    "unix_pair": call(53, 1, 1, 0, ctypes.addressof(pair)),
    "packet": call(41, 17, 2, 0),
    "xdp": call(41, 44, 3, 0),
    "packet_pair": call(53, 17, 2, 0, ctypes.addressof(pair)),
    "inet_pair": call(53, 2, 1, 0, ctypes.addressof(pair)),
    "inet_high_bits": call(41, 2 | (1 << 32), 1, 0),
    "inet_raw": call(41, 2, 3, 255),
    "inet6_raw": call(41, 10, 3, 255),
    "netlink_netfilter": call(41, 16, 3, 12),
    "netlink_xfrm": call(41, 16, 3, 6),
    "netlink_generic": call(41, 16, 3, 16),
    "tiocsetd": tiocsetd(),
}))
"""

I386_GETPID = r"""
import ctypes, mmap, struct, threading
# getpid on the 32-bit ABI, from this 64-bit process: int 0x80, from code below 4 GiB, made
# by a thread of its own (the filter must end the whole process, not the thread alone).
page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40,
                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(b"\x53\xb8" + struct.pack("<i", 20) + b"\xcd\x80\x5b\x48\x63\xc0\xc3")
getpid = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
caller = threading.Thread(target=lambda: print(getpid(), flush=True))
caller.start()
caller.join()
print("still here")
"""


def test_filter_refuses_socket_families_the_fence_does_not_keep(client: httpx.Client) -> None:
    """The kernel looks a socket's family up (and loads its module, on a kernel that has one
    to load) before it checks any permission: unfiltered, AF_PACKET and AF_XDP answer EPERM
    here, their lookup done, and a pair of IPv4 sockets EOPNOTSUPP. The filter answers before
    the kernel looks: EAFNOSUPPORT."""
    found = _probe(client, SOCKETS)
    for kept in ("unix", "inet", "inet6", "netlink_route", "unix_pair"):
        assert found[kept] == "ok", (kept, found[kept])
    for refused in ("packet", "xdp", "packet_pair", "inet_pair"):
        assert found[refused] == "EAFNOSUPPORT", (refused, found[refused])
    # The kernel would cut the family to 32 bits (AF_INET, and a socket); compared on 64.
    assert found["inet_high_bits"] == "EAFNOSUPPORT"


def test_filter_refuses_protocols_the_fence_does_not_keep(client: httpx.Client) -> None:
    """Within a kept family, a protocol the kernel lacks is a module it loads (SCTP, DCCP,
    L2TP, nfnetlink), and generic netlink loads the module of any family named to it. Unfiltered,
    a raw IPv4 socket answers EPERM, and netfilter's, xfrm's and generic netlink sockets open;
    the filter answers EPROTONOSUPPORT first."""
    found = _probe(client, SOCKETS)
    refused_here = ("inet_raw", "inet6_raw", "netlink_netfilter", "netlink_xfrm", "netlink_generic")
    for refused in refused_here:
        assert found[refused] == "EPROTONOSUPPORT", (refused, found[refused])


def test_filter_refuses_changing_a_terminals_line_discipline(client: httpx.Client) -> None:
    # Unfiltered, setting the discipline a terminal already has succeeds.
    assert _probe(client, SOCKETS)["tiocsetd"] == "EPERM"


def test_filter_ends_a_process_at_its_first_32_bit_call(client: httpx.Client) -> None:
    """A 64-bit program can make 32-bit system calls (``int 0x80``), numbered differently: an
    ABI without the rules would be a way round all of them, and ``socketcall`` hides a
    socket's family in memory. The filter holds the machine's own ABI only; unfiltered, this
    ``getpid`` answers."""
    turn, evs = run(client, ["python3", "-c", I386_GETPID])
    assert (turn.exit_code, turn.signal) == (128 + 31, 31), output(evs, "stderr")  # SIGSYS
    assert output(evs) == ""
    notices = [e.message for e in evs if e.kind == "notice"]
    assert notices == [syscall_filter.FOREIGN_ABI_NOTICE]


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


def test_filter_answers_bpf_perf_and_userfaultfd_with_enosys(client: httpx.Client) -> None:
    """Kernel facilities whose own bugs were ways to root, offered to unprivileged processes
    or not by settings each host has its own way. Unfiltered on this machine, as a user
    without privileges: the counter and the user-mode fault handler are made, and bpf answers
    EPERM (``kernel.unprivileged_bpf_disabled``); never ENOSYS."""
    found = _probe(client)
    for call in syscall_filter.KERNEL_ATTACK_SURFACE:
        assert found[call] == "ENOSYS", (call, found[call])


def test_filter_answers_reading_the_kernels_log_with_enosys(client: httpx.Client) -> None:
    """The kernel's log is the host's (other processes' crashes, the firewall's lines), kept
    from unprivileged readers only where ``kernel.dmesg_restrict`` is set. Unfiltered: EPERM
    here (it is set), the buffer's size where it is not; never ENOSYS."""
    assert _probe(client)["syslog"] == "ENOSYS"


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


@given(st.frozensets(st.integers(min_value=0, max_value=300), min_size=1))
def test_aligned_runs_cover_exactly_what_is_not_kept(kept: frozenset[int]) -> None:
    """The refused values below the largest kept one, as the filter's masked comparisons
    match them: every value not kept in exactly one run, no kept value in any."""
    matched: list[int] = []
    for mask, first in syscall_filter.aligned_runs(kept):
        size = (~mask & syscall_filter.ARGUMENT_BITS) + 1
        assert first % size == 0 and first & ~mask == 0  # a run its mask matches whole
        matched.extend(range(first, first + size))
    assert sorted(matched) == [v for v in range(max(kept) + 1) if v not in kept]
