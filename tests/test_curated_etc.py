"""The fence's /etc: one curated copy, never wider than the host's, fresh after a change."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import Target, output, run

from target_side.fence import etc
from target_side.fence.etc import CuratedEtc, RoleEntry

ROLE = RoleEntry("builder", 1900000001, 1900000001, "/state/roles/builder/home")


@pytest.fixture
def host_etc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fake = tmp_path / "host-etc"
    (fake / "ssl" / "private").mkdir(parents=True)
    (fake / "ssl" / "private" / "server.key").write_text("SECRET\n")
    (fake / "ssl" / "private").chmod(0o700)
    (fake / "ssl" / "openssl.cnf").write_text("cnf\n")
    (fake / "ssl" / "openssl.cnf").chmod(0o644)
    (fake / "hosts").write_text("127.0.0.1 localhost\n")
    (fake / "hosts").chmod(0o644)
    (fake / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (fake / "group").write_text("root:x:0:\n")
    (fake / "root-only.conf").write_text("private\n")
    (fake / "root-only.conf").chmod(0o600)
    monkeypatch.setattr(etc, "HOST_ETC", fake)
    return fake


def _curated(tmp_path: Path) -> CuratedEtc:
    names = ("ssl", "hosts", "passwd", "group", "root-only.conf")
    return CuratedEtc(tmp_path / "state-etc", names, [ROLE])


def test_curated_etc_leaves_out_what_others_cannot_read(host_etc: Path, tmp_path: Path) -> None:
    copy = _curated(tmp_path).current()
    assert (copy / "ssl" / "openssl.cnf").read_text() == "cnf\n"
    assert not (copy / "ssl" / "private").exists()
    assert not (copy / "root-only.conf").exists()


def test_curated_etc_names_the_roles(host_etc: Path, tmp_path: Path) -> None:
    copy = _curated(tmp_path).current()
    assert "builder:x:1900000001:1900000001:" in (copy / "passwd").read_text()
    assert "builder:x:1900000001:" in (copy / "group").read_text()
    assert (copy / "passwd").read_text().startswith("root:x:0:0:")


def test_curated_etc_follows_a_change_with_a_new_version(host_etc: Path, tmp_path: Path) -> None:
    curated = _curated(tmp_path)
    first = curated.current(now=0.0)
    (host_etc / "hosts").write_text("10.0.0.1 build\n")
    os.utime(host_etc / "hosts", ns=(1, 1))
    assert curated.current(now=1.0) == first  # not looked at again this soon
    second = curated.current(now=10.0)
    assert second != first
    assert (second / "hosts").read_text() == "10.0.0.1 build\n"
    assert (first / "hosts").read_text() == "127.0.0.1 localhost\n"  # running turns keep theirs


def test_curated_etc_sees_a_change_deep_in_a_directory(host_etc: Path, tmp_path: Path) -> None:
    (host_etc / "ssl" / "certs").mkdir(mode=0o755)
    (host_etc / "ssl" / "certs" / "ca.pem").write_text("old CA\n")
    (host_etc / "ssl" / "certs" / "ca.pem").chmod(0o644)
    curated = _curated(tmp_path)
    first = curated.current(now=0.0)
    (host_etc / "ssl" / "certs" / "ca.pem").write_text("new CA\n")
    os.utime(host_etc / "ssl" / "certs" / "ca.pem", ns=(1, 1))
    second = curated.current(now=10.0)
    assert second != first
    assert (second / "ssl" / "certs" / "ca.pem").read_text() == "new CA\n"


def test_curated_etc_being_checked_holds_up_no_other_turn(host_etc: Path, tmp_path: Path) -> None:
    curated = _curated(tmp_path)
    first = curated.current(now=0.0)
    (host_etc / "hosts").write_text("10.0.0.2 busy\n")
    os.utime(host_etc / "hosts", ns=(2, 2))
    checking, done = threading.Event(), threading.Event()

    def another_turn_checks() -> None:  # holds the sources' lock as a long look would
        with curated._lock:
            checking.set()
            done.wait(5)

    holder = threading.Thread(target=another_turn_checks)
    holder.start()
    try:
        checking.wait(5)
        started = time.monotonic()
        assert curated.current(now=10.0) == first  # the version there is...
        assert time.monotonic() - started < 1  # ...without waiting for the look to end
    finally:
        done.set()
        holder.join()
    assert curated.current(now=10.0) != first  # the next one past it looks again


def test_fence_user_is_named_and_passwd_replaced_meanwhile_refuses_nothing(
    client: httpx.Client, target: Target
) -> None:
    turn, evs = run(client, ["sh", "-c", "whoami; test -e /etc/shadow || echo no-shadow"])
    assert (turn.exit_code, output(evs)) == (0, "builder\nno-shadow\n")
    # What useradd does: write a new file and rename it over /etc/passwd. Turns bound the
    # host's file by descriptor and were refused as path-changed when it moved; a copy is not.
    passwd = Path("/etc/passwd")
    fresh = passwd.with_name(".passwd.paddock-test")
    fresh.write_bytes(passwd.read_bytes())
    fresh.chmod(0o644)
    os.rename(fresh, passwd)
    again, _ = run(client, ["true"])
    assert again.exit_code == 0, again.refusal
