"""Where multiplexer sockets live, and what is checked before one is trusted.

    $XDG_RUNTIME_DIR/paddock-mux/        (else ~/.cache/paddock/mux)     0700, ours
      NAME.sock   the daemon's socket     0600, ours, served by a process of our uid
      NAME.lock   held (flock) by the daemon for its whole life: one daemon per NAME
      NAME.log    the daemon's own log (never a token, an env value or output)

NAME hashes the target's identity (``route``), never its token. The directory
is opened once, without following a link at its last component, and checked
by descriptor (ours, closed to group and others); every socket, lock and log is
then reached through that descriptor (``/proc/self/fd/N/NAME``), so the
directory checked is the one used even if the path is swapped meanwhile.

A socket is talked to only if it is a socket, ours, closed to group and
others, and the process listening on it runs as our uid (``SO_PEERCRED``).
Anything else is refused with the reason and the fix, never replaced quietly:
something put it there that should not have.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Mapping

from agent_side.errors import AgentError

SOCKET_SUFFIX = ".sock"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class MuxUnsafe(AgentError):
    """A multiplexer socket or its directory could be someone else's: it is not used."""

    label = "mux refused"


class MuxUnavailable(AgentError):
    """No multiplexer could be reached or started; ``paddock run`` goes on without one."""

    label = "mux unavailable"


def default_dir(environ: Mapping[str, str]) -> str:
    """``$XDG_RUNTIME_DIR/paddock-mux`` when that is set (and absolute), else the cache dir."""
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/"):
        return os.path.join(runtime, "paddock-mux")
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".cache", "paddock", "mux")


class MuxDir:
    """The private directory of one user's multiplexers, held open by descriptor."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def open(cls, path: str) -> MuxDir:
        """Open (making it 0700 if missing) and check the directory; ``MuxUnsafe`` if not ours."""
        try:
            _make_private_dirs(path)
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise MuxUnsafe(
                    f"{path} is not a directory (a link, or a file); remove it, or give --no-mux"
                ) from exc
            raise MuxUnavailable(f"cannot use {path}: {exc.strerror}") from exc
        try:
            check_private_dir(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> MuxDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def fd(self) -> int:
        return self._fd

    def address(self, name: str) -> str:
        """The socket's address through the held descriptor (short, whatever the path's length)."""
        return f"/proc/self/fd/{self._fd}/{name}{SOCKET_SUFFIX}"

    def shown(self, name: str, suffix: str = SOCKET_SUFFIX) -> str:
        """The file's path as a person would type it."""
        return os.path.join(self.path, name + suffix)

    def names(self) -> list[str]:
        """The NAMEs of every socket file in the directory."""
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd)
        try:
            entries = os.listdir(listing)
        finally:
            os.close(listing)
        return sorted(e[: -len(SOCKET_SUFFIX)] for e in entries if e.endswith(SOCKET_SUFFIX))

    def lstat(self, name: str, suffix: str = SOCKET_SUFFIX) -> os.stat_result | None:
        try:
            return os.lstat(name + suffix, dir_fd=self._fd)
        except FileNotFoundError:
            return None

    def open_file(self, name: str, suffix: str, flags: int) -> int:
        """Open NAME+suffix inside the directory, never through a link, private to us."""
        return os.open(name + suffix, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)

    def unlink(self, name: str, suffix: str = SOCKET_SUFFIX) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name + suffix, dir_fd=self._fd)


def _make_private_dirs(path: str) -> None:
    """Make each missing directory of ``path`` with mode 0700, as ``mkdir -p -m 700`` would."""
    missing = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        # Another paddock may make it meanwhile; it is checked like any other.
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)


def check_private_dir(path: str, info: os.stat_result) -> None:
    """``MuxUnsafe`` unless ``info`` is a directory of ours that group and others cannot use."""
    uid = os.getuid()
    if not stat.S_ISDIR(info.st_mode):
        raise MuxUnsafe(f"{path} is not a directory; remove it, or give --no-mux")
    if info.st_uid != uid:
        raise MuxUnsafe(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {uid}): its sockets could "
            "be anyone's; remove it (or point XDG_RUNTIME_DIR at your own), or give --no-mux"
        )
    if info.st_mode & 0o077:
        raise MuxUnsafe(
            f"{path} is open to group or others (mode {info.st_mode & 0o777:o}): someone else "
            f"could plant a socket there; run: chmod 700 {path} (or give --no-mux)"
        )


def check_socket_file(shown: str, info: os.stat_result) -> None:
    """``MuxUnsafe`` unless ``info`` is a socket of ours that group and others cannot use."""
    uid = os.getuid()
    if not stat.S_ISSOCK(info.st_mode):
        raise MuxUnsafe(f"{shown} is not a socket; remove it, or give --no-mux")
    if info.st_uid != uid:
        raise MuxUnsafe(
            f"{shown} belongs to uid {info.st_uid}, not to you (uid {uid}): refusing to hand "
            f"it a token; remove it (rm {shown}), or give --no-mux"
        )
    if info.st_mode & 0o077:
        raise MuxUnsafe(
            f"{shown} is open to group or others (mode {info.st_mode & 0o777:o}): refusing to "
            f"hand it a token; remove it (rm {shown}), or give --no-mux"
        )


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (``SO_PEERCRED``)."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return int(uid)


def check_peer(shown: str, sock: socket.socket) -> None:
    """``MuxUnsafe`` unless the process serving ``sock`` runs as our uid."""
    uid, theirs = os.getuid(), peer_uid(sock)
    if theirs != uid:
        raise MuxUnsafe(
            f"the process serving {shown} runs as uid {theirs}, not as you (uid {uid}): "
            f"refusing to hand it a token; remove the socket (rm {shown}), or give --no-mux"
        )
