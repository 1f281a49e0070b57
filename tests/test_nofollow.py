"""Opening a path without following a symlink: the kernel's one call, and the walk behind it.

Both ways are held to an oracle written from the rule alone (every component
looked at with ``lstat``): a path opens only if no component is a symlink,
except that the last may be one, which is then refused by name.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from target_side.errors import PathChanged
from target_side.fence import nofollow, raw_syscalls

NAMES = ("a", "b", "c")


def oracle(path: str) -> tuple[int, int] | None:
    """The (device, inode) the rule allows ``path`` to open, or None where it must refuse."""
    names = [n for n in path.split("/") if n]
    current = ""
    for i, name in enumerate(names):
        current += "/" + name
        try:
            mode = os.lstat(current).st_mode
        except OSError:
            return None
        if stat.S_ISLNK(mode) or (i < len(names) - 1 and not stat.S_ISDIR(mode)):
            return None
    found = os.lstat(current or "/")
    return found.st_dev, found.st_ino


def outcome(opener: object, path: str) -> tuple[int, int] | None:
    try:
        fd = opener(path)  # type: ignore[operator]
    except PathChanged:
        return None
    if fd is None:  # the kernel's call alone: it did not open the path
        return None
    try:
        found = os.fstat(fd)
    finally:
        os.close(fd)
    return found.st_dev, found.st_ino


def walked(path: str) -> int:
    return nofollow._walked([n for n in path.split("/") if n])


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel's call must answer: a fallback to the walk would hide what it did."""
    # Linux 5.6+ on a known machine: every target paddock supports (Debian 12 ships 6.1).
    assert nofollow._kernel_resolves, "openat2 is unavailable here; the fast path is untested"
    monkeypatch.setattr(nofollow, "_walked", _no_walk)
    yield


def _no_walk(names: list[str]) -> int:
    raise PathChanged("(refused by the test: the kernel's call did not open it)")


@st.composite
def trees(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """Entries (relative path, kind, link target) of a small tree: dirs, files, symlinks."""
    entries = []
    for first in NAMES:
        kind = draw(st.sampled_from(("dir", "file", "link")))
        entries.append((first, kind, draw(st.sampled_from(("a", "b/c", "/", "..", "c/a", "x")))))
        if kind == "dir":
            for second in NAMES:
                kind2 = draw(st.sampled_from(("dir", "file", "link", "none")))
                target = draw(st.sampled_from(("..", "../a", "/", "a", "../b/c")))
                entries.append((f"{first}/{second}", kind2, target))
    return entries


def build(root: Path, entries: list[tuple[str, str, str]]) -> None:
    for relative, kind, target in entries:
        place = root / relative
        if kind == "dir":
            place.mkdir()
        elif kind == "file":
            place.write_bytes(b"")
        elif kind == "link":
            place.symlink_to(target if not target.startswith("/") else str(root) + target)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=trees(),
    depth=st.integers(1, 3),
    picks=st.lists(st.sampled_from(NAMES), min_size=3, max_size=3),
)
def test_both_ways_open_exactly_what_the_rule_allows(
    tmp_path_factory: pytest.TempPathFactory,
    entries: list[tuple[str, str, str]],
    depth: int,
    picks: list[str],
) -> None:
    root = tmp_path_factory.mktemp("tree")
    build(root, entries)
    path = "/".join([str(root), *picks[:depth]])
    expected = oracle(path)
    assert outcome(nofollow.open_no_follow, path) == expected
    assert outcome(walked, path) == expected
    if nofollow._kernel_resolves and expected is not None:
        assert outcome(nofollow._resolved_by_kernel, path) == expected


def test_the_kernel_refuses_a_symlink_inside_the_path(tmp_path: Path, kernel_only: None) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "file").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert outcome(nofollow.open_no_follow, f"{tmp_path}/real/file") is not None
    assert outcome(nofollow.open_no_follow, f"{tmp_path}/link/file") is None


def test_a_symlink_inside_the_path_is_named(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "file").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PathChanged, match=f"^{tmp_path}/link is now a symlink$"):
        nofollow.open_no_follow(f"{tmp_path}/link/file")
    with pytest.raises(PathChanged, match=f"^{tmp_path}/link is now a symlink$"):
        nofollow.open_no_follow(f"{tmp_path}/link")
    (tmp_path / "real" / "plain").write_bytes(b"")
    with pytest.raises(PathChanged, match="plain is no longer a directory"):
        nofollow.open_no_follow(f"{tmp_path}/real/plain/x")
    with pytest.raises(PathChanged, match="is gone"):
        nofollow.open_no_follow(f"{tmp_path}/real/missing")


@pytest.mark.parametrize("path", ["relative/path", "/tmp/../etc", "/tmp/./x"])
def test_only_canonical_absolute_paths(path: str) -> None:
    with pytest.raises(PathChanged, match=r"not absolute|not canonical"):
        nofollow.open_no_follow(path)


def test_a_path_holding_a_nul_byte_is_refused_never_opened_cut_short(tmp_path: Path) -> None:
    # The kernel stops reading at the NUL: it would open the directory before it instead.
    (tmp_path / "x").mkdir()
    with pytest.raises(PathChanged, match="NUL byte"):
        nofollow.open_no_follow(f"{tmp_path}/\0/x")


def test_a_kernel_without_openat2_gets_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    monkeypatch.setattr(nofollow, "_kernel_resolves", True)

    def absent(name: str, *args: object) -> int:
        raise OSError(errno.ENOSYS, f"{name}: Function not implemented")

    monkeypatch.setattr(raw_syscalls, "call", absent)
    assert outcome(nofollow.open_no_follow, f"{tmp_path}/file") == oracle(f"{tmp_path}/file")
    assert not nofollow._kernel_resolves  # asked once, then no more
    with pytest.raises(PathChanged, match="is now a symlink"):
        nofollow.open_no_follow(f"{tmp_path}/link")
