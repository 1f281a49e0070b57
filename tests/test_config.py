"""The target's config: errors that name the key, and safe check/apply/mint."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sha
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from shared.walk import canonical_path
from target_side.config import load_settings, parse_settings
from target_side.errors import ConfigError, UnsafeFileError
from target_side.safe_files import read_private, write_atomic
from target_side.tools import config_file

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def root(tmp_path: Path) -> Path:
    base = Path(canonical_path(tmp_path))
    (base / "ws").mkdir()
    uid, gid = parse_settings(_config_text(base)).role_ids("builder")
    os.chown(base / "ws", uid, gid)  # as an operator (or deploy) hands a workspace to its role
    return base


def _config_text(root: Path, extra: str = "") -> str:
    return (
        f'[server]\nstate_root = "{root / "state"}"\n{extra}'
        f'[roles.builder]\ntoken_sha256 = "{sha("t")}"\nworkspaces = ["{root / "ws"}"]\n'
    )


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_config_unknown_key_is_named(root: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'server\.lisen'"):
        parse_settings(_config_text(root, 'lisen = "127.0.0.1:1"\n'))


def test_config_relative_path_is_named(root: Path) -> None:
    text = _config_text(root).replace(str(root / "ws"), "ws")
    with pytest.raises(ConfigError, match=r"roles\.builder\.workspaces.*relative"):
        parse_settings(text)


def test_config_plain_http_off_loopback_is_refused(root: Path) -> None:
    with pytest.raises(ConfigError, match="TLS is required"):
        parse_settings(_config_text(root, 'listen = "0.0.0.0:8443"\n'))


def test_config_loopback_ipv6_may_be_plain(root: Path) -> None:
    settings = parse_settings(_config_text(root, 'listen = "[::1]:8443"\n'))
    assert (settings.server.host, settings.server.port) == ("::1", 8443)


def test_config_load_refuses_a_symlink(root: Path) -> None:
    real = _write(root / "real.toml", _config_text(root))
    link = root / "link.toml"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        load_settings(link)


def test_config_load_refuses_world_readable(root: Path) -> None:
    path = _write(root / "open.toml", _config_text(root), mode=0o644)
    with pytest.raises(ConfigError, match="chmod 0640"):
        load_settings(path)


def test_config_load_refuses_a_group_writable_ancestor(root: Path) -> None:
    shared = root / "shared"
    shared.mkdir()
    shared.chmod(0o775)  # set after mkdir: mkdir's mode is masked by the umask
    path = _write(shared / "target.toml", _config_text(root))
    with pytest.raises(ConfigError, match="writable by group or others"):
        load_settings(path)


def test_config_check_reports_every_problem(root: Path) -> None:
    text = _config_text(root).replace(str(root / "ws"), str(root / "missing-ws"))
    path = _write(root / "target.toml", text)
    settings, problems = config_file.check(path)
    assert settings is not None
    assert any("missing-ws does not exist" in p for p in problems)


def test_config_check_cli_exit_status(root: Path) -> None:
    good = _write(root / "good.toml", _config_text(root))
    bad = _write(root / "bad.toml", _config_text(root, "nonsense = 1\n"))
    cli = [sys.executable, "-m", "target_side.tools.cli", "config", "check"]
    ok = subprocess.run([*cli, str(good)], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert ok.returncode == 0, ok.stderr
    failed = subprocess.run([*cli, str(bad)], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert failed.returncode == 1
    assert "server.nonsense" in failed.stderr


def test_config_apply_installs_atomically_with_mode_0600(root: Path) -> None:
    source = _write(root / "new.toml", _config_text(root), mode=0o640)
    dest = _write(root / "target.toml", "old = 1\n")
    before = os.stat(dest).st_ino
    config_file.apply(source, dest)
    assert dest.read_text() == source.read_text()
    assert os.stat(dest).st_mode & 0o777 == 0o600
    assert os.stat(dest).st_ino != before  # replaced by rename, never rewritten in place
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []


def test_config_apply_refuses_a_bad_file_and_keeps_the_old(root: Path) -> None:
    source = _write(root / "new.toml", _config_text(root, "typo = true\n"))
    dest = _write(root / "target.toml", "old = 1\n")
    with pytest.raises(ConfigError, match=r"server\.typo"):
        config_file.apply(source, dest)
    assert dest.read_text() == "old = 1\n"


def test_token_mint_stores_only_the_hash_and_keeps_comments(root: Path) -> None:
    path = _write(root / "target.toml", "# operator note\n" + _config_text(root))
    token = config_file.mint_token(path, "builder")
    text = path.read_text()
    assert token not in text
    assert sha(token) in text
    assert "# operator note" in text
    assert load_settings(path).roles["builder"].token_sha256 == sha(token)


def test_token_mint_for_unknown_role_changes_nothing(root: Path) -> None:
    path = _write(root / "target.toml", _config_text(root))
    before = path.read_text()
    with pytest.raises(ConfigError, match="no role 'ghost'"):
        config_file.mint_token(path, "ghost")
    assert path.read_text() == before


def test_write_atomic_failure_leaves_old_file_and_no_temp(root: Path) -> None:
    dest = _write(root / "state.json", "old")

    # A str where bytes belong fails inside the write, after the temp file exists.
    with pytest.raises(TypeError):
        write_atomic(dest, "not bytes")  # type: ignore[arg-type]
    assert dest.read_text() == "old"
    assert sorted(p.name for p in root.iterdir()) == ["state.json", "ws"]


def test_read_private_refuses_foreign_owner(root: Path) -> None:
    path = _write(root / "theirs.toml", "x = 1\n")
    os.chown(path, 12345, 12345)
    with pytest.raises(UnsafeFileError, match="owned by uid 12345"):
        read_private(path)


def _target_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "target_side.tools.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def _readme_config() -> str:
    """The config the README shows an operator, as written there."""
    text = (REPO / "README.md").read_text()
    start = text.index("```toml\n", text.index("## Running a target")) + len("```toml\n")
    return text[start : text.index("```", start)]


def test_config_check_of_the_readme_example_reports_every_problem_at_once(root: Path) -> None:
    path = _write(root / "target.toml", _readme_config())
    result = _target_cli("config", "check", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    # Each line names the file once, then the key it is about.
    assert all(line.count(str(path)) == 1 for line in lines), lines
    text = result.stderr
    assert "roles.builder.token_sha256" in text
    assert "server.tls_cert: /etc/paddock/tls/cert.pem does not exist" in text
    assert "paddock-target tls init --dir /etc/paddock/tls" in text


def test_config_check_of_a_missing_file_is_one_line_not_a_traceback(root: Path) -> None:
    result = _target_cli("config", "check", str(root / "nowhere" / "target.toml"))
    assert result.returncode == 1
    assert result.stderr == f"{root / 'nowhere' / 'target.toml'} does not exist\n"


def test_config_check_reports_filesystem_problems_beside_key_problems(root: Path) -> None:
    text = _config_text(root, f'tls_cert = "{root}/tls/c.pem"\ntls_key = "{root}/tls/k.pem"\n')
    text = text.replace(str(root / "ws"), str(root / "missing-ws")).replace(sha("t"), "short")
    settings, problems = config_file.check(_write(root / "target.toml", text))
    assert settings is None
    assert [p.split(":")[0] for p in problems] == [
        "'roles.builder.token_sha256'",
        "roles.builder.workspaces",
        "server.tls_cert",
        "server.tls_key",
    ]
    assert not any(str(root / "target.toml") in p for p in problems)


def test_config_check_names_a_workspace_the_role_cannot_write(root: Path) -> None:
    config = _write(root / "t.toml", _config_text(root))
    os.chown(root / "ws", 0, 0)
    _, problems = config_file.check(config)
    (problem,) = problems
    uid = parse_settings(_config_text(root)).role_ids("builder")[0]
    assert f"not writable by the role's uid {uid}" in problem
    assert f"run: chown {uid}:{uid} {root / 'ws'}" in problem


def test_config_check_names_a_workspace_out_of_the_roles_reach(root: Path) -> None:
    config = _write(root / "t.toml", _config_text(root))
    root.chmod(0o700)
    _, problems = config_file.check(config)
    assert any(f"cannot search {root} (run: chmod o+x {root})" in p for p in problems)


def test_config_check_names_a_missing_or_open_fence_path_dir(root: Path) -> None:
    loose = root / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    fence = f'[fence]\npath = "{loose}:{root / "missing"}:/usr/bin"\n'
    config = _write(root / "t.toml", _config_text(root, fence))
    _, problems = config_file.check(config)
    assert any(f"fence.path: {loose} is writable by group or others" in p for p in problems)
    assert any(f"fence.path: {root / 'missing'} does not exist" in p for p in problems)


def test_config_check_names_a_role_whose_pool_uid_belongs_to_an_account(root: Path) -> None:
    text = _config_text(root).replace("[server]\n", '[server]\nid_pool = "65534:1"\n')
    config = _write(root / "t.toml", text)
    _, problems = config_file.check(config)
    assert any("belongs to account 'nobody'" in p for p in problems)


def test_target_version(root: Path) -> None:
    result = _target_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("paddock-target ")


def test_tls_init_makes_files_a_config_can_use(root: Path) -> None:
    tls_dir = root / "etc" / "tls"
    result = _target_cli("tls", "init", "--dir", str(tls_dir), "--host", "build.example")
    assert result.returncode == 0, result.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tls_dir.iterdir()}
    assert modes == {"ca.pem": 0o644, "cert.pem": 0o644, "key.pem": 0o600}
    assert f'tls_cert = "{tls_dir / "cert.pem"}"' in result.stdout
    assert f'tls_key = "{tls_dir / "key.pem"}"' in result.stdout
    ca = x509.load_pem_x509_certificate((tls_dir / "ca.pem").read_bytes())
    assert ca.fingerprint(hashes.SHA256()).hex(":").upper() in result.stdout
    cert = x509.load_pem_x509_certificate((tls_dir / "cert.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "build.example" in names.get_values_for_type(x509.DNSName)
    # The lines it printed make a config that checks clean.
    lines = "\n".join(line for line in result.stdout.splitlines() if line.startswith("tls_"))
    config = _write(root / "target.toml", _config_text(root, lines + "\n"))
    assert config_file.check(config) == (load_settings(config), [])


def test_tls_init_never_replaces_existing_files(root: Path) -> None:
    tls_dir = root / "tls"
    tls_dir.mkdir()
    (tls_dir / "key.pem").write_text("the key in use")
    result = _target_cli("tls", "init", "--dir", str(tls_dir))
    assert result.returncode == 1
    assert "exists already" in result.stderr
    assert sorted(p.name for p in tls_dir.iterdir()) == ["key.pem"]
    assert (tls_dir / "key.pem").read_text() == "the key in use"
