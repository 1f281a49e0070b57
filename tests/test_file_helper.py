"""The file helper's archive rules, checked directly (no fence): every member before any lands.

``tests/test_files.py`` runs the same helper inside real fences; here each
attack is one crafted tar, kept as data, and the check alone is exercised, so
each rule is seen to refuse what it must and to let through what it must not.
"""

from __future__ import annotations

import io
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from target_side.fence import file_helper
from target_side.fence.file_helper import Refused, check_archive, member_parts

Member = Callable[[tarfile.TarFile], None]


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    def add(archive: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        archive.addfile(info, io.BytesIO(data))

    return add


def _entry(name: str, kind: bytes, linkname: str = "", mode: int = 0o755) -> Member:
    def add(archive: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, linkname, mode
        archive.addfile(info)

    return add


def _dir(name: str, mode: int = 0o755) -> Member:
    return _entry(name, tarfile.DIRTYPE, mode=mode)


def _link(name: str, target: str) -> Member:
    return _entry(name, tarfile.SYMTYPE, target)


def _hard(name: str, target: str) -> Member:
    return _entry(name, tarfile.LNKTYPE, target)


def tar_of(*members: Member) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for add in members:
            add(archive)
    buffer.seek(0)
    return buffer


def request_for(target: Path, limit: int = 1 << 20, prefix: tuple[str, ...] = ()) -> dict:
    return {
        "path": str(target),
        "limit": limit,
        "prefix": list(prefix),
        "protected": [[".git"], [".bashrc"], [".vscode", "tasks.json"]],
        "keep": [],
    }


REFUSED: dict[str, tuple[list[Member], str, str]] = {
    "absolute name": ([_file("/etc/cron.d/x")], "bad-archive", "absolute"),
    "dot-dot name": ([_file("a/../../x")], "bad-archive", "'..'"),
    "dot-dot at the start": ([_file("../x")], "bad-archive", "'..'"),
    "symlink to an absolute path": ([_link("l", "/etc")], "bad-archive", "absolute"),
    "symlink climbing out": ([_link("l", "../outside")], "bad-archive", "out of"),
    "symlink climbing out from below": (
        [_dir("a"), _link("a/l", "../../x")],
        "bad-archive",
        "out of",
    ),
    "symlink out through another member's link": (
        [_link("a", "."), _link("b", "a/..")],
        "bad-archive",
        "out of",
    ),
    "symlink through a link to an absolute path": (
        [_link("a", "/etc"), _link("b", "a/passwd")],
        "bad-archive",
        "absolute",
    ),
    "symlink loop": ([_link("a", "b"), _link("b", "a/x")], "bad-archive", "loop"),
    "member under a member symlink": (
        [_link("d", "sub"), _dir("sub"), _file("d/x")],
        "bad-archive",
        "makes a link",
    ),
    "hard link out of the archive": ([_hard("h", "../../etc/passwd")], "bad-archive", "'..'"),
    "hard link to a name not in it": ([_hard("h", "nothing")], "bad-archive", "hard link"),
    "hard link to a directory": ([_dir("d"), _hard("h", "d")], "bad-archive", "hard link"),
    "character device": ([_entry("null", tarfile.CHRTYPE)], "bad-archive", "device"),
    "block device": ([_entry("sda", tarfile.BLKTYPE)], "bad-archive", "device"),
    "fifo": ([_entry("pipe", tarfile.FIFOTYPE)], "bad-archive", "FIFO"),
    "setuid file": ([_file("run", mode=0o4755)], "bad-archive", "setuid"),
    "setgid directory": ([_dir("d", mode=0o2755)], "bad-archive", "setgid"),
    "file then directory of one name": ([_file("x"), _dir("x")], "bad-archive", "twice"),
    "git directory": ([_file(".git/hooks/pre-commit")], "protected-path", ".git"),
    "git directory below": ([_file("repo/.git/config")], "protected-path", ".git"),
    "protected name": ([_file("home/.bashrc")], "protected-path", ".bashrc"),
    "protected path of two names": ([_file(".vscode/tasks.json")], "protected-path", ".vscode"),
    "over the limit": ([_file("big", b"x" * 2048)], "file-too-large", "too large"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_check_archive_refuses(case: str, tmp_path: Path) -> None:
    members, rule, words = REFUSED[case]
    with pytest.raises(Refused) as refused:
        check_archive(tar_of(*members), request_for(tmp_path / "new", limit=1024), None)
    assert refused.value.rule == rule
    assert words in refused.value.why or words in str(refused.value.member)


ALLOWED: dict[str, list[Member]] = {
    "files and directories": [_dir("a"), _file("a/b"), _file("c/d/e")],
    "the directory itself as .": [_dir("."), _file("./x")],
    "symlink inside": [_file("a"), _link("l", "a")],
    "symlink up and back in": [_dir("x"), _file("y"), _link("x/l", "../y")],
    "symlink through a member link, inside": [_dir("s/t"), _link("d", "s/t"), _link("e", "d/..")],
    "dangling symlink inside": [_link("l", "later/file")],
    "hard link to an earlier file": [_file("a"), _hard("b", "a")],
    "a name that only starts like a protected one": [_file(".bashrc.orig"), _file(".github/x")],
    "a name repeated": [_file("x", b"1"), _file("x", b"22")],
}


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_check_archive_allows(case: str, tmp_path: Path) -> None:
    plan = check_archive(tar_of(*ALLOWED[case]), request_for(tmp_path / "new"), None)
    assert plan.members


def test_check_archive_counts_only_the_last_of_a_name(tmp_path: Path) -> None:
    plan = check_archive(
        tar_of(_file("x", b"1"), _file("x", b"22")), request_for(tmp_path / "n"), None
    )
    assert plan.size == 2


def test_check_archive_refuses_a_member_under_an_existing_symlink(tmp_path: Path) -> None:
    (tmp_path / "escape").symlink_to("/etc")
    with pytest.raises(Refused, match="symlink") as refused:
        check_archive(tar_of(_file("escape/cron.d/x")), request_for(tmp_path), str(tmp_path))
    assert refused.value.member == "escape/cron.d/x"


def test_check_archive_resolves_links_already_there(tmp_path: Path) -> None:
    (tmp_path / "up").symlink_to("..")
    with pytest.raises(Refused, match="out of"):
        check_archive(tar_of(_link("l", "up/x")), request_for(tmp_path), str(tmp_path))


def test_check_archive_refuses_turning_a_directory_into_a_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(Refused, match="replace a directory"):
        check_archive(tar_of(_file("d")), request_for(tmp_path), str(tmp_path))


def test_check_archive_counts_the_directorys_own_path_for_protected_names(tmp_path: Path) -> None:
    # The directory is .vscode (checked by the planner); a member tasks.json completes the pair.
    with pytest.raises(Refused, match="protected"):
        check_archive(tar_of(_file("tasks.json")), request_for(tmp_path, prefix=(".vscode",)), None)


def test_check_archive_refuses_what_is_not_a_tar(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="not a tar"):
        check_archive(io.BytesIO(b"hello, not a tar" * 40), request_for(tmp_path), None)


@pytest.mark.parametrize(
    ("name", "parts"), [("a/b", ("a", "b")), ("./a//b/", ("a", "b")), (".", ()), ("./", ())]
)
def test_member_parts_normalises_harmless_names(name: str, parts: tuple[str, ...]) -> None:
    assert member_parts(name) == parts


def test_helper_body_is_standard_library_only() -> None:
    """It runs under the fence's python3 -I -S: nothing from this project, nothing installed."""
    source = Path(file_helper.__file__).read_text()
    imported = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from "))
    }
    assert imported <= {"__future__", *sys.stdlib_module_names}, imported
