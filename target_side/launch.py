"""The bubblewrap command line for a planned fence. The only module that knows bwrap's flags."""

from __future__ import annotations

import asyncio
import os
import posixpath
import shutil
from dataclasses import dataclass

from target_side.errors import BackendError
from target_side.plan import SCRIPT_PATH, FencePlan
from target_side.scratch import Scratch

TRUSTED_BIN_PATH = "/usr/bin:/bin:/usr/local/bin"
"""Where bwrap is looked for: never the server's own $PATH, which the environment could bend."""

BWRAP_ENV = {"PATH": TRUSTED_BIN_PATH}


@dataclass(frozen=True)
class LaunchFds:
    """Descriptors bubblewrap inherits: where it reports status, and the script body."""

    status: int
    script: int | None = None

    def passed(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.status, self.script) if fd is not None)


def find_bwrap() -> str:
    """The bwrap executable on the trusted system path."""
    found = shutil.which("bwrap", path=TRUSTED_BIN_PATH)
    if found is None:
        raise BackendError(
            "bubblewrap (bwrap) is not installed; install it (apt-get install bubblewrap) "
            "or set [fence] backend = \"none\" to run turns without isolation"
        )
    return found


def bwrap_argv(bwrap: str, plan: FencePlan, scratch: Scratch, fds: LaunchFds) -> list[str]:
    """The full argv: namespaces and identity, then mounts in an order where later ones win."""
    return [
        bwrap,
        *_namespaces(plan),
        "--json-status-fd", str(fds.status),
        *_base_mounts(scratch),
        *_planned_mounts(plan),
        "--bind", str(scratch.cache), posixpath.join(plan.home, ".cache"),
        *_script_mount(fds),
        "--chdir", plan.cwd,
        "--",
        *plan.argv,
    ]


def _namespaces(plan: FencePlan) -> list[str]:
    # As root, bwrap would otherwise hand the child full capabilities in its namespace,
    # enough to remount a read-only bind writable: drop them all and run as non-root.
    flags = ["--unshare-all", "--unshare-user", "--disable-userns"]
    if plan.network:
        flags.append("--share-net")
    return [
        *flags,
        "--uid", str(plan.uid), "--gid", str(plan.gid),
        "--cap-drop", "ALL",
        "--die-with-parent",
        "--new-session",  # TIOCSTI: no way to push keystrokes into a terminal outside
        "--hostname", "paddock",
    ]


def _base_mounts(scratch: Scratch) -> list[str]:
    # /tmp first: planned mounts under /tmp (a workspace there) must land on top of it.
    return ["--proc", "/proc", "--dev", "/dev", "--bind", str(scratch.tmp), "/tmp"]


def _planned_mounts(plan: FencePlan) -> list[str]:
    flags = {"ro": "--ro-bind", "rw": "--bind", "symlink": "--symlink"}
    argv: list[str] = []
    for mount in plan.mounts:
        argv += [flags[mount.kind], mount.source, mount.dest]
    return argv


def _script_mount(fds: LaunchFds) -> list[str]:
    if fds.script is None:
        return []
    return ["--ro-bind-data", str(fds.script), SCRIPT_PATH]


def script_fd(body: bytes) -> int:
    """A sealed in-memory file holding ``body``, for bwrap to copy into the fence."""
    fd = os.memfd_create("paddock-script", os.MFD_CLOEXEC)
    os.write(fd, body)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def probe(bwrap: str) -> str | None:
    """Run ``true`` in a minimal fence; None if it worked, else what went wrong."""
    argv = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
        "--die-with-parent", "--ro-bind", "/usr", "/usr", *_usr_merge_links(), "--",
        "/usr/bin/true",
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=BWRAP_ENV,
    )
    _, err = await proc.communicate()
    if proc.returncode == 0:
        return None
    return err.decode(errors="replace").strip() or f"bwrap exited {proc.returncode}"


def _usr_merge_links() -> list[str]:
    links = []
    for name in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(name):
            links += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            links += ["--ro-bind", name, name]
    return links
