"""A turn's output reaches the disk as it is written, not all at once when the turn ends,
and does not stay behind in the page cache once it is there.

The spool's closing sync runs between a turn's last byte and its exit event:
left to it, 200 MiB of output held the exit back 0.12 s. The spool asks the
kernel to start writing out each ``WRITEBACK_BYTES`` as they pass, and lets
the cache go of what it asked to be written out the time before: cached, a
turn's output only grew the page cache, which on a VM handing its free memory
back to its host halved the rate of every turn after the first gigabyte.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
from pathlib import Path

import pytest

from agent_side.turns import output_bytes
from shared.wire import OutputEvent
from target_side.fence import raw_syscalls
from target_side.service import spool as spool_module
from target_side.service.spool import (
    CACHED_AFTER_SYNC,
    WRITEBACK_BYTES,
    EventSpool,
    events_on_disk,
)

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def cached_bytes(path: Path) -> int:
    """How much of ``path`` is in the page cache now (``mincore(2)`` over a mapping of it)."""
    libc = raw_syscalls.libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            pages = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if libc.mincore(address, size, pages) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(byte & 1 for byte in pages.raw) * PAGE
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def test_output_is_handed_to_the_disk_as_it_passes_not_left_to_the_closing_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[int, int]] = []

    def recorded(fd: int, offset: int, length: int) -> None:
        started.append((offset, length))
        raw_syscalls.start_writeback(fd, offset, length)  # the real call: only watched

    monkeypatch.setattr(spool_module, "start_writeback", recorded)
    spool = EventSpool(tmp_path / "events.frames")
    chunk = os.urandom(MIB)
    chunks = 3 * WRITEBACK_BYTES // MIB + 1
    seen_after = []
    for _ in range(chunks):
        spool.append("stdout", raw=chunk)
        seen_after.append(len(started))
    on_disk = (tmp_path / "events.frames").stat().st_size
    # Asked for as the output passed each mark, before any sync: not at the end.
    assert seen_after[WRITEBACK_BYTES // MIB - 1] == 1
    assert len(started) == 3
    # One range after another from the spool's start, together never past what was written.
    assert started[0][0] == 0
    for (offset, length), (after, _) in itertools.pairwise(started):
        assert offset + length == after
        assert length >= WRITEBACK_BYTES
    assert started[-1][0] + started[-1][1] <= on_disk
    assert on_disk - (started[-1][0] + started[-1][1]) < WRITEBACK_BYTES
    assert spool.sync()
    spool.close()
    written = events_on_disk(tmp_path / "events.frames")
    assert sum(len(output_bytes(e)) for e in written if isinstance(e, OutputEvent)) == chunks * MIB


def test_a_spool_whose_file_cannot_be_written_out_early_still_syncs_at_its_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The early start is a head start only: when the kernel refuses it, nothing is lost."""

    def refused(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "sync_file_range: Input/output error")

    monkeypatch.setattr(spool_module, "start_writeback", refused)
    spool = EventSpool(tmp_path / "events.frames")
    for _ in range(WRITEBACK_BYTES // MIB + 1):
        spool.append("stdout", raw=b"x" * MIB)
    assert spool.sync()
    spool.append_kept("exit", exit_code=0)
    assert [e.kind for e in events_on_disk(tmp_path / "events.frames")][-1] == "exit"


def test_the_kernel_is_really_asked(tmp_path: Path) -> None:
    """The C library's ``sync_file_range``, with its errors as ``OSError``."""
    path = tmp_path / "data"
    path.write_bytes(b"y" * (2 * MIB))
    fd = os.open(path, os.O_RDWR)
    try:
        raw_syscalls.start_writeback(fd, 0, 2 * MIB)
    finally:
        os.close(fd)
    read, write = os.pipe()
    try:
        with pytest.raises(OSError) as raised:
            raw_syscalls.start_writeback(read, 0, 1)
        assert raised.value.errno == errno.ESPIPE
    finally:
        os.close(read)
        os.close(write)


def test_output_written_out_leaves_the_page_cache_as_more_comes(tmp_path: Path) -> None:
    path = tmp_path / "events.frames"
    spool = EventSpool(path)
    for _ in range(WRITEBACK_BYTES // MIB):
        spool.append("stdout", raw=os.urandom(MIB))
    assert spool.sync()  # the first range written out (a spool this small keeps its cache)
    assert cached_bytes(path) >= WRITEBACK_BYTES  # a fresh write is cached, as it always was
    for _ in range(WRITEBACK_BYTES // MIB + 1):
        spool.append("stdout", raw=os.urandom(MIB))
    # The second mark started the second range's writing out and let the first range go.
    assert cached_bytes(path) <= path.stat().st_size - WRITEBACK_BYTES + PAGE
    spool.close()


def test_a_synced_long_output_leaves_the_page_cache_whole(tmp_path: Path) -> None:
    """Its last range, and what was still being written out when a mark passed, go at the
    closing sync."""
    path = tmp_path / "events.frames"
    spool = EventSpool(path)
    for _ in range(CACHED_AFTER_SYNC // MIB + 2 * WRITEBACK_BYTES // MIB):
        spool.append("stdout", raw=os.urandom(MIB))
    assert spool.sync()
    assert cached_bytes(path) < WRITEBACK_BYTES
    # Read back from the disk, whole.
    written = events_on_disk(path)
    assert sum(len(output_bytes(e)) for e in written if isinstance(e, OutputEvent)) == (
        CACHED_AFTER_SYNC + 2 * WRITEBACK_BYTES
    )
    spool.close()
