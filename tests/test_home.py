"""A role's home, seen as it should be without the per-role lock, and mended under it.

Turns starting together each make sure of their role's home; the lock that keeps
two of them from making or moving it at once is taken only when something is to
be done. These tests hold that lock themselves: a home as it should be is seen
so at once; every way of departing from it still waits for the lock and is
mended (a home seen right while it was not would go unmended).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.walk import canonical_path
from target_side.fence import home

ROLE = "builder"
UID, GID = 1900000123, 1900000123
WAIT_S = 5.0


@pytest.fixture
def state_root(tmp_path: Path) -> Path:
    root = Path(canonical_path(tmp_path)) / "state"
    home.open_state_root(root)
    assert home.prepare_home(root, ROLE, UID, GID) is None  # made: nothing was repaired
    return root


@pytest.fixture
def role_lock(state_root: Path) -> Iterator[threading.Lock]:
    lock = home._LOCKS.setdefault((str(state_root), ROLE), threading.Lock())
    lock.acquire()
    try:
        yield lock
    finally:
        if lock.locked():
            lock.release()


def _prepare_on_a_thread(state_root: Path) -> concurrent.futures.Future[str | None]:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(home.prepare_home, state_root, ROLE, UID, GID)
    finally:
        pool.shutdown(wait=False)


def test_a_home_as_it_should_be_is_seen_so_without_the_roles_lock(
    state_root: Path, role_lock: threading.Lock
) -> None:
    assert _prepare_on_a_thread(state_root).result(timeout=WAIT_S) is None


def _chmod(mode: int, *parts: str) -> Callable[[Path], None]:
    return lambda root: os.chmod(root.joinpath(*parts), mode)


def _chown(uid: int, *parts: str) -> Callable[[Path], None]:
    return lambda root: os.chown(root.joinpath(*parts), uid, uid)


DEPARTURES = {
    "the home's mode": (_chmod(0o755, "roles", ROLE, "home"), ("roles", ROLE, "home"), 0o700),
    "the home's owner": (_chown(0, "roles", ROLE, "home"), ("roles", ROLE, "home"), 0o700),
    "the roles directory's mode": (_chmod(0o755, "roles"), ("roles",), home.SEARCHABLE),
    "the role's directory's mode": (_chmod(0o700, "roles", ROLE), ("roles", ROLE), 0o711),
    "the state root's search bits": (_chmod(0o700), (), 0o711),
}


@pytest.mark.parametrize("departure", sorted(DEPARTURES))
def test_every_departure_waits_for_the_lock_and_is_mended(
    state_root: Path, role_lock: threading.Lock, departure: str
) -> None:
    spoil, place, mode = DEPARTURES[departure]
    spoil(state_root)
    pending = _prepare_on_a_thread(state_root)
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(timeout=0.3)  # not seen as right: it waits for the role's lock
    role_lock.release()
    pending.result(timeout=WAIT_S)
    st = state_root.joinpath(*place).stat()
    assert st.st_mode & 0o777 == mode
    if place[-1:] == ("home",):
        assert (st.st_uid, st.st_gid) == (UID, GID)


def test_a_symlink_where_the_home_was_is_not_seen_as_a_home(
    state_root: Path, role_lock: threading.Lock, tmp_path: Path
) -> None:
    where = state_root / "roles" / ROLE / "home"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.chown(elsewhere, UID, GID)
    where.rename(where.with_name("home.kept"))
    where.symlink_to(elsewhere)
    pending = _prepare_on_a_thread(state_root)
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(timeout=0.3)
    role_lock.release()
    assert "was not a directory" in (pending.result(timeout=WAIT_S) or "")
    assert where.is_dir() and not where.is_symlink()
