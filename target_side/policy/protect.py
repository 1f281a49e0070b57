"""What a turn must not change inside its writable mounts: files that run later, outside a fence.

A git hook or ``core.fsmonitor`` planted in a repository runs the next time
anyone runs git there; a shell reads its rc files at the next login; editors
and agents run the tasks and hooks their settings name. So every writable
mount is searched, at any depth (up to ``[fence] scan_limit`` directories), and:

- every git directory found (``.git``, a bare repository, and the worktree and
  submodule git directories inside one) is mounted onto itself, which makes it
  a mount point that cannot be renamed or replaced (``mv .git .git.old`` fails),
  and its config, hooks, ``commondir`` and ``config.worktree`` are mounted
  read-only over themselves; a ``.git`` file (a pointer to a git directory) is
  read-only too;
- every entry named in ``PROTECTED_NAMES`` (or ``[fence] protect``) is mounted
  read-only over itself.

A protected name that does not exist yet cannot be mounted over without
creating it on the host, and a symlink cannot be mounted over at all. Those
that matter without any other file changing (a git directory's members, and
the protected names at the top of each writable mount, where a home directory
keeps its rc files) are listed for the *audit*: after the turn, with every
process of it gone, whatever appeared or changed there is moved aside before
anyone is told the turn ended. Repositories and files a turn creates are owned
by its role's own uid, which git and shells run by anyone else do not trust.
"""

from __future__ import annotations

import functools
import os
import posixpath
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from target_side.errors import RefusedError
from target_side.policy import refusals
from target_side.policy.reach import Door, Reach

PROTECTED_NAMES = (
    # read by shells at login or start, as whoever owns the home they sit in
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
    ".zlogout",
    ".cshrc",
    ".tcshrc",
    ".login",
    # tools that run what they name
    ".envrc",
    ".gitconfig",
    ".gitmodules",
    ".ripgreprc",
    ".npmrc",
    ".mcp.json",
    # editors' and agents' tasks, settings and hooks
    ".vscode",
    ".idea",
    ".devcontainer",
    ".claude",
    ".cursor",
)
GIT_MEMBERS = ("config", "hooks", "commondir", "config.worktree")
"""Inside a git directory: what git reads to decide what to run (or where to read it from)."""
GIT_NESTED = ("worktrees", "modules")
"""Inside a git directory, where more git directories live (linked worktrees, submodules)."""


@dataclass
class Protection:
    """What one scan found: git directories, read-only entries, and paths to audit."""

    git_dirs: list[str] = field(default_factory=list)
    read_only: list[str] = field(default_factory=list)
    audit: dict[str, str | None] = field(default_factory=dict)
    """Paths to check after the turn: each must still be absent (None) or a symlink to the
    given target, as it was when planned."""

    def keep(self, kept: Callable[[str], bool]) -> None:
        """Mount over only the paths ``kept`` says yes to."""
        self.git_dirs = [p for p in self.git_dirs if kept(p)]
        self.read_only = [p for p in self.read_only if kept(p)]


def scan(
    roots: Iterable[tuple[str, str]], names: tuple[str, ...], limit: int, reach: Reach
) -> Protection:
    """Search each writable mount ``(subject, canonical root)`` for what must stay protected.

    Symlinks are never followed: a link inside a mount is not part of it. What
    lies below a directory the turn can never enter (``reach``) is left alone:
    the turn cannot change it, nor could bubblewrap, running as it, mount over
    it. What lies below one it owns but may not search is refused: the turn
    could open it and change what bubblewrap could not mount over.
    """
    found = Protection()
    seen: set[str] = set()
    wanted = frozenset(names)
    for subject, root in roots:
        for name in names:
            _expect_unchanged(posixpath.join(root, name), found)
        doors = _Doors(reach, root)
        for directory, entries in _walk(subject, root, limit, doors):
            _classify(directory, entries, wanted, names, found, seen, doors)
        found.keep(functools.partial(doors.within_reach, subject))
    return found


