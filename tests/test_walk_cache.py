"""Remembered canonical paths are believed only while the directories that decided them are
unchanged: whatever is swapped in between two turns, the cache answers as the walk does."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import local_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.walk import WalkError, canonical_path, is_within, mount_conflict
from shared.wire import TurnRequest
from target_side.errors import RefusedError
from target_side.policy import walk_cache
from target_side.policy.forbidden import ForbiddenEntry, ForbiddenList
from target_side.policy.plan import plan_turn
from target_side.policy.walk_cache import WalkCache

RACY_S = 0.01
SETTLE_S = 0.025
"""Tests shorten the racy window (a kernel clock tick is at most 10 ms) and wait past it."""


@pytest.fixture(autouse=True)
def short_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walk_cache, "RACY_NS", int(RACY_S * 1e9))


def _settle() -> None:
    time.sleep(SETTLE_S)


def test_a_path_is_remembered_and_then_answered_without_a_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    target = str(tmp_path / "a" / "b" / "c")
    cache = WalkCache()
    walks: list[str] = []
    real = walk_cache.canonical_path_and_dirs
    monkeypatch.setattr(walk_cache, "canonical_path_and_dirs", lambda p: walks.append(p) or real(p))
    # Every directory up to / is consulted, /tmp among them, which other processes change at
    # any time: a change there rightly keeps the answer from being believed, so a few tries.
    for _ in range(5):
        _settle()
        assert cache.batch()(target) == canonical_path(target)
        walks.clear()
        assert cache.batch()(target) == canonical_path(target)
        if not walks:
            break
    assert walks == []


def test_a_symlink_swapped_in_after_it_was_remembered_is_followed(tmp_path: Path) -> None:
    home, secrets = tmp_path / "home", tmp_path / "secrets"
    (home / ".aws").mkdir(parents=True)
    secrets.mkdir()
    cache = WalkCache()
    _settle()
    assert cache.batch()(str(home / ".aws")) == str(home / ".aws")
    _settle()
    (home / ".aws").rmdir()
    (home / ".aws").symlink_to(secrets)
    assert cache.batch()(str(home / ".aws")) == str(secrets)


def test_nothing_is_remembered_while_a_directory_that_decided_it_is_fresh(tmp_path: Path) -> None:
    # A change within the same clock tick keeps mtime and ctime: too fresh to be trusted.
    (tmp_path / "fresh").mkdir()
    cache = WalkCache()
    cache.batch()(str(tmp_path / "fresh" / "x"))
    assert not cache._known
    _settle()
    cache.batch()(str(tmp_path / "fresh" / "x"))
    assert str(tmp_path / "fresh" / "x") in cache._known


NAMES = ("a", "b", "c")


@st.composite
def _changes(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """Steps: make a directory, a symlink (to a name, relative or absolute), or remove one."""
    where = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)
    step = st.tuples(st.sampled_from(("dir", "link", "abslink", "remove")), where, where)
    return draw(st.lists(step, min_size=1, max_size=8))


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=_changes())
def test_the_cache_always_answers_as_the_walk_does(
    tmp_path_factory: pytest.TempPathFactory, changes: list[tuple[str, str, str]]
) -> None:
    root = Path(canonical_path(tmp_path_factory.mktemp("tree")))
    paths = [str(root / a / b) for a in NAMES for b in NAMES] + [str(root / a) for a in NAMES]
    cache = WalkCache()
    for kind, where, target in changes:
        _apply(root, kind, where, target)
        _settle()
        walk = cache.batch()
        for path in paths:
            assert _outcome(walk, path) == _outcome(canonical_path, path), (kind, where, path)


def _outcome(walk: Callable[[str], str], path: str) -> str:
    """The answer, or the kind of error (a loop of links is refused by both alike)."""
    try:
        return walk(path)
    except WalkError as exc:
        return type(exc).__name__


def _apply(root: Path, kind: str, where: str, target: str) -> None:
    place = root / where
    try:
        if kind == "remove":
            if place.is_symlink() or place.is_file():
                place.unlink()
            elif place.is_dir() and not any(place.iterdir()):
                place.rmdir()
        elif not os.path.lexists(place) and place.parent.is_dir():
            if kind == "dir":
                place.mkdir()
            elif kind == "link":
                place.symlink_to(os.path.relpath(root / target, place.parent))
            else:
                place.symlink_to(root / target)
    except OSError:
        pass  # a step that does not apply here (a parent is a link to nowhere, say)


def test_a_credential_dir_replaced_by_a_link_between_two_turns_stays_forbidden(
    tmp_path: Path,
) -> None:
    """Turn 1 remembers ~/.aws where it was; it then becomes a link to data/creds: turn 2
    asking for data must meet the forbidden entry at its new place."""
    root = Path(canonical_path(tmp_path))
    settings = local_settings(root)
    home = root / "service-home"
    (home / ".aws").mkdir(parents=True)
    (root / "data" / "creds").mkdir(parents=True)
    environ = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    request = TurnRequest(role="builder", argv=["true"], fs={"read": [str(root / "data")]})
    _settle()
    plan_turn(request, settings, "t-" + "1" * 32, environ=environ)
    _settle()
    (home / ".aws").rmdir()
    (home / ".aws").symlink_to(root / "data" / "creds")
    with pytest.raises(RefusedError) as refused:
        plan_turn(request, settings, "t-" + "2" * 32, environ=environ)
    assert refused.value.refusal.rule == "forbidden-path"


_PARTS = st.sampled_from(["a", "b", "ab", "a.b"])
_CANONICAL = st.lists(_PARTS, max_size=4).map(lambda parts: "/" + "/".join(parts))


@given(
    entries=st.lists(_CANONICAL, max_size=6),
    own=st.lists(_CANONICAL, max_size=2),
    mount=_CANONICAL,
)
def test_the_forbidden_list_answers_as_each_entry_asked_in_turn(
    entries: list[str], own: list[str], mount: str
) -> None:
    """``collision`` first asks all entries at once whether any meets the mount; it must
    find every collision, and the same first one, that asking each entry would."""
    forbidden = ForbiddenList([ForbiddenEntry(p, f"entry {p}") for p in entries], tuple(own))
    expected = None
    if not any(is_within(mount, mine) for mine in own):
        for entry in forbidden.entries:
            conflict = mount_conflict(mount, entry.path)
            if conflict is not None:
                expected = (entry, conflict)
                break
    found = forbidden.collision(mount)
    assert (None if found is None else (found.entry, found.conflict)) == expected
