"""A fence's Landlock domain: the host's abstract unix sockets out of its reach.

A turn given the host's network shares its network namespace, and abstract
unix sockets are named per network namespace, in no filesystem: every one
listening on the host (a D-Bus bus, an X server, a container runtime's
shim) answered a turn, and their peers trust a caller for being on the
machine. Since Linux 6.12 (Landlock ABI 6) a thread can put itself, and
everything it starts from then on, in a domain that reaches only the
abstract sockets made inside it. The thread that starts a fence's
bubblewrap does so first (``confine_thread``), and the fence inherits the
domain. The domain governs no file access, so bubblewrap's mounts go on as
before, and it confines nothing outside the fence.

Joining a domain takes CAP_SYS_ADMIN or no_new_privs. A thread without the
capability sets no_new_privs on itself only where bubblewrap is not setuid
(a setuid bubblewrap, on kernels without unprivileged user namespaces,
needs its bit); there, as on older kernels, the fence goes without the
scope, and ``paddock-target doctor`` says so.

Standard library only: the privileged launcher imports it too.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import stat

from target_side.fence import raw_syscalls
from target_side.trust import PROGRAM_PATH

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
CREATE_RULESET_VERSION = 1 << 0
SCOPED_ABI = 6
"""The first Landlock ABI with scopes (Linux 6.12)."""
PR_SET_NO_NEW_PRIVS = 38
CAP_SYS_ADMIN = 21


class _Ruleset(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


@functools.cache
def abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock."""
    try:
        return raw_syscalls.call("landlock_create_ruleset", None, 0, CREATE_RULESET_VERSION)
    except (OSError, LookupError):
        return 0


def scopes_sockets() -> bool:
    """Whether this kernel can keep a fence from the host's abstract unix sockets."""
    return abi() >= SCOPED_ABI


def confine_thread(bwrap: str | None = None) -> bool:
    """Put the calling thread, and everything it starts from now on, in a domain that reaches
    only its own abstract unix sockets; whether it now is (see the module for when not).

    For a thread that ends with the fence it started: neither the domain nor
    no_new_privs can be left again.
    """
    if not scopes_sockets():
        return False
    if not raw_syscalls.has_effective(CAP_SYS_ADMIN):
        if bwrap_setuid(bwrap):
            return False
        raw_syscalls.call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    ruleset = _Ruleset(0, 0, SCOPE_ABSTRACT_UNIX_SOCKET)
    made = raw_syscalls.call(
        "landlock_create_ruleset", ctypes.byref(ruleset), ctypes.sizeof(ruleset), 0
    )
    try:
        raw_syscalls.call("landlock_restrict_self", made, 0)
    finally:
        os.close(made)
    return True


@functools.cache
def bwrap_setuid(bwrap: str | None = None) -> bool:
    """Whether ``bwrap`` (the one the target finds, if None) is setuid, or cannot be told:
    then a thread without CAP_SYS_ADMIN gives it no domain (no_new_privs would cost its bit)."""
    program = bwrap or shutil.which("bwrap", path=PROGRAM_PATH)
    try:
        return program is None or bool(os.stat(program).st_mode & stat.S_ISUID)
    except OSError:
        return True
