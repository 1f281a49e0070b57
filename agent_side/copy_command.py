"""``paddock cp [-r] SRC DST``: files and directories to or from a target, as scp does.

A remote path is written ``:PATH`` (on the target the options name) or
``NAME:PATH`` (on the stored target NAME, as ``-t NAME`` would say); the part
before the colon holds no ``/``, so ``./a:b`` is a local name. Anything else
is local, and ``-`` is stdin or stdout (a single file only). Exactly one side
is remote, and a remote path is absolute.

Where things land, as ``cp`` and ``scp`` decide it: a destination that is an
existing directory (or, remote, ends in ``/``) receives the source under its
own name; otherwise the destination is the new name. With ``-r`` a directory
goes as a tar stream, into a directory made if missing and merged into if not.

Exit statuses: 0 copied; 1 the target (or this machine) said no as ``cp``
would (no such file, permission, a directory without ``-r``); 126 the target's
fence refused it (its refusal on stderr, as ``paddock run`` prints one); 125
paddock failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import posixpath
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from agent_side import files
from agent_side.api import Target
from agent_side.connection import opened_target
from agent_side.errors import FileFailed, FileRefused, UsageError
from agent_side.leases import stored_ref as stored_lease
from agent_side.views import refusal_sentence, say
from shared.exit_status import ExitStatus
from shared.wire import LeaseRef

_TARGET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
FAILED = 1
"""What ``cp`` exits with when it could not copy."""


@dataclass(frozen=True)
class Place:
    """One side of a copy: a local path, or a path on a target (``target``: a stored name)."""

    path: str
    remote: bool = False
    target: str | None = None


def parse_place(text: str) -> Place:
    """``:PATH`` and ``NAME:PATH`` are remote; everything else (``./a:b`` too) is local."""
    head, colon, rest = text.partition(":")
    if colon and (head == "" or _TARGET_NAME.fullmatch(head)):
        return Place(rest, remote=True, target=head or None)
    return Place(text)


def copy(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run ``paddock cp``; returns its exit status."""
    source, dest = parse_place(args.source), parse_place(args.dest)
    remote = _the_remote_side(source, dest)
    if remote.target is not None:
        if args.target_name not in (None, remote.target):
            raise UsageError(
                f"{remote.target}:{remote.path} names target {remote.target}, "
                f"but -t names {args.target_name}; give one"
            )
        args.target_name = remote.target
    if not remote.path.startswith("/"):
        raise UsageError(
            f"remote path {remote.path!r} is relative; paths on the target are absolute "
            f"(:/srv/work/{remote.path or 'NAME'})"
        )
    mode = _mode(args.mode)
    lease = _lease(args.lease, environ)
    with opened_target(args, environ) as target:
        who = files.Acting(target.role, lease) if lease is not None else target.acting()
        try:
            if source.remote:
                _fetch(target, who, source.path, dest.path, recursive=args.recursive)
            else:
                _send(target, who, source.path, dest.path, recursive=args.recursive, mode=mode)
        except FileRefused as exc:
            say(refusal_sentence(exc.refusal))
            return int(ExitStatus.REFUSED)
        except FileFailed as exc:
            say(f"cp: {exc}")
            return FAILED
    return 0


def _lease(lease_id: str | None, environ: Mapping[str, str]) -> LeaseRef | None:
    if not lease_id:
        return None
    lease_id, seat, generation = stored_lease(lease_id, environ)
    return LeaseRef(lease_id=lease_id, seat=seat, generation=generation)


def _the_remote_side(source: Place, dest: Place) -> Place:
    if source.remote and dest.remote:
        raise UsageError("both paths are remote; copy to this machine first (one side is local)")
    if not source.remote and not dest.remote:
        raise UsageError("neither path is remote; write a remote one as :PATH or NAME:PATH")
    return source if source.remote else dest


def _mode(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise UsageError(f"--mode {text!r} is not octal permission bits (such as 0644)")
    return mode


# --- from the target ---------------------------------------------------------------------


def _fetch(target: Target, who: files.Acting, remote: str, local: str, *, recursive: bool) -> None:
    client = target.client
    if local == "-":
        if recursive:
            raise UsageError("-r cannot write a directory to stdout; name a local directory")
        files.download(client, who, remote, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    name = posixpath.basename(remote.rstrip("/")) or "root"
    if recursive:
        entry = files.stat_path(client, who, remote)
        if entry is None:
            raise FileFailed(f"{remote} does not exist on the target", 404)
        if entry.type == "directory":
            into = os.path.join(local, name) if os.path.isdir(local) else local
            _need_parent(into)
            files.get_dir(client, who, remote, into)
            return
    dest = os.path.join(local, name) if os.path.isdir(local) else local
    _need_parent(dest)
    try:
        _download_to(target, who, remote, dest)
    except FileFailed as exc:
        if exc.errno == "EISDIR":
            raise FileFailed(f"{remote} is a directory on the target (use -r)", exc.status) from exc
        raise


def _download_to(target: Target, who: files.Acting, remote: str, dest: str) -> None:
    """Into a temporary file beside ``dest``, renamed over it once whole."""
    directory = os.path.dirname(os.path.abspath(dest))
    fd, temporary = tempfile.mkstemp(prefix=".paddock-cp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            mode = files.download(target.client, who, remote, out)
            out.flush()
            os.fchmod(out.fileno(), 0o644 if mode is None else mode)
        os.replace(temporary, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _need_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileFailed(f"{parent} does not exist here; make it first", 404)


# --- to the target -----------------------------------------------------------------------


def _send(
    target: Target, who: files.Acting, local: str, remote: str, *, recursive: bool, mode: int | None
) -> None:
    client = target.client
    if local == "-":
        if remote.endswith("/"):
            raise UsageError("from stdin, name the remote file (not a directory ending in /)")
        files.write_file(client, who, remote, sys.stdin.buffer, mode)
        return
    if os.path.isdir(local):
        if not recursive:
            raise FileFailed(f"{local} is a directory (use -r)", 0)
        files.put_dir(client, who, local, _into(target, who, local, remote))
        return
    if not os.path.exists(local):
        raise FileFailed(f"{local}: no such file here", 404)
    dest = _into(target, who, local, remote)
    with open(local, "rb") as data:
        files.write_file(client, who, dest, data, files.local_mode(local) if mode is None else mode)


def _into(target: Target, who: files.Acting, local: str, remote: str) -> str:
    """``remote`` itself, or the local name inside it when it is a directory there."""
    name = os.path.basename(os.path.abspath(local))
    if remote.endswith("/"):
        return remote + name
    entry = files.stat_path(target.client, who, remote)
    if entry is not None and entry.type == "directory":
        return posixpath.join(remote, name)
    return remote
