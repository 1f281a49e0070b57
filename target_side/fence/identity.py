"""How the server acts on the host as a role's uid: by itself, or through the launcher.

Everything a turn does on the host happens as its role's uid, and three things
the server does for a turn need that uid or root: starting bubblewrap (and
signalling, killing and placing what it starts), making the role's home, and
the audit after the turn. ``Identity`` is those three; ``for_settings`` picks
the way this server can do them:

- ``InProcess``: the server is root (tests, ``--local`` as root), or every
  turn runs as the server's own uid (``[fence] identity = "server"``). It
  starts bubblewrap as its own child, switching uid and gid itself.
- ``launcher_client.ViaLauncher``: the server is not root and ``[fence]
  launcher`` names the privileged launcher's socket; each of the three is a
  request to it (``fence/launcher.py`` says what it grants).

Either way ``spawn`` returns a ``FenceProcess``, so ``RunningTurn`` never
knows which one ran the fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from target_side.config import Settings
from target_side.fence import audit, home
from target_side.fence.launcher_client import ViaLauncher
from target_side.fence.limits import TurnLimits
from target_side.fence.pidns import signal_namespace

BWRAP_ENV = {"PATH": "/usr/bin:/bin:/usr/local/bin"}
"""All the environment bubblewrap itself gets (never the server's, never the turn's)."""
TURN_UMASK = 0o022
"""One umask for every turn, whatever the server was started with."""


class FenceProcess(Protocol):
    """bubblewrap started for a turn: its pipes, its end, and what may be done to its fence."""

    pid: int
    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None
    lost: str | None
    """Why the process can no longer be followed (its launcher went away), or None."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    async def communicate(self) -> tuple[bytes, bytes]: ...

    async def adopt(self, pid: int, pid_ns: int | None, limits: TurnLimits | None) -> None:
        """The fence's first process is up and blocked: hold it, and put it into ``limits``.

        Raises ``ProcessLookupError`` if the fence died meanwhile, another error if
        the limits could not be applied.
        """

    def signal_fence(self, signum: int) -> int:
        """Send ``signum`` to every process of the fence but its reaper; how many, if known."""

    def kill_fence(self) -> None:
        """SIGKILL the fence's reaper (so its whole pid namespace), or bubblewrap before it."""

    def kill(self) -> None:
        """SIGKILL bubblewrap itself."""

    def release(self) -> None:
        """Let go of what was held for the process once it has ended."""


class Identity(Protocol):
    """Starting, housing and auditing a role's turns as the role's uid."""

    async def spawn(
        self,
        role: str,
        ids: tuple[int, int],
        argv: Sequence[str],
        pass_fds: Sequence[int],
        stdin_open: bool,
    ) -> FenceProcess: ...

    async def prepare_home(self, state_root: Path, role: str, ids: tuple[int, int]) -> str | None:
        """Make or repair the role's home (``fence.home``); a sentence if it was repaired."""

    async def audit(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> list[str]:
        """Move aside protected names the turn made (``fence.audit``); one sentence per move."""


def for_settings(settings: Settings) -> Identity:
    """The launcher where the server is not root and one is configured; else the server itself."""
    launcher = settings.fence.launcher
    if launcher is not None and settings.fence.identity == "per-role" and os.getuid() != 0:
        return ViaLauncher(launcher)
    return InProcess()


class InProcess:
    """The server itself: root, or a server whose turns all run as its own uid."""

    async def spawn(
        self,
        role: str,
        ids: tuple[int, int],
        argv: Sequence[str],
        pass_fds: Sequence[int],
        stdin_open: bool,
    ) -> FenceProcess:
        uid, gid = ids
        prefix: tuple[str, ...] = ()
        switch = {}
        if (uid, gid) != (os.getuid(), os.getgid()):
            prefix = as_ids_prefix(uid, gid)
            if not prefix:
                switch = {"user": uid, "group": gid, "extra_groups": []}
        process = await asyncio.create_subprocess_exec(
            *prefix,
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin_open else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=BWRAP_ENV,
            pass_fds=tuple(pass_fds),
            start_new_session=True,  # a Ctrl-C at the server's terminal is not the turn's
            close_fds=True,
            umask=TURN_UMASK,
            **switch,
        )
        return LocalProcess(process)

    async def prepare_home(self, state_root: Path, role: str, ids: tuple[int, int]) -> str | None:
        return await asyncio.to_thread(home.prepare_home, state_root, role, *ids)

    async def audit(
        self, role: str, ids: tuple[int, int], expected: Mapping[str, str | None], turn_id: str
    ) -> list[str]:
        return await asyncio.to_thread(audit.enforce, expected, turn_id)


def as_ids_prefix(uid: int, gid: int) -> tuple[str, ...]:
    """``setpriv`` switching to ``uid:gid`` with no groups and no capabilities; () without one.

    Switching ids in the child itself makes Python fork the whole server (its
    page tables: several milliseconds, growing with its memory), where a child
    that keeps the server's ids is started with ``vfork``. Its real, effective
    and saved ids all become the role's once bubblewrap is executed, and no
    capability survives: the same as Python's own switch.
    """
    setpriv = _setpriv()
    if setpriv is None:
        return ()
    return (
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--",
    )


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` on the trusted path, if it takes the options used (2.31+)."""
    found = shutil.which("setpriv", path=BWRAP_ENV["PATH"])
    if found is None:
        return None
    own = f"--reuid={os.getuid()}", f"--regid={os.getgid()}", "--keep-groups"
    probe = [found, *own, "--inh-caps=-all", "--ambient-caps=-all", "--", "true"]
    done = subprocess.run(probe, capture_output=True, env=BWRAP_ENV, check=False)
    return found if done.returncode == 0 else None


def warm() -> None:
    """Find the helpers spawning uses, once, before a turn needs them (blocking)."""
    _setpriv()


class LocalProcess:
    """bubblewrap as the server's own child: signalled and placed by the server itself."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.pid = process.pid
        self.stdin = process.stdin
        self.stdout = process.stdout
        self.stderr = process.stderr
        self.lost: str | None = None
        self._reaper: int | None = None
        self._reaper_pid: int | None = None
        self._pid_ns: int | None = None

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def wait(self) -> int:
        return await self._process.wait()

    async def communicate(self) -> tuple[bytes, bytes]:
        return await self._process.communicate()

    async def adopt(self, pid: int, pid_ns: int | None, limits: TurnLimits | None) -> None:
        # Held as a pidfd so a later kill cannot hit a recycled pid.
        with contextlib.suppress(OSError):
            self._reaper = os.pidfd_open(pid)
        self._reaper_pid, self._pid_ns = pid, pid_ns
        if limits is not None:
            limits.place(pid)

    def signal_fence(self, signum: int) -> int:
        return signal_namespace(self._pid_ns, self._reaper_pid, signum)

    def kill_fence(self) -> None:
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._reaper, signal.SIGKILL)
        else:
            self.kill()

    def kill(self) -> None:
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def release(self) -> None:
        if self._reaper is not None:
            os.close(self._reaper)
            self._reaper = None
