"""agent_side.targets_file: what ``paddock deploy`` stores, private and without a secret in the
index, and how ``paddock run -t NAME`` reads it back."""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path

import pytest
import trustme

from agent_side import cli, targets_file
from agent_side.errors import UsageError
from agent_side.targets_file import StoredTarget


@pytest.fixture
def environ(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


@pytest.fixture(scope="module")
def ca_pem() -> str:
    return trustme.CA().cert_pem.bytes().decode()


def _entry(ca: str, **changes: object) -> StoredTarget:
    base = StoredTarget(
        name="build-host",
        route="ssh",
        url="https://127.0.0.1:8443",
        ssh="root@build-host",
        ca_sha256=targets_file.fingerprint(ca),
        default_role="builder",
    )
    return StoredTarget(**{**base.__dict__, **changes})


def test_targets_file_is_private_and_holds_no_secret(environ, ca_pem) -> None:
    saved = targets_file.save(
        _entry(ca_pem), tokens={"builder": "s3cret-token"}, ca_pem=ca_pem, environ=environ
    )
    directory = Path(environ["XDG_CONFIG_HOME"]) / "paddock"
    assert saved.index == directory / "targets.toml"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in (
        saved.index,
        directory / "targets/build-host/ca.pem",
        directory / "targets/build-host/token-builder",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert "s3cret-token" not in saved.index.read_text()
    table = tomllib.loads(saved.index.read_text())["targets"]["build-host"]
    assert table["tokens"] == {"builder": "targets/build-host/token-builder"}
    assert table["ca_file"] == "targets/build-host/ca.pem"
    loaded = targets_file.load("build-host", environ)
    assert loaded.token_file("builder").read_text().strip() == "s3cret-token"
    assert loaded.checked_ca() == str(directory / "targets/build-host/ca.pem")
    assert not [p for p in directory.rglob(".*") if p.name != ".targets.lock"]  # no temp files


def test_targets_file_goes_to_home_config_without_xdg(tmp_path, ca_pem) -> None:
    environ = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": "relative/ignored"}
    saved = targets_file.save(_entry(ca_pem), tokens={}, ca_pem=ca_pem, environ=environ)
    assert saved.index == tmp_path / ".config" / "paddock" / "targets.toml"


def test_targets_file_keeps_tokens_of_the_same_install_and_drops_another_installs(
    environ, ca_pem
) -> None:
    targets_file.save(_entry(ca_pem), tokens={"builder": "t1"}, ca_pem=ca_pem, environ=environ)
    again = targets_file.save(
        _entry(ca_pem, route="https"), tokens={"reviewer": "t2"}, ca_pem=ca_pem, environ=environ
    )
    assert set(again.entry.tokens) == {"builder", "reviewer"} and again.dropped_roles == ()
    assert targets_file.load("build-host", environ).route == "https"
    other_ca = trustme.CA().cert_pem.bytes().decode()
    other = targets_file.save(_entry(other_ca), tokens={}, ca_pem=other_ca, environ=environ)
    assert other.dropped_roles == ("builder", "reviewer") and other.entry.tokens == {}


def test_targets_file_refuses_a_ca_that_changed_since_the_deploy(environ, ca_pem) -> None:
    saved = targets_file.save(_entry(ca_pem), tokens={}, ca_pem=ca_pem, environ=environ)
    assert saved.entry.ca_file is not None
    saved.entry.ca_file.write_text(trustme.CA().cert_pem.bytes().decode())
    with pytest.raises(UsageError, match="no longer holds the CA pinned"):
        targets_file.load("build-host", environ).checked_ca()


@pytest.mark.parametrize("name", ["", "../x", ".hidden", "-x", "a/b", "a b"])
def test_targets_file_names_are_never_paths(name) -> None:
    with pytest.raises(UsageError):
        targets_file.checked_name(name)


def test_unknown_stored_target_names_the_stored_ones(environ, ca_pem) -> None:
    targets_file.save(_entry(ca_pem), tokens={}, ca_pem=ca_pem, environ=environ)
    with pytest.raises(UsageError, match=r"stored: build-host"):
        targets_file.load("nope", environ)


def test_stored_target_excludes_target_and_ssh_flags(environ, ca_pem, capsys) -> None:
    targets_file.save(_entry(ca_pem), tokens={"builder": "t"}, ca_pem=ca_pem, environ=environ)
    parser = cli.build_parser()
    for extra in (["--ssh", "root@x"], ["--target", "https://x:1"]):
        args = parser.parse_args(["run", "-t", "build-host", *extra, "--", "true"])
        with pytest.raises(UsageError, match="names the target already"):
            cli.resolve_connection(args, environ)
    args = parser.parse_args(["run", "-t", "build-host", "--role", "other", "--", "true"])
    with pytest.raises(UsageError, match="no token stored for role 'other'"):
        cli.resolve_connection(args, environ)
    args = parser.parse_args(["run", "-t", "build-host", "--", "true"])
    connection = cli.resolve_connection(args, environ)
    assert (connection.url, connection.token, connection.role) == (
        "https://127.0.0.1:8443",
        "t",
        "builder",
    )
    assert cli.main(["run", "--local", "-t", "build-host", "--", "true"]) == 125
    assert "drop -t" in capsys.readouterr().err
