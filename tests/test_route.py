"""How a target is reached, decided once for in-process runs and the multiplexer (route.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import trustme
from scripted_server import TOKEN

from agent_side import cli, targets_file
from agent_side.connection import resolve_connection
from agent_side.defaults import REMOTE_CA
from agent_side.mux.client import daemon_name, mux_identity
from agent_side.route import HTTPS, SSH, Route, route_of
from agent_side.targets_file import StoredTarget


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["run", *argv, "--", "true"])


def route(environ: dict[str, str], *argv: str) -> Route:
    args = parse(*argv)
    return route_of(args, resolve_connection(args, environ))


def test_route_straight_over_https() -> None:
    environ = {"PADDOCK_TARGET": "https://t:1", "PADDOCK_TOKEN": TOKEN, "PADDOCK_CACERT": "/ca"}
    assert route(environ) == Route(HTTPS, "https://t:1", cacert="/ca")


def test_route_through_ssh_trusts_the_hosts_ca_unless_given_one() -> None:
    environ = {"PADDOCK_TOKEN": TOKEN}
    found = route(environ, "--ssh", "ci@host", "-i", "/k", "--known-hosts", "/kh")
    assert found == Route(
        SSH, "https://127.0.0.1:8443", ssh="ci@host", identity_files=("/k",),
        known_hosts=("/kh",), remote_cacert=REMOTE_CA,
    )  # fmt: skip


def test_route_of_a_stored_ssh_target_never_trades_its_pinned_ca(tmp_path: Path) -> None:
    ca = trustme.CA().cert_pem.bytes().decode()
    environ = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    entry = StoredTarget(
        name="box",
        route="ssh",
        url="https://127.0.0.1:8443",
        ssh="root@box",
        identity_files=("/stored-key",),
        ca_sha256=targets_file.fingerprint(ca),
        default_role="builder",
    )
    targets_file.save(entry, tokens={"builder": TOKEN}, ca_pem=ca, environ=environ)
    stored = route(environ, "-t", "box")
    assert (stored.kind, stored.ssh, stored.remote_cacert) == (SSH, "root@box", None)
    assert stored.cacert == str(tmp_path / "xdg/paddock/targets/box/ca.pem")
    assert stored.identity_files == ("/stored-key",)
    assert route(environ, "-t", "box", "-i", "/given").identity_files == ("/given",)


def test_route_identity_holds_no_token_and_follows_the_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("one")
    base = {"PADDOCK_TARGET": "https://t:1", "PADDOCK_CACERT": str(ca)}
    first = mux_identity(route({**base, "PADDOCK_TOKEN": "token-a"}).absolute(), base)
    other_token = mux_identity(route({**base, "PADDOCK_TOKEN": "token-b"}).absolute(), base)
    assert daemon_name(first) == daemon_name(other_token)  # one daemon serves every token
    assert "token-a" not in repr(first)
    ca.write_text("two")
    replaced = mux_identity(route({**base, "PADDOCK_TOKEN": "token-a"}).absolute(), base)
    assert daemon_name(replaced) != daemon_name(first)


def test_route_absolute_names_local_files_for_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    found = Route(SSH, "http://127.0.0.1:1", cacert="ca.pem", ssh="h", identity_files=("~/k",))
    absolute = found.absolute()
    assert absolute.cacert == str(tmp_path / "ca.pem")
    assert absolute.identity_files == (os.path.expanduser("~/k"),)
