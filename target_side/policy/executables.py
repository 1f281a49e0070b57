"""Finding a turn's program as the fence will, and whether it may run (docs/design.md).

The name is looked up only on the PATH the fence gives the turn, and only in
directories the fence mounts; what the search lands on must be a regular,
executable file that nobody but root or the service user could have replaced,
in directories nobody else could have swapped. The result is pinned by device
and inode, and the launch binds exactly that inode.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Sequence

from shared.walk import is_within
from shared.wire import Executable
from target_side import trust
from target_side.errors import RefusedError
from target_side.policy import refusals
from target_side.policy.mounts import Mount
from target_side.policy.paths import resolve


def resolve_executable(
    program: str, search_path: str, cwd: str, mounts: Sequence[Mount], uid: int
) -> tuple[str, Executable]:
    """Find ``program`` as the fence will, check it may run, and pin it by device and inode.

    Returns the path to execute inside the fence (as found on PATH, so argv[0]
    keeps its name) and the canonical file it names. ``uid`` is the turn's own:
    files and directories of its own count as trusted for it.
    """
    if "/" in program:
        candidate = program if program.startswith("/") else posixpath.join(cwd, program)
        return candidate, _checked_executable(program, candidate, mounts, uid)
    refused_as_unrunnable = None
    for directory in search_path.split(":"):
        candidate = posixpath.join(directory, program)
        if not _visible(resolve("argv[0]", candidate), mounts) or not os.path.exists(candidate):
            continue
        try:
            return candidate, _checked_executable(program, candidate, mounts, uid)
        except RefusedError as exc:
            # Like execvp: a non-executable hit does not stop the search, but is reported
            # if nothing later on PATH runs.
            if exc.refusal.rule != "not-executable":
                raise
            refused_as_unrunnable = refused_as_unrunnable or exc
    if refused_as_unrunnable is not None:
        raise refused_as_unrunnable
    raise RefusedError(refusals.not_found(program, f"on the fence's PATH ({search_path})"))


def _visible(resolved: str, mounts: Sequence[Mount]) -> bool:
    return any(m.kind != "symlink" and is_within(resolved, m.source) for m in mounts)


def _checked_executable(
    given: str, candidate: str, mounts: Sequence[Mount], uid: int
) -> Executable:
    resolved = resolve("argv[0]", candidate)
    if not _visible(resolved, mounts):
        raise RefusedError(
            refusals.not_found(given, f"inside the fence ({resolved} is not mounted there)")
        )
    try:
        st = os.stat(resolved)
    except OSError:
        raise RefusedError(
            refusals.not_found(given, f"inside the fence ({resolved} does not exist)")
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise RefusedError(refusals.not_executable(given, resolved, "is not a regular file"))
    if not st.st_mode & 0o111:
        raise RefusedError(
            refusals.not_executable(given, resolved, "has no execute permission (chmod +x it)")
        )
    problem = trust.file_problem(st, uid)
    if problem is not None:
        raise RefusedError(refusals.untrusted_executable(given, resolved, f"{resolved} {problem}"))
    _check_directories(given, resolved, posixpath.dirname(resolved), uid)
    # The directory the name was found in counts too: a symlink there could be repointed.
    _check_directories(given, resolved, resolve("argv[0]", posixpath.dirname(candidate)), uid)
    return Executable(path=resolved, dev=st.st_dev, ino=st.st_ino)


def _check_directories(given: str, resolved: str, directory: str, uid: int) -> None:
    """No directory from ``directory`` up to ``/`` may be replaceable by someone else."""
    found = trust.untrusted_ancestor(directory, uid)
    if found is not None:
        where, why = found
        raise RefusedError(refusals.untrusted_executable(given, resolved, f"{where} {why}"))
