"""Files to and from a target (``/v1/files``, ``/v1/archive``): what ``Target.read_file`` and
its kin, and ``paddock cp``, do.

The target decides what may be read or written and does it as the role's uid;
this side only moves bytes, and keeps its own side safe:

- a file fetched is written to a temporary file beside its destination and
  renamed into place once whole, so a broken download leaves nothing behind;
- a directory fetched is spooled whole, then unpacked with tarfile's ``data``
  filter (no absolute names, no ``..``, no links out, no devices), the same
  rules the target holds an upload to;
- a directory sent is packed into a temporary file first: the target learns
  its size up front, and refuses one over the role's ``file_mb`` before it
  is sent.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError

from agent_side.client import TargetClient
from agent_side.errors import FileFailed, ProtocolError, UsageError
from shared.wire import ArchiveWritten, FileEntry, FileListing, FileWritten, LeaseRef

CHUNK = 1 << 20
SPOOL_IN_MEMORY = 8 << 20
"""An archive up to this size is packed in memory, beyond it in a temporary file."""

_Model = TypeVar("_Model", bound=BaseModel)


@dataclass(frozen=True)
class Acting:
    """Who a file operation is done as: a role, and the lease it acts under, if any."""

    role: str
    lease: LeaseRef | None = None


def _params(who: Acting, path: str, **more: str) -> dict[str, str]:
    if not path.startswith("/"):
        raise UsageError(f"{path!r} is relative; paths on the target are absolute (start with /)")
    params = {"role": who.role, "path": path, **more}
    if who.lease is not None:
        params |= {
            "lease_id": who.lease.lease_id,
            "lease_seat": who.lease.seat,
            "lease_generation": str(who.lease.generation),
        }
    return params


def read_file(client: TargetClient, who: Acting, path: str) -> bytes:
    """The whole file at ``path`` on the target."""
    return client.send("GET", "/v1/files", params=_params(who, path)).content


def download(client: TargetClient, who: Acting, path: str, into: BinaryIO) -> int | None:
    """Write the file at ``path`` to ``into`` as it comes; returns its permission bits, as the
    target said them (None if it did not)."""
    with client.stream("GET", "/v1/files", params=_params(who, path)) as response:
        expected = response.headers.get("content-length")
        written = 0
        for chunk in response.iter_bytes(CHUNK):
            into.write(chunk)
            written += len(chunk)
        if expected is not None and expected.isdigit() and int(expected) != written:
            raise ProtocolError(f"{path}: {written} bytes came of the {expected} announced")
        mode = response.headers.get("x-paddock-mode")
    if mode is None or len(mode) != 4 or any(c not in "01234567" for c in mode):
        return None
    return int(mode, 8) & 0o777


def write_file(
    client: TargetClient,
    who: Acting,
    path: str,
    data: bytes | IO[bytes],
    mode: int | None = None,
) -> FileWritten:
    """Make ``data`` (bytes, or a binary file read to its end) the file at ``path``.

    All or nothing: the target writes a temporary file, syncs it, and renames
    it over ``path`` only once every byte arrived. ``mode``: permission bits
    (at most 0o777); without, a replaced file keeps its own and a new one gets 0644.
    """
    more = {}
    if mode is not None:
        if not 0 <= mode <= 0o777:
            raise UsageError(f"mode {mode:o} is not permission bits (at most 777, no setuid)")
        more["mode"] = f"{mode:04o}"
    params = _params(who, path, **more)
    response = client.send("PUT", "/v1/files", params=params, content=_body(data))
    return _model(FileWritten, response.content)


def _body(data: bytes | IO[bytes]) -> bytes | IO[bytes] | Iterator[bytes]:
    """What to send: a regular file from its start as it is (its size goes ahead as
    Content-Length, so an over-size one is refused before it is sent); anything else read
    in chunks (a pipe's size says nothing of what is still to come)."""
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    try:
        whole = stat.S_ISREG(os.fstat(data.fileno()).st_mode) and data.tell() == 0
    except (AttributeError, OSError, ValueError):
        whole = False
    return data if whole else iter(lambda: data.read(CHUNK), b"")


def list_dir(client: TargetClient, who: Acting, path: str, limit: int = 10_000) -> FileListing:
    """The entry of ``path`` and, for a directory, up to ``limit`` of its entries."""
    params = _params(who, path, list="true", limit=str(limit))
    return _model(FileListing, client.send("GET", "/v1/files", params=params).content)


def stat_path(client: TargetClient, who: Acting, path: str) -> FileEntry | None:
    """What ``path`` is on the target, or None if nothing is there."""
    try:
        return list_dir(client, who, path, limit=0).entry
    except FileFailed as exc:
        if exc.status == 404:
            return None
        raise


def get_dir(client: TargetClient, who: Acting, path: str, into: str) -> int:
    """Fetch the directory at ``path`` and unpack it into the local directory ``into`` (made
    if missing, merged if not); returns how many entries it held."""
    with tempfile.TemporaryFile() as spool:
        with client.stream("GET", "/v1/archive", params=_params(who, path)) as response:
            for chunk in response.iter_bytes(CHUNK):
                spool.write(chunk)
        spool.seek(0)
        return unpack(spool, into)


def unpack(source: IO[bytes], into: str) -> int:
    """Unpack the tar in ``source`` into ``into`` under tarfile's ``data`` filter."""
    if not hasattr(tarfile, "data_filter"):
        raise UsageError("this Python's tarfile has no extraction filters; use 3.11.4 or newer")
    os.makedirs(into, exist_ok=True)
    try:
        with tarfile.open(fileobj=source, mode="r:") as archive:
            members = archive.getmembers()
            archive.extractall(into, members=members, filter="data")
    except tarfile.TarError as exc:
        raise ProtocolError(f"the target sent an archive that cannot be unpacked: {exc}") from exc
    return len(members)


def put_dir(client: TargetClient, who: Acting, local: str, path: str) -> ArchiveWritten:
    """Send the local directory ``local`` into ``path`` on the target (made if missing,
    merged if not): every entry or, refused, none."""
    with pack(local) as archive:
        response = client.send(
            "PUT",
            "/v1/archive",
            params=_params(who, path),
            content=archive,
            content_type="application/x-tar",
        )
    return _model(ArchiveWritten, response.content)


@contextlib.contextmanager
def pack(local: str) -> Iterator[IO[bytes]]:
    """The directory ``local`` as a tar, rewound: its own mode as ``.``, entries below it.

    Regular files, directories and symlinks; sockets, FIFOs and devices are left out.
    """
    if not os.path.isdir(local):
        raise UsageError(f"{local} is not a directory")
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
        with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as archive:
            archive.add(local, arcname=".", filter=_plain)
        spool.seek(0)
        yield spool


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
        return None
    info.mode &= 0o1777  # no setuid: the target refuses it
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def local_mode(path: str) -> int:
    """Permission bits of the local file ``path`` (setuid and the like left out)."""
    return stat.S_IMODE(os.stat(path).st_mode) & 0o777


def _model(model: type[_Model], content: bytes) -> _Model:
    try:
        return model.model_validate_json(content)
    except ValidationError as exc:
        raise ProtocolError(f"the target answered a body that is not a {model.__name__}") from exc
