"""Who may have written what the target relies on: root and the server's own uid, nobody else.

The same rule guards executables a turn runs, the descriptors held for a fence,
the target's private files and the fence's PATH: a file or directory that
another uid owns, or that group or others could write (a directory without the
sticky bit), could have been swapped by someone the target does not trust.
"""

from __future__ import annotations

import os
import posixpath
import stat

PROGRAM_PATH = "/usr/bin:/bin:/usr/local/bin"
"""Where the target finds the programs it starts outside a fence (bubblewrap, ``env``), and
the only PATH they get: never the server's own, which its environment could bend."""


def trusted_owners(also: int | None = None) -> frozenset[int]:
    """The uids whose files the target trusts: root and its own, and ``also`` if given.

    ``also`` is a turn's own uid when judging the program that turn runs: only
    the turn itself could have replaced a file of its own, and only for itself.
    """
    return frozenset({0, os.getuid(), *(() if also is None else (also,))})


def file_problem(st: os.stat_result, also: int | None = None) -> str | None:
    """Why a file with status ``st`` cannot be trusted, or None."""
    if st.st_uid not in trusted_owners(also):
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return "is writable by group or others"
    return None


def directory_problem(st: os.stat_result, also: int | None = None) -> str | None:
    """Why a directory with status ``st`` cannot be trusted, or None (sticky ones may be open)."""
    if st.st_uid not in trusted_owners(also):
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return "is writable by group or others without the sticky bit"
    return None


def untrusted_ancestor(directory: str, also: int | None = None) -> tuple[str, str] | None:
    """The first directory from ``directory`` up to ``/`` someone else could replace, and why."""
    while True:
        problem = directory_problem(os.stat(directory), also)
        if problem is not None:
            return directory, problem
        if directory == "/":
            return None
        directory = posixpath.dirname(directory)
