"""Paths as the planner takes them: walked like the kernel walks them, or refused by name."""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from shared.walk import WalkError, canonical_path
from target_side.errors import RefusedError
from target_side.policy import refusals


def resolve(subject: str, path: str, walk: Callable[[str], str] = canonical_path) -> str:
    """``canonical_path`` (or ``walk``: a ``WalkCache`` batch), with a path the walk cannot
    finish refused against ``subject``."""
    try:
        return walk(path)
    except WalkError as exc:
        raise RefusedError(
            refusals.bad_mount(subject, path, path, f"cannot be resolved: {exc}")
        ) from exc


def is_normal(path: str) -> bool:
    """Whether ``path`` is absolute and already normal: no ``.``, ``..``, ``//`` or trailing ``/``.

    A destination inside the fence is created by bubblewrap below its new root,
    where ``..`` would climb out; normalising it first would hide what was asked.
    """
    return path.startswith("/") and (path == "/" or posixpath.normpath(path) == path)
