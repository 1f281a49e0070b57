"""Where each setting comes from: flag, PADDOCK_* variable, stored target (connection.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from scripted_server import TOKEN

from agent_side import cli
from agent_side.connection import Connection, read_token, resolve_connection, ssh_passphrase
from agent_side.errors import UsageError


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["run", *argv])


def test_env_supplies_target_token_cacert_and_role() -> None:
    environ = {
        "PADDOCK_TARGET": "https://t.example:8443",
        "PADDOCK_TOKEN": f"  {TOKEN}\n",
        "PADDOCK_CACERT": "/etc/ca.pem",
        "PADDOCK_ROLE": "builder",
    }
    connection = resolve_connection(parse("--", "true"), environ)
    assert connection == Connection("https://t.example:8443", TOKEN, "/etc/ca.pem", role="builder")


def test_flags_beat_env(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    environ = {
        "PADDOCK_TARGET": "https://env:1",
        "PADDOCK_TOKEN": "from-env",
        "PADDOCK_CACERT": "/env/ca.pem",
        "PADDOCK_ROLE": "env-role",
    }
    args = parse(
        "--target", "https://flag:2", "--token-file", str(token_file),
        "--cacert", "/flag/ca.pem", "--role", "flag-role", "--", "true",
    )  # fmt: skip
    connection = resolve_connection(args, environ)
    assert connection == Connection("https://flag:2", "from-file", "/flag/ca.pem", role="flag-role")


def test_no_role_named_is_left_to_the_target() -> None:
    environ = {"PADDOCK_TARGET": "https://t:1", "PADDOCK_TOKEN": TOKEN}
    assert resolve_connection(parse("--", "true"), environ).role is None


def test_connection_repr_hides_the_token() -> None:
    assert TOKEN not in repr(Connection("https://t:1", TOKEN, None))


def test_missing_target_and_token_are_named() -> None:
    with pytest.raises(UsageError, match="--target URL or set PADDOCK_TARGET"):
        resolve_connection(parse("--", "true"), {"PADDOCK_TOKEN": TOKEN})
    with pytest.raises(UsageError, match="--token-file F or set PADDOCK_TOKEN"):
        resolve_connection(parse("--", "true"), {"PADDOCK_TARGET": "https://t:1"})


def test_ssh_target_defaults_to_the_deployed_https_listener_not_paddock_target() -> None:
    args = parse("--ssh", "ci@host", "--", "true")
    environ = {"PADDOCK_TARGET": "https://from-here:8443", "PADDOCK_TOKEN": "tok"}
    assert resolve_connection(args, environ).url == "https://127.0.0.1:8443"


def test_passphrase_comes_from_the_environment_when_set() -> None:
    source = ssh_passphrase({"PADDOCK_SSH_PASSPHRASE": "secret words"})
    assert source("/any/key") == "secret words"


# -- token files ----------------------------------------------------------------------------


def test_token_file_problems_are_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    empty.chmod(0o600)
    with pytest.raises(UsageError, match="is empty"):
        read_token(str(empty))
    with pytest.raises(UsageError, match="cannot read token file"):
        read_token(str(tmp_path / "missing"))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_token_file_open_to_others_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(mode)
    with pytest.raises(UsageError) as caught:
        read_token(str(token_file))
    assert f"open to group or others (mode {mode:o}); run: chmod 600 {token_file}" in str(
        caught.value
    )
    assert TOKEN not in str(caught.value)


def test_private_token_file_is_read(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    token_file.chmod(0o600)
    assert read_token(str(token_file)) == TOKEN


# -- options that do not go together ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "-i", "/k", "--target", "https://t:1", "--", "true"], "-i only apply with --ssh"),
        (["run", "--known-hosts", "/k", "--target", "https://t:1", "--", "true"], "with --ssh"),
        (["run", "--remote-cacert", "/c", "--target", "https://t:1", "--", "true"], "with --ssh"),
        (["run", "--local", "--ssh", "h", "--", "true"], "drop --ssh"),
        (["run", "--local", "--target", "https://t:1", "--", "true"], "drop --target"),
        (["run", "--local", "--role", "builder", "--", "true"], "one role, 'default'"),
        (["run", "--ssh", "h:0", "--", "true"], "1..65535"),
        (["logs", "--local", "t-1"], "'paddock logs' needs a lasting one"),
        (["kill", "--local", "t-1"], "'paddock kill' needs a lasting one"),
    ],
)
def test_conflicting_options_are_usage_errors(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PADDOCK_TOKEN", "tok")
    assert cli.main(argv) == 125
    err = capsys.readouterr().err
    assert err.startswith("paddock: usage: ")
    assert says in err
