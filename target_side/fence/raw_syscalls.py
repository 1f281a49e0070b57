"""System calls Python does not offer: made by number, or through the C library's wrapper.

By number where the C library has no wrapper that does what is needed:
``setresuid`` and friends through the C library change every thread's ids at
once (``thread_ids`` needs one thread's); Python offers no ``openat2``
(``nofollow`` resolves a whole path with it). The numbers are known per
machine; on another, ``number`` says None and the caller takes its slower path.
Through the wrapper where it does: ``sync_file_range`` (the event spool).

Standard library only: the privileged launcher imports it too (through ``nofollow``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Callable

NUMBERS = {
    "x86_64": {
        "setgroups": 116,
        "setresuid": 117,
        "setresgid": 119,
        "capget": 125,
        "capset": 126,
        "openat2": 437,
        "landlock_create_ruleset": 444,
        "landlock_restrict_self": 446,
        "prctl": 157,
    },
    "aarch64": {
        "setgroups": 159,
        "setresuid": 147,
        "setresgid": 149,
        "capget": 90,
        "capset": 91,
        "openat2": 437,
        "landlock_create_ruleset": 444,
        "landlock_restrict_self": 446,
        "prctl": 167,
    },
}
"""Numbers of the calls used, per machine."""
SYNC_FILE_RANGE_WRITE = 2
"""Start writing out the range's dirty pages; wait for none of it (``sync_file_range(2)``)."""


def number(name: str) -> int | None:
    """The number of system call ``name`` on this machine, if known."""
    return NUMBERS.get(platform.machine(), {}).get(name)


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, with ``errno`` kept per call (``ctypes.get_errno``)."""
    found = ctypes.CDLL(None, use_errno=True)
    found.syscall.restype = ctypes.c_long
    return found


def call(name: str, *args: object) -> int:
    """System call ``name`` with ``args`` (ints passed as C longs): its result, or ``OSError``.

    ``LookupError`` if its number on this machine is not known.
    """
    found = number(name)
    if found is None:
        raise LookupError(f"no number known for {name} on {platform.machine()}")
    result = int(libc().syscall(ctypes.c_long(found), *[_arg(a) for a in args]))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")
    return result


CAPABILITY_VERSION_3 = 0x20080522
"""The capability sets in two 32-bit halves each (``capget(2)``)."""


class CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def capabilities() -> tuple[CapHeader, ctypes.Array[CapData]]:
    """The calling thread's capability sets (``capget``), in the form ``capset`` takes back."""
    header = CapHeader(CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()
    call("capget", ctypes.byref(header), data)
    return header, data


def has_effective(capability: int) -> bool:
    """Whether the calling thread's effective set holds ``capability`` (one system call)."""
    _, data = capabilities()
    return bool(data[capability // 32].effective >> (capability % 32) & 1)


def _arg(value: object) -> object:
    return ctypes.c_long(value) if isinstance(value, int) else value


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes of ``fd`` from ``offset`` to its disk.

    Returns once the writes are queued, not done: what waits for them is a
    later ``fdatasync``, which then finds little left to do. ``OSError`` if
    the call failed; ``AttributeError`` where the C library lacks it.
    """
    if _sync_file_range()(fd, offset, length, SYNC_FILE_RANGE_WRITE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


@functools.cache
def _sync_file_range() -> Callable[..., int]:
    wrapper = libc().sync_file_range
    wrapper.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    wrapper.restype = ctypes.c_int
    return wrapper