def scan_entries(root: str, names: tuple[str, ...]) -> Protection:
    """Protect the direct entries of ``root`` only: for a mount in which the target itself
    writes exactly one name it has checked (a file operation), not the turn's every reach."""
    found = Protection()
    for name in names:
        _expect_unchanged(posixpath.join(root, name), found)
    try:
        with os.scandir(root) as listing:
            entries = list(listing)
    except OSError as exc:
        raise RefusedError(
            refusals.bad_mount("fence.protect", root, root, f"cannot be searched: {exc.strerror}")
        ) from exc
    _classify(root, entries, frozenset(names), names, found, set(), None)
    return found


def git_dir_above(path: str) -> str | None:
    """The nearest git directory that is canonical ``path`` or holds it, if any.

    A directory named ``.git``, or one git would take for a bare repository.
    Only looks, never follows a symlink.
    """
    directory = path
    while True:
        if posixpath.basename(directory) == ".git" and _is_dir(directory):
            return directory
        if _looks_bare_at(directory):
            return directory
        if directory == "/":
            return None
        directory = posixpath.dirname(directory)


def protected_member_holding(path: str) -> str | None:
    """The git member (hooks, config, ...) that canonical ``path`` is or lies inside, if any.

    A writable mount there would make that member writable: the scan below a
    mount never looks up, so this does.
    """
    git_dir = git_dir_above(path)
    while git_dir is not None:
        for member in GIT_MEMBERS:
            inner = posixpath.join(git_dir, member)
            if path == inner or path.startswith(inner + "/"):
                return inner
        parent = posixpath.dirname(git_dir)
        git_dir = None if parent == git_dir else git_dir_above(parent)
    return None


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _looks_bare_at(directory: str) -> bool:
    """``_looks_bare`` by path: HEAD a file, objects and refs directories (none a symlink)."""
    try:
        head = os.lstat(posixpath.join(directory, "HEAD")).st_mode
        objects = os.lstat(posixpath.join(directory, "objects")).st_mode
        refs = os.lstat(posixpath.join(directory, "refs")).st_mode
    except OSError:
        return False
    return stat.S_ISREG(head) and stat.S_ISDIR(objects) and stat.S_ISDIR(refs)


