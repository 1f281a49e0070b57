"""The fence's system-call filter, compiled by libseccomp (Debian's ``python3-seccomp``).

Everything is allowed except what lets a turn reach past its fence:

- ``ioctl(TIOCSTI)`` pushes keystrokes into a terminal's input queue, and
  ``ioctl(TIOCLINUX)`` can read and paste a virtual console's screen: EPERM.
  The request number is compared on its low 32 bits only, as the kernel
  reads it, so setting high bits does not slip past.
- The new mount API (``fsopen fsconfig fsmount fspick move_mount open_tree
  mount_setattr``): ENOSYS, so programs fall back to the old ``mount``, which
  the fence's dropped capabilities already refuse.
- ``clone3``: ENOSYS, which glibc reads as "use clone" (EPERM would break
  every new thread); clone3's flags sit behind a pointer that no filter can
  inspect, so only ``clone`` is left, whose flags the kernel checks as usual.
- Sockets of any family but unix, IPv4, IPv6 and netlink, and pairs of any
  but unix (``socket``, ``socketpair``): EAFNOSUPPORT, as from a kernel
  without the family. The kernel looks a family up before it checks any
  permission, and loads the module of one it lacks (``modprobe`` as root,
  for anyone): that is how unprivileged processes brought in TIPC, RDS, DCCP
  or AF_ALG, and the holes in them, on machines that never used them. The
  same for the protocol within a family: IPv4 and IPv6 keep their default,
  ICMP, TCP, UDP, ICMPv6, UDP-Lite and MPTCP, netlink its route,
  socket-diagnostic, audit and uevent protocols; any other is
  EPROTONOSUPPORT (SCTP, DCCP, L2TP, SMC, nfnetlink, xfrm and the rest were
  modules loaded on demand, and generic netlink loads the module of any
  family a process names: TIPC, L2TP, WireGuard, Open vSwitch). ``AF_VSOCK``
  is kept for a turn with network only: vsock is not namespaced, and on a
  virtual machine it reaches the hypervisor and its other guests. Compared
  on all 64 bits, so a family or protocol with high bits set (which the
  kernel would cut to 32) is refused too.
- ``ioctl(TIOCSETD)``: EPERM. It changes a terminal's line discipline, and
  the kernel loads the module of one it lacks for anyone (n_hdlc's hole came
  that way); no program a turn runs needs another discipline.
- Any system call of another ABI than the machine's own (on x86-64: the
  32-bit one, which any program reaches through ``int 0x80``, and x32) ends
  the process (SIGSYS). Each ABI numbers the calls its own way, so each would
  need every rule again, and the 32-bit ``socketcall`` passes its arguments
  in memory no filter can read. 32-bit programs do not run in a fence.
- ``bpf``, ``perf_event_open`` and ``userfaultfd``: ENOSYS, as on a kernel
  built without them. Few programs use them (a profiler, a checkpointer: they
  then say the kernel lacks them), their own bugs were ways to root again
  and again, and whether the kernel offers them to an
  unprivileged process is a setting each host has its own way
  (``kernel.unprivileged_bpf_disabled``, ``kernel.perf_event_paranoid``,
  ``vm.unprivileged_userfaultfd``, which held a kernel access still for as
  long as a race needed). Docker's default profile refuses them too.
- ``syslog`` (the kernel's log, which ``dmesg`` reads): ENOSYS. The log is the
  host's, no namespace's: other processes' crashes with their addresses, the
  firewall's lines, the machine's devices. ``kernel.dmesg_restrict`` keeps it
  from unprivileged readers on some hosts and not on others.
- The kernel's keyrings (``keyctl add_key request_key``): ENOSYS, as on a kernel
  built without them. Keyrings belong to no namespace, and a session keyring is
  inherited through exec and a change of uid: a turn would possess the server's
  (or the launcher's) and read every key in it, and ``request_key`` starts the
  host's ``request-key`` program as root.
- io_uring (``io_uring_setup io_uring_enter io_uring_register``): ENOSYS, on
  which programs fall back to plain calls. It is a second way into the kernel
  beside the system calls this filter sees, and where most of the kernel's
  recent holes were (``kernel.io_uring_disabled`` exists for that reason).

The binding lives in the system interpreter's dist-packages, which a virtual
environment rightly does not see; exactly that one root-owned extension is
loaded from there, and nothing else from that directory.
"""

from __future__ import annotations

import errno
import functools
import importlib.machinery
import importlib.util
import os
import socket
import stat
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from target_side.errors import FilterUnavailable

SYSTEM_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
NEW_MOUNT_API = (
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
)
KEYRINGS = ("keyctl", "add_key", "request_key")
IO_URING = ("io_uring_setup", "io_uring_enter", "io_uring_register")
KERNEL_ATTACK_SURFACE = ("bpf", "perf_event_open", "userfaultfd")
KERNEL_LOG = ("syslog",)
ENOSYS_CALLS = (
    *NEW_MOUNT_API,
    "clone3",
    *KEYRINGS,
    *IO_URING,
    *KERNEL_ATTACK_SURFACE,
    *KERNEL_LOG,
)
TIOCSETD = 0x5423
REFUSED_IOCTLS = (TIOCSTI, TIOCLINUX, TIOCSETD)
AF_VSOCK = 40
ARGUMENT_BITS = (1 << 64) - 1
KEPT_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)
"""The socket families every fence keeps (``AF_VSOCK`` too for a turn with network)."""
KEPT_INET_PROTOCOLS = (0, 1, 6, 17, 58, 136, 262)
"""IPv4's and IPv6's: the type's default, ICMP, TCP, UDP, ICMPv6, UDP-Lite, MPTCP."""
KEPT_NETLINK_PROTOCOLS = (0, 4, 9, 15)
"""Netlink's: route, socket diagnostics, audit, kernel uevents. Not generic netlink (16): asked
for a family it lacks by name, the kernel loads the module of that name for anyone."""
FAMILY_IS_INET = (ARGUMENT_BITS & ~(socket.AF_INET ^ socket.AF_INET6), socket.AF_INET)
"""(mask, value) matching IPv4 and IPv6 alike (2 and 10 differ in one bit): one set of rules."""
KEPT_PROTOCOLS = (
    (FAMILY_IS_INET, KEPT_INET_PROTOCOLS),
    ((ARGUMENT_BITS, socket.AF_NETLINK), KEPT_NETLINK_PROTOCOLS),
)
"""The protocols kept within a family (``socket``'s third argument), by family."""

