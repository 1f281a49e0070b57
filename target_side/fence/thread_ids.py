"""One thread acting as a role's ids for the instant it starts bubblewrap.

A root server starts a role's fence as the role's uid and gid, with no
supplementary groups and no capabilities. ``setpriv`` does that in a program
of its own, executed before bubblewrap: a second ``execve`` and dynamic link
on every turn (about 1.5 ms here). Python's own switch (``Popen(user=...)``)
forks the whole server instead of ``vfork``-ing it (several milliseconds).

Linux keeps credentials per thread; only the C library's wrappers change them
for every thread at once. So the worker thread that starts a turn (a thread of
its own, used once: ``nursery.Worker``) changes its own ids with the raw system
calls, ``vfork``-s bubblewrap, which inherits them, and takes root back at once:

- ``setgroups(0)``, then ``setresgid(gid, gid, saved)`` and ``setresuid(uid,
  uid, 0)``: real and effective ids become the role's and the saved ones stay
  the server's (uid 0), which is what lets the thread switch back. ``execve`` sets the saved
  ids to the effective ones, so bubblewrap runs with all three the role's and
  no way back; with real and effective uid not 0 it gains no capability.
- the thread's ambient and inheritable capabilities are cleared first (a
  server given capabilities by its service manager must not hand them on).
- a thread changing its ids makes the whole process non-dumpable (the kernel
  does, under ``fs.suid_dumpable`` 0 or 2): nothing running as the role's uid
  may ptrace the server, even while one of its threads has that uid. Under
  ``suid_dumpable`` 1 (a debugging setting the kernel calls insecure) it does
  not, so then this path is not taken.

Only for a role uid that no host account has (the default pool's): for the
instant the thread holds it, a process of that uid could signal the thread,
and a pool uid has no processes outside fences, whose pid namespaces cannot
name it. A uid with an account, an unknown architecture, or a failure to
switch leaves the turn to ``setpriv``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import pwd
import threading
from collections.abc import Iterator
from pathlib import Path

from target_side.errors import ThreadIdsError
from target_side.fence import raw_syscalls

CALLS = ("setgroups", "setresuid", "setresgid", "capget", "capset")
"""The calls a switch makes by number (the C library offers no per-thread wrapper)."""
SUID_DUMPABLE = Path("/proc/sys/fs/suid_dumpable")
SUID_DUMP_USER = 1
"""The setting under which a process that changed ids stays traceable by its new uid."""
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_one_shot = threading.local()


def usable_for(uid: int) -> bool:
    """Whether a turn of ``uid`` may be started by a thread acting as it (see the module)."""
    if os.getresuid() != (0, 0, 0) or uid == 0 or not _calls_known():
        return False
    return not _has_account(uid) and _suid_dumpable() != SUID_DUMP_USER


@functools.cache
def _calls_known() -> bool:
    # The machine does not change: asked once, not on every turn.
    return all(raw_syscalls.number(name) is not None for name in CALLS)


def _suid_dumpable() -> int:
    try:
        return int(SUID_DUMPABLE.read_text())
    except (OSError, ValueError):
        return SUID_DUMP_USER  # unknown: assume the unsafe setting


def _has_account(uid: int) -> bool:
    # Asked on every turn: an account made later for a pool uid must be seen at once.
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def mark_one_shot() -> None:
    """Say this thread ends after its one process (``acting_as`` runs on no other)."""
    _one_shot.marked = True


@contextlib.contextmanager
def acting_as(uid: int, gid: int) -> Iterator[None]:
    """This thread alone as ``uid``/``gid`` (no groups, no capabilities to hand on), then root.

    A process started inside (``vfork``) keeps the role's ids; the thread gets
    root back on the way out.
    """
    if not getattr(_one_shot, "marked", False):
        raise ThreadIdsError("a role's ids are taken only on a turn's own worker thread")
    groups, gids = os.getgroups(), os.getresgid()
    _drop_inherited_capabilities()
    _call("setgroups", 0, None)
    try:
        _call("setresgid", gid, gid, gids[2])
        try:
            _call("setresuid", uid, uid, 0)
            try:
                yield
            finally:
                _call("setresuid", 0, 0, 0)
        finally:
            _call("setresgid", *gids)
    finally:
        _set_groups(groups)


def _drop_inherited_capabilities() -> None:
    libc = raw_syscalls.libc()
    if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
        raise ThreadIdsError(f"clearing ambient capabilities: {os.strerror(ctypes.get_errno())}")
    try:
        header, data = raw_syscalls.capabilities()
    except (OSError, LookupError) as exc:
        raise ThreadIdsError(f"reading capabilities: {exc}") from None
    if data[0].inheritable or data[1].inheritable:
        data[0].inheritable = data[1].inheritable = 0
        _call("capset", ctypes.byref(header), data)


def _set_groups(groups: list[int]) -> None:
    array = (ctypes.c_uint32 * len(groups))(*groups)
    _call("setgroups", len(groups), array)


def _call(name: str, *args: object) -> None:
    try:
        raw_syscalls.call(name, *args)
    except LookupError:
        raise ThreadIdsError(f"no {name} number known for {platform.machine()}") from None
    except OSError as exc:
        raise ThreadIdsError(exc.strerror or str(exc)) from None
