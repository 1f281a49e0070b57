"""Reading where cgroups are: the hierarchies mounted, and a process's place in each.

Pure parsing of ``/proc/PID/cgroup`` and ``/proc/PID/mountinfo``, shared by the
limiter (which creates turn cgroups) and ``doctor`` (which only looks); and the
reads and writes of control files that every turn makes, a dozen of them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "pids", "cpu")
TURN_PREFIX = "paddock-"
TURN_CGROUP = re.compile(rf"{TURN_PREFIX}(\d+)-[ts]-[0-9a-f]+")
"""A turn's cgroup, ``paddock-SERVERPID-TURNID``, made below the server's own; or a session's
(``s-``: one cgroup for its whole fence)."""
V1_USAGE = "cpuacct"
"""cgroup v1 keeps cpu usage in its own controller; joined only to report ``cpu_s``."""


@dataclass(frozen=True)
class CgroupMount:
    """One mounted hierarchy: v1 (with the controllers paddock uses that it carries) or v2."""

    version: int
    root: str
    point: str
    controllers: frozenset[str]


CONTROL_READ_BYTES = 65536
"""More than any control file a turn reads holds (``memory.stat`` is the largest, ~1.5 KiB)."""


def write_control(path: str | os.PathLike[str], value: str) -> None:
    """``value`` into a control file in one ``write``, as the kernel parses it.

    Plain descriptor calls: a file object (``Path.write_text``) costs the
    interpreter three times the system calls' own time, on every turn.
    """
    # Made and emptied as ``open(path, "w")`` would: a no-op on cgroupfs, where every control
    # file exists and none keeps what was written before.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read_control(path: str | os.PathLike[str]) -> str:
    """A control file's text (``write_control``'s reader)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, CONTROL_READ_BYTES).decode()
    finally:
        os.close(fd)


def memberships(text: str) -> dict[str, str]:
    """controller (or "" for v2) -> the process's cgroup path, from ``/proc/PID/cgroup``."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path
    return found


def cgroup_mounts(text: str) -> list[CgroupMount]:
    """The cgroup hierarchies in a ``mountinfo`` text."""
    found = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2":
            found.append(CgroupMount(2, root, point, frozenset()))
        else:
            known = frozenset(tail[2].split(",")) & {*CONTROLLERS, V1_USAGE}
            found.append(CgroupMount(1, root, point, known))
    return found


def _unescape(field_text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field_text = field_text.replace(code, char)
    return field_text


def under(mount: CgroupMount, path: str) -> Path | None:
    """Where cgroup ``path`` appears under ``mount`` (None if the mount does not show it)."""
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(f"{root}/"):
        return None
    return Path(mount.point + path[len(root) :])


def v1_mount(mounts: list[CgroupMount], controller: str) -> CgroupMount | None:
    """The v1 hierarchy carrying ``controller``, if one is mounted."""
    return next((m for m in mounts if m.version == 1 and controller in m.controllers), None)


def v2_mount(mounts: list[CgroupMount]) -> CgroupMount | None:
    """The unified (v2) hierarchy, if mounted."""
    return next((m for m in mounts if m.version == 2), None)


def words(path: Path) -> list[str]:
    """The whitespace-separated words of a cgroup file; none if it cannot be read."""
    try:
        return path.read_text().split()
    except OSError:
        return []
