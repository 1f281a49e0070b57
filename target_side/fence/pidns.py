"""Signalling a fence's processes on the host: every one of its pid namespace, by pidfd.

Standard library only: the privileged launcher imports it too. Each process
is opened as a pidfd and checked through that handle, so a pid recycled by
another process between the look and the signal is never signalled.
"""

from __future__ import annotations

import os
import select
import signal


def signal_namespace(pid_ns: int | None, reaper: int | None, signum: int) -> int:
    """Signal every process in pid namespace ``pid_ns`` except its reaper.

    Returns how many were signalled. Reading another uid's ``/proc/PID/ns/pid``
    takes ptrace access: root, or the uid that owns the fence's user namespace.
    The caller's own namespace is never a fence's: signalling it would reach
    every process on the host, the server included, so it signals nothing.
    """
    if pid_ns is None or pid_ns == pid_namespace(os.getpid()):
        return 0
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == reaper:
            continue
        count += _signal_if_member(int(entry), pid_ns, signum)
    return count


def _signal_if_member(pid: int, pid_ns: int, signum: int) -> int:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return 0
    try:
        if os.stat(f"/proc/{pid}/ns/pid").st_ino != pid_ns:
            return 0
        signal.pidfd_send_signal(pidfd, signum)
        return 1
    except OSError:
        return 0
    finally:
        os.close(pidfd)


def pid_namespace(pid: int) -> int | None:
    """The inode of ``pid``'s pid namespace, or None if it cannot be read."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def parent_of(pidfd: int, pid: int) -> int | None:
    """The parent pid of the live process ``pidfd`` (opened on ``pid``), or None if it is gone.

    Read from ``/proc/PID/status``, then the pidfd is asked whether its process
    still lives: if it does, the status read was its own, not a successor's.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    if exited(pidfd):
        return None
    for line in status.splitlines():
        if line.startswith(b"PPid:"):
            return int(line.split()[1])
    return None


def exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd turns readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])
