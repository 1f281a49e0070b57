"""The SSH pieces that need no server: destinations, ~/.ssh/config, known_hosts, error mapping."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path

import httpcore
import httpx
import paramiko
import pytest

from agent_side.errors import (
    HostKeyChanged,
    SshUnreachable,
    TargetUnreachable,
    UsageError,
    map_transport_error,
)
from agent_side.known_hosts import KnownHosts
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


def _public_line(tmp_path: Path, name: str) -> tuple[str, str]:
    key = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kind, blob = (tmp_path / f"{name}.pub").read_text().split()[:2]
    return kind, blob


def test_known_hosts_are_read_as_openssh_writes_them(tmp_path: Path) -> None:
    """Blanks of any kind between fields, hashed host names, comments, lines of no key."""
    kind, blob = _public_line(tmp_path, "host")
    other_kind, other_blob = _public_line(tmp_path, "other")
    hashed = tmp_path / "hashed"
    hashed.write_text(f"[127.0.0.1]:2222 {other_kind} {other_blob}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed)], check=True, capture_output=True)
    known = tmp_path / "known_hosts"
    known.write_text(
        "# a comment\n\n"
        f"host.example\t{kind}   {blob} a comment after the key\n"
        "garbage that is no key\n"
        f"@unknown-marker * {kind} {blob}\n" + hashed.read_text()
    )
    client = paramiko.SSHClient()
    KnownHosts.read([str(known)]).trust(client, "[127.0.0.1]:2222")
    keys = client.get_host_keys()
    assert keys.lookup("host.example")[kind].get_base64() == blob
    assert keys.lookup("[127.0.0.1]:2222")[other_kind].get_base64() == other_blob
    assert keys.lookup("elsewhere") is None


@pytest.mark.parametrize(
    ("hosts", "connecting_to", "trusted"),
    [
        ("*.example.org", "build.example.org", True),
        ("*.example.org", "example.org", False),
        ("*.example.org,!bad.example.org", "bad.example.org", False),
        ("*.example.org,!bad.example.org", "BUILD.example.org", True),
        ("[127.0.0.1]:*", "[127.0.0.1]:2222", True),
        ("[127.0.0.1]:*", "127.0.0.1", False),
        ("build-?.example.org", "build-1.example.org", True),
        ("[ab]c", "ac", False),  # brackets are literal, not a character class
    ],
)
def test_known_hosts_patterns_match_as_openssh_matches_them(
    tmp_path: Path, hosts: str, connecting_to: str, trusted: bool
) -> None:
    kind, blob = _public_line(tmp_path, "host")
    known = tmp_path / "known_hosts"
    known.write_text(f"{hosts} {kind} {blob}\n")
    client = paramiko.SSHClient()
    KnownHosts.read([str(known)]).trust(client, connecting_to)
    assert (client.get_host_keys().lookup(connecting_to) is not None) is trusted


def test_a_revoked_key_is_trusted_for_no_host(tmp_path: Path) -> None:
    kind, blob = _public_line(tmp_path, "host")
    known = tmp_path / "known_hosts"
    known.write_text(f"host.example {kind} {blob}\n@revoked\tnowhere.example {kind} {blob}\n")
    hosts = KnownHosts.read([str(known)])
    client = paramiko.SSHClient()
    hosts.trust(client, "host.example")
    assert client.get_host_keys().lookup("host.example") is None
    key = paramiko.Ed25519Key(data=base64.b64decode(blob))
    assert hosts.revoked_by(key) == str(known)
