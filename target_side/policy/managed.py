"""A role home's managed entries: typed, exact, and layered read-only over the writable home.

An operator hands a role three kinds of things to find in its home:

- a *credential*: one regular file, named by its exact path, which appears as
  ``$HOME/<its name>``;
- a *plugin* or a *skill*: one directory exactly one component below a root the
  operator configured (``[fence] plugin_roots`` / ``skill_roots``), which appears
  as ``$HOME/<plugin_dir or skill_dir>/<its name>``.

The classification is strict on purpose. An entry's parent is compared with
its root *literally*, as the text before its last ``/`` (``posixpath.dirname``
would already drop the second slash of ``ROOT//x``): ``ROOT//x``, ``ROOT/./x``
and ``ROOT/y/../x`` are refused, not normalised into acceptance, since
normalising first is exactly how an alias reaches something the root was
meant to bound. No entry, and nothing above it,
may be a symlink: the thing named is the thing mounted. Two entries that would
land on the same name are refused rather than one silently hiding the other.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Kind = Literal["credentials", "plugins", "skills"]
KINDS: tuple[Kind, ...] = ("credentials", "plugins", "skills")


@dataclass(frozen=True)
class Managed:
    """One managed entry of a role's home: where it comes from and where it appears."""

    kind: Kind
    index: int
    source: str
    place: str
    """Relative to the home."""

    @property
    def subject(self) -> str:
        return f"roles.home.{self.kind}[{self.index}]"


def shape_problems(
    kind: Kind, entries: Sequence[str], roots: Sequence[str], place_dir: str
) -> Iterator[str]:
    """What is wrong with ``entries`` of ``kind`` as written, before any file is looked at."""
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        name = posixpath.basename(entry)
        where = f"{kind}[{i}] {entry!r}"
        if not entry.startswith("/"):
            yield f"{where} is relative; give its absolute path"
            continue
        if name in ("", ".", ".."):
            yield f"{where} names no file or directory of its own"
            continue
        if kind == "credentials":
            if posixpath.normpath(entry) != entry:
                yield f"{where} is not written as its exact path (no '.', '..' or '//')"
        elif entry.rpartition("/")[0] not in roots:
            listed = ", ".join(roots) or "none is configured"
            yield (
                f"{where} must sit directly in one of the {kind} roots ({listed}), written "
                "exactly: its parent is compared as written, never normalised"
            )
        place = posixpath.join(place_dir, name)
        if place in seen:
            yield f"{where} lands on {place} like {kind}[{seen[place]}]; give each its own name"
        seen[place] = i


class Places(Protocol):
    def managed_place(self, kind: str) -> str: ...


def entries(home: object, places: Places) -> list[Managed]:
    """The managed entries of one role's ``home`` config, in the order they are listed."""
    return [
        Managed(
            kind,
            i,
            source,
            posixpath.join(places.managed_place(kind), posixpath.basename(source)),
        )
        for kind in KINDS
        for i, source in enumerate(getattr(home, kind))
    ]


def file_problem(entry: Managed) -> str | None:
    """What the filesystem says is wrong with ``entry``: gone, a symlink, the wrong type."""
    try:
        st = os.lstat(entry.source)
    except FileNotFoundError:
        return f"{entry.source} does not exist"
    except OSError as exc:
        return f"{entry.source} cannot be examined: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{entry.source} is a symlink; name the file or directory itself"
    if os.path.realpath(entry.source) != entry.source:
        return f"{entry.source} lies below a symlink; name it by its real path"
    if entry.kind == "credentials" and not stat.S_ISREG(st.st_mode):
        return f"{entry.source} is not a regular file"
    if entry.kind != "credentials" and not stat.S_ISDIR(st.st_mode):
        return f"{entry.source} is not a directory"
    return None