def _expect_unchanged(path: str, found: Protection) -> None:
    """Audit ``path`` if it is absent or a symlink: those cannot be mounted over."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        found.audit[path] = None
        return
    except OSError as exc:
        raise RefusedError(
            refusals.bad_mount("fence.protect", path, path, f"cannot be examined: {exc.strerror}")
        ) from exc
    if stat.S_ISLNK(st.st_mode):
        found.audit[path] = os.readlink(path)


def _walk(
    subject: str, root: str, limit: int, doors: _Doors
) -> Iterator[tuple[str, list[os.DirEntry[str]]]]:
    """Every directory below ``root`` (itself included) with its entries, depth first."""
    pending = [root]
    visited = 0
    while pending:
        directory = pending.pop()
        visited += 1
        if visited > limit:
            raise RefusedError(refusals.too_many_directories(subject, root, root, limit))
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError as exc:
            if doors.closed_at_or_above(directory):
                continue  # closed to the turn (and to a server running as it): nothing to do
            raise RefusedError(
                refusals.bad_mount(
                    "fence.protect", directory, directory, f"cannot be searched: {exc.strerror}"
                )
            ) from exc
        yield directory, entries
        pending.extend(
            e.path for e in entries if e.is_dir(follow_symlinks=False) and e.name != ".git"
        )


def _classify(
    directory: str,
    entries: list[os.DirEntry[str]],
    wanted: frozenset[str],
    names: tuple[str, ...],
    found: Protection,
    seen: set[str],
    doors: _Doors | None,
) -> None:
    by_name = {e.name: e for e in entries}
    git = by_name.get(".git")
    if git is not None:
        if git.is_dir(follow_symlinks=False):
            # Its members are looked at unless the turn can never reach them (``scan``).
            closed = doors is not None and doors.of(git.path) is Door.CLOSED
            _git_dir(git.path, found, seen, reachable=not closed)
        elif git.is_file(follow_symlinks=False):
            found.read_only.append(git.path)
    elif _looks_bare(by_name):
        _git_dir(directory, found, seen)  # kept or not as the way to it allows (``scan``)
    for name in names:
        if "/" in name:
            path = posixpath.join(directory, name)
            if os.path.lexists(path) and not os.path.islink(path):
                found.read_only.append(path)
    for entry in entries:
        if entry.name in wanted and not entry.is_symlink():
            found.read_only.append(entry.path)


class _Doors:
    """How the turn finds the directories of one writable mount, each looked at once, and
    only where something was found to protect: a directory scanned costs no more."""

    def __init__(self, reach: Reach, root: str) -> None:
        self.reach = reach
        self.root = root
        self._known: dict[str, tuple[Door, int]] = {}

    def of(self, directory: str) -> Door:
        return self._look(directory)[0]

    def closed_at_or_above(self, directory: str) -> bool:
        return any(self.of(d) is Door.CLOSED for d in self._way_down_to(directory))

    def within_reach(self, subject: str, path: str) -> bool:
        """Whether ``path`` is for bubblewrap to mount over: False if the turn can never
        reach it; a refusal if the turn could open its way there, but bubblewrap could not."""
        way = self._way_down_to(posixpath.dirname(path))
        if any(self.of(d) is Door.CLOSED for d in way):
            return False
        for directory in way:
            door, mode = self._look(directory)
            if door is Door.SHUT:
                raise RefusedError(
                    refusals.shut_to_role(subject, directory, path, self.reach.uid, mode)
                )
        return True

    def _way_down_to(self, directory: str) -> list[str]:
        """The mount's root, then each directory below it down to ``directory``."""
        way = [directory]
        while directory != self.root and directory != "/":
            directory = posixpath.dirname(directory)
            way.append(directory)
        return way[::-1]

    def _look(self, directory: str) -> tuple[Door, int]:
        known = self._known.get(directory)
        if known is None:
            try:
                st = os.lstat(directory)
            except OSError:
                known = Door.OPEN, 0  # gone: looked at as if it were there
            else:
                known = self.reach.door(directory, st), stat.S_IMODE(st.st_mode)
            self._known[directory] = known
        return known


def _looks_bare(by_name: dict[str, os.DirEntry[str]]) -> bool:
    """A bare repository: git treats a directory holding these as a git directory."""
    head, objects, refs = by_name.get("HEAD"), by_name.get("objects"), by_name.get("refs")
    return (
        head is not None
        and head.is_file(follow_symlinks=False)
        and objects is not None
        and objects.is_dir(follow_symlinks=False)
        and refs is not None
        and refs.is_dir(follow_symlinks=False)
    )


def _git_dir(path: str, found: Protection, seen: set[str], reachable: bool = True) -> None:
    """Protect the git directory ``path``: onto itself, its members read-only. One the turn
    can never enter (not ``reachable``) is still mounted onto itself, since the turn could
    rename it away from its parent; what is inside, the turn cannot reach."""
    if path in seen:
        return
    seen.add(path)
    found.git_dirs.append(path)
    if not reachable:
        return
    for member in GIT_MEMBERS:
        inner = posixpath.join(path, member)
        if os.path.lexists(inner) and not os.path.islink(inner):
            found.read_only.append(inner)
        else:
            _expect_unchanged(inner, found)
    for nested in GIT_NESTED:
        _nested_git_dirs(posixpath.join(path, nested), found, seen)


def _nested_git_dirs(container: str, found: Protection, seen: set[str]) -> None:
    try:
        with os.scandir(container) as listing:
            children = [e.path for e in listing if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        # Made unreadable to the server by the role itself: never a reason to protect less.
        raise RefusedError(
            refusals.bad_mount(
                "fence.protect", container, container, f"cannot be searched: {exc.strerror}"
            )
        ) from exc
    for child in children:
        _git_dir(child, found, seen)
