"""A turn's output reaches the disk as it is written, not all at once when the turn ends.

The spool's closing sync runs between a turn's last byte and its exit event:
left to it, 200 MiB of output held the exit back 0.12 s. The spool asks the
kernel to start writing out each ``WRITEBACK_BYTES`` as they pass.
"""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest

from agent_side.turns import output_bytes
from shared.wire import OutputEvent
from target_side.fence import raw_syscalls
from target_side.service import spool as spool_module
from target_side.service.spool import WRITEBACK_BYTES, EventSpool, events_on_disk

MIB = 1 << 20


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
