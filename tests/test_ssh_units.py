"""The SSH pieces that need no server: destinations, ~/.ssh/config, known_hosts, error mapping."""

from __future__ import annotations

import re
from pathlib import Path

import httpcore
import httpx
import pytest

from agent_side.errors import (
    HostKeyChanged,
    SshUnreachable,
    TargetUnreachable,
    UsageError,
    map_transport_error,
)
from agent_side.ssh import Destination, SshOptions, known_hosts_files, resolve


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("host", Destination("host")),
        ("ci@host", Destination("host", user="ci")),
        ("ci@host:2222", Destination("host", user="ci", port=2222)),
        ("host:2222", Destination("host", port=2222)),
        ("ssh://ci@host:2222", Destination("host", user="ci", port=2222)),
        ("ci@[::1]:2222", Destination("::1", user="ci", port=2222)),
        ("::1", Destination("::1")),
        ("a@b@host", Destination("host", user="a@b")),
    ],
)
def test_destination_parse_reads_user_host_and_port(text: str, expected: Destination) -> None:
    assert Destination.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("@host", "user before '@' is empty"),
        ("host:0", "1..65535"),
        ("host:ssh", "1..65535"),
        ("host:70000", "1..65535"),
        ("[::1", "[ADDR]:PORT"),
        ("-oProxyCommand=x", "not [USER@]HOST[:PORT]"),
        ("", "not [USER@]HOST[:PORT]"),
        ("host/path", "not [USER@]HOST[:PORT]"),
    ],
)
def test_destination_parse_refuses_what_is_not_a_destination(text: str, says: str) -> None:
    with pytest.raises(UsageError, match=re.escape(says)):
        Destination.parse(text)


def test_resolve_applies_ssh_config_and_what_was_typed_wins(tmp_path: Path) -> None:
    key = tmp_path / "id_build"
    key.write_text("not read here")
    config = tmp_path / "config"
    config.write_text(
        f"Host build\n  HostName 10.0.0.7\n  Port 2200\n  User ci\n  IdentityFile {key}\n"
    )
    options = SshOptions(ssh_config=str(config))
    endpoint = resolve(Destination.parse("build"), options)
    assert (endpoint.hostname, endpoint.port, endpoint.user) == ("10.0.0.7", 2200, "ci")
    assert endpoint.identity_files == (str(key),)
    assert endpoint.known_hosts_name == "[10.0.0.7]:2200"

    typed = resolve(Destination.parse("root@build:22"), options)
    assert (typed.hostname, typed.port, typed.user) == ("10.0.0.7", 22, "root")
    assert typed.known_hosts_name == "10.0.0.7"


def test_resolve_without_config_uses_port_22_and_the_local_user(tmp_path: Path) -> None:
    endpoint = resolve(Destination.parse("host"), SshOptions(ssh_config=str(tmp_path / "none")))
    assert (endpoint.hostname, endpoint.port) == ("host", 22)
    assert endpoint.user
    assert endpoint.identity_files == ()


def test_resolve_refuses_a_missing_identity_file(tmp_path: Path) -> None:
    options = SshOptions(identity_files=(str(tmp_path / "nope"),), ssh_config=None)
    with pytest.raises(UsageError, match="no such key file"):
        resolve(Destination.parse("host"), options)


def test_known_hosts_given_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(UsageError, match="no such file"):
        known_hosts_files(SshOptions(known_hosts=(str(tmp_path / "missing"),)))
    given = tmp_path / "known"
    given.write_text("")
    assert known_hosts_files(SshOptions(known_hosts=(str(given),)))[-1] == str(given)


def test_transport_error_caused_by_an_agent_error_maps_to_that_error() -> None:
    # What the SSH backend raises: httpcore's error, from the precise reason.
    try:
        try:
            raise HostKeyChanged("the host key of h has CHANGED")
        except HostKeyChanged as reason:
            raise httpcore.ConnectError(str(reason)) from reason
    except httpcore.ConnectError as core:
        wrapped = httpx.ConnectError(str(core))
        wrapped.__cause__ = core
    mapped = map_transport_error(wrapped, "http://127.0.0.1:8443/v1/turns")
    assert type(mapped) is HostKeyChanged
    assert "CHANGED" in str(mapped)
    assert issubclass(SshUnreachable, TargetUnreachable)  # so a resuming stream retries it


def test_transport_error_only_raised_while_handling_an_agent_error_is_not_it() -> None:
    try:
        try:
            raise HostKeyChanged("unrelated")
        except HostKeyChanged:
            raise httpx.ConnectError("refused") from None
    except httpx.ConnectError as exc:
        assert type(map_transport_error(exc, "http://127.0.0.1:1/")) is TargetUnreachable
