"""Opening a canonical path without following a symlink anywhere along it.

Standard library and the error tree only: the privileged launcher imports it too.
"""

from __future__ import annotations

import contextlib
import os
import stat

from target_side.errors import PathChanged

HOLD_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def open_no_follow(path: str) -> int:
    """An ``O_PATH`` descriptor for canonical ``path``, refusing any symlink along the way.

    Each component is opened relative to its parent's descriptor, so nothing
    is looked up by name twice and no symlink is ever followed.
    """
    if not path.startswith("/"):
        raise PathChanged(f"{path} is not absolute")
    fd = os.open("/", HOLD_FLAGS | os.O_DIRECTORY)
    names = [n for n in path.split("/") if n]
    try:
        for i, name in enumerate(names):
            if name in (".", ".."):
                raise PathChanged(f"{path} is not canonical")
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
        raise PathChanged(f"a component of {path} is gone ({exc.strerror})") from exc
    except BaseException:
        _close(fd)
        raise
    return fd


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
