"""The agent side's own files in the user's directories: where they go, and how they are written.

    $XDG_CONFIG_HOME/paddock/   (else ~/.config/paddock)       what the user set up: targets
    $XDG_STATE_HOME/paddock/    (else ~/.local/state/paddock)  what paddock learnt: cursors, status

Both directories are private (0700, tightened if found wider), and every file
in them is written whole to a private temporary name beside it (0600 from its
creation), fsynced, renamed over the old one, and the rename made durable: a
crash leaves the old file or the new one, never half of either. The XDG
variables count only when they hold absolute paths, as the specification says.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path


def config_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/paddock``, else ``~/.config/paddock``."""
    return _xdg(environ, "XDG_CONFIG_HOME", ".config")


def state_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME/paddock``, else ``~/.local/state/paddock``."""
    return _xdg(environ, "XDG_STATE_HOME", ".local/state")


def _xdg(environ: Mapping[str, str], variable: str, fallback: str) -> Path:
    given = environ.get(variable, "")
    if os.path.isabs(given):
        return Path(given) / "paddock"
    home = environ.get("HOME") or os.path.expanduser("~")
    return Path(home) / fallback / "paddock"


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter (created, or tightened, to 0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        # It holds tokens or what a user saw: whatever made it wider, nobody else may enter.
        path.chmod(0o700)
    return path


def write_private(path: Path, text: str, *, durable: bool = True) -> None:
    """Write ``path`` atomically, 0600 from its creation; ``durable`` fsyncs file and rename."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_text(path: Path) -> str | None:
    """The text of ``path``, not following a symlink in its last component; None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as source:
        return source.read()


@contextlib.contextmanager
def locked(directory: Path, name: str) -> Iterator[None]:
    """One writer at a time for the files ``name`` guards (an exclusive ``flock``)."""
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
