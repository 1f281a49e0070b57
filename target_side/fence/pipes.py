"""The pipes a turn's output comes through: as wide as the system allows a pipe to be.

A pipe holds 64 KiB by default: a turn printing fast fills it, sleeps, and is
woken once per 64 KiB the server reads. A wider pipe lets both sides move a
megabyte per wakeup, so a turn's output costs the server far fewer reads,
events and writes to its spool.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
from typing import IO

PIPE_BYTES = 1 << 20
"""Linux's default ``/proc/sys/fs/pipe-max-size``: what an unprivileged process may ask for."""
READ_BYTES = PIPE_BYTES
"""How much of a turn's output one read (and one event) takes, at most."""


def widen(fd: int) -> None:
    """Make the pipe ``fd`` belongs to hold ``PIPE_BYTES`` (as it was, where it cannot)."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)


async def read_end(pipe: IO[bytes]) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """``pipe`` read on the running loop: its reader, and the transport that closes it (at its
    end of file, or when its owner gives up on it)."""
    reader = asyncio.StreamReader(limit=READ_BYTES)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe
    )
    return reader, transport
