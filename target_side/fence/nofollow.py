"""Opening a canonical path without following a symlink anywhere along it.

Where the kernel has ``openat2`` (Linux 5.6+), one call resolves the whole
path under ``RESOLVE_NO_SYMLINKS``: a symlink at any component fails it,
except the last, which ``O_NOFOLLOW`` opens as itself. Otherwise, and
whenever that call fails, each component is opened relative to its parent's
descriptor, which also finds the component to name in the error. Either way
nothing is looked up by name twice and no symlink is ever followed.

Standard library and the error tree only: the privileged launcher imports it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat

from target_side.errors import PathChanged
from target_side.fence import raw_syscalls

HOLD_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
AT_FDCWD = -100
UNAVAILABLE = frozenset({errno.ENOSYS, errno.EPERM})
"""What ``openat2`` says where the kernel lacks it or a seccomp filter refuses it."""


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_kernel_resolves = raw_syscalls.number("openat2") is not None


def open_no_follow(path: str) -> int:
    """An ``O_PATH`` descriptor for canonical ``path``, refusing any symlink along the way."""
    if not path.startswith("/"):
        raise PathChanged(f"{path} is not absolute")
    if "\0" in path:
        # The kernel reads the path up to it: what it opened would be another path.
        raise PathChanged(f"{path!r} holds a NUL byte")
    names = [n for n in path.split("/") if n]
    if any(name in (".", "..") for name in names):
        raise PathChanged(f"{path} is not canonical")
    fd = _resolved_by_kernel(path)
    if fd is None:
        return _walked(names)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise PathChanged(f"/{'/'.join(names)} is now a symlink")
    except BaseException:
        _close(fd)
        raise
    return fd


def _resolved_by_kernel(path: str) -> int | None:
    """``path`` opened by one ``openat2`` that follows no symlink, or None if it did not open.

    None on any failure: the walk then opens it or says which component is wrong.
    """
    global _kernel_resolves
    if not _kernel_resolves:
        return None
    how = _OpenHow(HOLD_FLAGS, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    try:
        return raw_syscalls.call(
            "openat2", AT_FDCWD, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how)
        )
    except OSError as exc:
        if exc.errno in UNAVAILABLE:
            _kernel_resolves = False
        return None


def _walked(names: list[str]) -> int:
    """The path of ``names`` opened one component at a time, each below its parent's descriptor."""
    fd = os.open("/", HOLD_FLAGS | os.O_DIRECTORY)
    try:
        for i, name in enumerate(names):
            parent, fd = fd, -1
            try:
                fd = os.open(name, HOLD_FLAGS, dir_fd=parent)
            finally:
                os.close(parent)
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                raise PathChanged(f"{'/' + '/'.join(names[: i + 1])} is now a symlink")
            if i < len(names) - 1 and not stat.S_ISDIR(mode):
                raise PathChanged(f"{'/' + '/'.join(names[: i + 1])} is no longer a directory")
    except FileNotFoundError as exc:
        _close(fd)
        path = "/" + "/".join(names)
        raise PathChanged(f"a component of {path} is gone ({exc.strerror})") from exc
    except BaseException:
        _close(fd)
        raise
    return fd


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
