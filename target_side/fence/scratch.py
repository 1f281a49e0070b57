"""A turn's scratch: built whole in a staging directory and renamed into place, or not at all.

Scratch lives at ``STATE/scratch/TURN`` (outside every role's state dir, so a
sibling turn of the same role never sees it) and holds ``tmp`` (the fence's
``/tmp``), ``cache`` (its ``$HOME/.cache``) and a manifest naming the turn.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from target_side.config import Settings
from target_side.errors import ScratchError
from target_side.policy.forbidden import role_state_dir, scratch_dir
from target_side.safe_files import fsync_dir

MANIFEST = "manifest.json"
STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class Scratch:
    """A built scratch directory."""

    root: Path

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def cache(self) -> Path:
        return self.root / "cache"


FailureHook = Callable[[str], None]
"""Called with each step's name before it runs; tests raise from it to inject a failure."""


def no_failure(step: str) -> None:
    return None


def build_scratch(
    settings: Settings, role: str, turn_id: str, inject: FailureHook = no_failure
) -> Scratch:
    """Stage, fill, fsync and rename a turn's scratch; on any failure remove every trace."""
    final = scratch_dir(settings, turn_id)
    staging = final.parent / f"{STAGING_PREFIX}{turn_id}"
    try:
        inject("prepare")
        _private_dir(final.parent)
        _ensure_role_home(settings, role)
        staging.mkdir(mode=0o700)
        for sub in ("tmp", "cache"):
            (staging / sub).mkdir(mode=0o700)
        inject("write-manifest")
        _write_manifest(staging / MANIFEST, {"turn_id": turn_id, "role": role})
        inject("rename")
        os.rename(staging, final)
        fsync_dir(final.parent)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ScratchError(f"could not build scratch for {turn_id}: {exc}") from exc
    return Scratch(final)


def remove_scratch(scratch: Scratch) -> None:
    """Remove a turn's scratch, including directories the turn made read-only."""
    remove_tree(scratch.root)


def remove_tree(root: Path) -> None:
    """``rm -rf`` that first gives the owner back write access to every directory below."""
    if not root.exists():
        return
    _open_up(root)
    shutil.rmtree(root)


def _open_up(directory: Path) -> None:
    # chmod before listing: a directory the turn made unreadable cannot be listed first.
    os.chmod(directory, 0o700)
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _open_up(Path(entry.path))


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _ensure_role_home(settings: Settings, role: str) -> None:
    home = role_state_dir(settings, role) / "home"
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    # The mount point for the per-turn cache must exist before bubblewrap binds over it.
    (home / ".cache").mkdir(mode=0o700, exist_ok=True)


def _write_manifest(path: Path, content: dict[str, str]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(content).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
