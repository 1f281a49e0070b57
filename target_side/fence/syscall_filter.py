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
- ``socket(AF_VSOCK)`` for a turn without network: EAFNOSUPPORT. vsock is not
  namespaced: on a virtual machine it reaches the hypervisor and its other guests.
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
import stat
from types import ModuleType

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
ENOSYS_CALLS = (*NEW_MOUNT_API, "clone3", *KEYRINGS, *IO_URING)
AF_VSOCK = 40
FOREIGN_ARCHES = ("X86", "X32")
"""Other ABIs an x86-64 kernel runs: each gets the same rules (an unfiltered ABI is a way round)."""


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
    if sc.system_arch() == sc.Arch.X86_64:
        for name in FOREIGN_ARCHES:
            rules.add_arch(getattr(sc.Arch, name))
    for name in ENOSYS_CALLS:
        rules.add_rule(sc.ERRNO(errno.ENOSYS), name)
    for request in (TIOCSTI, TIOCLINUX):
        rules.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    if not network:
        rules.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, AF_VSOCK))
    fd = os.memfd_create("paddock-seccomp-build", os.MFD_CLOEXEC)
    with open(fd, "w+b") as sink:
        rules.export_bpf(sink)
        sink.seek(0)
        return sink.read()


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