FOREIGN_ABI_NOTICE = (
    "the turn ended by SIGSYS, the signal the fence's system-call filter ends a process with at "
    "its first system call of another ABI than the machine's own (a 32-bit program, or int "
    "0x80): a fence runs the machine's own programs only"
)
"""Said, not concluded: a turn may send itself SIGSYS too."""


@functools.cache
def _binding() -> ModuleType:
    try:
        return importlib.import_module("seccomp")  # where the interpreter already sees it
    except ImportError:
        pass
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = f"{SYSTEM_DIST_PACKAGES}/seccomp{suffix}"
        if os.path.exists(path):
            return _load_trusted_extension(path)
    raise FilterUnavailable(
        "libseccomp's Python binding is not installed for this Python "
        "(apt-get install python3-seccomp; it must match the interpreter's version)"
    )


def _load_trusted_extension(path: str) -> ModuleType:
    # Loaded into a server that may run as root: only a file nobody but root could have written.
    for part in (path, os.path.dirname(path), "/usr/lib/python3", "/usr/lib", "/usr", "/"):
        st = os.stat(part)
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise FilterUnavailable(f"{part} is not root-owned and private; not loading {path}")
    spec = importlib.util.spec_from_file_location("seccomp", path)
    if spec is None or spec.loader is None:
        raise FilterUnavailable(f"{path} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise FilterUnavailable(f"{path} does not load in this Python: {exc}") from exc
    return module


@functools.cache
def filter_program(network: bool = False) -> bytes:
    """The compiled BPF program (cached: one for turns with network, one for those without)."""
    sc = _binding()
    rules = sc.SyscallFilter(defaction=sc.ALLOW)
    # The machine's own ABI is the only one the filter holds: a call of any other ends the
    # whole process (libseccomp's default ends only the thread that made it).
    rules.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in ENOSYS_CALLS:
        rules.add_rule(sc.ERRNO(errno.ENOSYS), name)
    for request in REFUSED_IOCTLS:
        rules.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    families = (*KEPT_FAMILIES, AF_VSOCK) if network else KEPT_FAMILIES
    _refuse_all_but(sc, rules, "socket", errno.EAFNOSUPPORT, 0, families)
    for (mask, family), protocols in KEPT_PROTOCOLS:
        family_is = sc.Arg(0, sc.MASKED_EQ, mask, family)
        _refuse_all_but(sc, rules, "socket", errno.EPROTONOSUPPORT, 2, protocols, family_is)
    # Only unix sockets come in pairs; any other family would fail too, but after its lookup.
    _refuse_all_but(sc, rules, "socketpair", errno.EAFNOSUPPORT, 0, (socket.AF_UNIX,))
    fd = os.memfd_create("paddock-seccomp-build", os.MFD_CLOEXEC)
    with open(fd, "w+b") as sink:
        rules.export_bpf(sink)
        sink.seek(0)
        return sink.read()


def _refuse_all_but(
    sc: ModuleType,
    rules: Any,
    call: str,
    code: int,
    arg: int,
    kept: tuple[int, ...],
    *given: Any,
) -> None:
    """Refuse ``call`` with ``code`` where argument ``arg`` is none of ``kept`` (and ``given``)."""
    action = sc.ERRNO(code)
    for mask, first in aligned_runs(frozenset(kept)):
        rules.add_rule(action, call, *given, sc.Arg(arg, sc.MASKED_EQ, mask, first))
    rules.add_rule(action, call, *given, sc.Arg(arg, sc.GE, max(kept) + 1))


def aligned_runs(kept: frozenset[int]) -> Iterator[tuple[int, int]]:
    """Every value from 0 to the largest of ``kept`` that is not in it, as (mask, first) pairs,
    each a run of a power of two starting at a multiple of its length.

    libseccomp compares an argument once per rule, so a range is as many
    rules as it has runs: ``value & mask == first`` matches a run whole.
    """
    top = max(kept) + 1
    first = 0
    while first < top:
        if first in kept:
            first += 1
            continue
        size = 1
        while first % (2 * size) == 0 and first + 2 * size <= top:
            if any(value in kept for value in range(first + size, first + 2 * size)):
                break
            size *= 2
        yield ARGUMENT_BITS & ~(size - 1), first
        first += size


def unavailable_reason() -> str | None:
    """Why turns run without the filter here, or None when it is available."""
    try:
        filter_program()
    except FilterUnavailable as exc:
        return str(exc)
    except (OSError, RuntimeError, ValueError) as exc:
        return f"libseccomp could not build the filter: {exc}"
    return None


def filter_fd(*, network: bool) -> int | None:
    """A fresh in-memory file holding the program, for ``bwrap --seccomp``; None if unavailable."""
    if unavailable_reason() is not None:
        return None
    fd = os.memfd_create("paddock-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_program(network))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
