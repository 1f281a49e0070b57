"""The file helper: one file operation, run inside its own fence as the role's uid.

The target never reads or writes a role's files itself. For each file
operation it plans a fence (``policy/files.py``) that mounts only the path
concerned, and runs this program there with the fence's ``python3 -I -S -B``.
Its body reaches the fence from memory, like a script turn's, never by a path
that could change; it imports nothing but the standard library, and keeps to
what Python 3.8 has (the fence's python3 is the system's, not the server's).

What it is told and how it answers:

- the request: one JSON object in ``PADDOCK_FILE_REQUEST`` (``op``, ``path``,
  ``limit`` in bytes, ``data_fd``, and what the operation needs);
- the data: the descriptor ``data_fd``, a pipe to or from the server: a
  file's bytes, a listing as JSON, an archive;
- reports: one JSON object a line on stdout, ``{"event": ...}``: ``ready``
  (checked, about to move data), ``received`` (all the data came), ``done``,
  ``refused`` (a rule: ``rule``, ``why``, ``member``) or ``error`` (what the
  system said: ``errno``, ``path``, ``message``);
- a write commits only when the server says ``commit`` on stdin, once it
  knows the whole body arrived: a client that went away mid-upload leaves
  nothing behind. Anything else, or end of input, abandons the write.

Writes are all or nothing. A file is written to an unnamed temporary file
(``O_TMPFILE``; a named one where the filesystem has none) in its own
directory, synced, and renamed over the name. An archive is spooled, every
member checked before anything is extracted, extracted into a staging
directory, synced, and moved into place; a failure while moving puts back
everything moved.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import stat
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    # Annotations only: typing, tarfile and shutil are loaded where they are used (an
    # archive), since every file operation pays this program's start.
    import tarfile
    from typing import Any, BinaryIO

    Request = dict[str, Any]
    Parts = tuple[str, ...]
    """An archive member's name as components below its directory."""

REQUEST_VARIABLE = "PADDOCK_FILE_REQUEST"
CHUNK = 1 << 20
MAX_ENTRIES = 200000
"""Archive members, and directory entries archived, at most (each costs memory to check)."""
MAX_LINK_HOPS = 40
ALLOWED_MODE = 0o1777
"""Permission bits kept from an archive; setuid and setgid are refused outright."""
DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
EXIT_REFUSED = 3
EXIT_FAILED = 2


class Refused(Exception):
    """A rule refuses the operation; ``rule`` names which (the server words the refusal)."""

    def __init__(self, rule: str, why: str, member: str | None = None, **facts: object) -> None:
        super().__init__(why)
        self.rule = rule
        self.why = why
        self.member = member
        self.facts = facts


class Failed(Exception):
    """The system, or the operation's own check, said no; ``code`` is an errno name."""

    def __init__(self, code: str, path: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.path = path
        self.message = message


def report(event: str, **fields: object) -> None:
    fields["event"] = event
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> int:
    request = json.loads(os.environ[REQUEST_VARIABLE])
    operation = OPERATIONS[request["op"]]
    try:
        operation(request)
    except Refused as exc:
        report("refused", rule=exc.rule, why=exc.why, member=exc.member, **exc.facts)
        return EXIT_REFUSED
    except Failed as exc:
        report("error", errno=exc.code, path=exc.path, message=exc.message)
        return EXIT_FAILED
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "EIO")
        report("error", errno=code, path=exc.filename, message=exc.strerror or str(exc))
        return EXIT_FAILED
    return 0


# --- reading ---------------------------------------------------------------------------


def read_file(request: Request) -> None:
    """The file's bytes to ``data_fd``: exactly the size it had when opened."""
    path, out = request["path"], request["data_fd"]
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise Failed(
                "EISDIR", path, "is a directory: list it (list=1), or fetch it as an archive"
            )
        if not stat.S_ISREG(st.st_mode):
            raise Failed("EINVAL", path, "is not a regular file (a FIFO or a device?)")
        if st.st_size > request["limit"]:
            raise Refused("file-too-large", "too large", size=st.st_size)
        report("ready", **describe(posixpath.basename(path), st))
        left = st.st_size
        while left > 0:
            sent = _send(out, fd, min(left, CHUNK))
            if sent == 0:
                raise Failed("EIO", path, "became shorter while it was being read")
            left -= sent
    finally:
        os.close(fd)
    os.close(out)
    report("done", size=st.st_size)


def _send(out: int, fd: int, size: int) -> int:
    try:
        return os.sendfile(out, fd, None, size)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
    data = os.read(fd, size)
    _write_all(out, data)
    return len(data)


def list_dir(request: Request) -> None:
    """The path's own entry and, for a directory, up to ``entries`` of its entries, as JSON."""
    path, out, most = request["path"], request["data_fd"], request["entries"]
    st = os.lstat(path)
    listing: dict[str, Any] = {
        "path": path,
        "entry": describe(posixpath.basename(path) or "/", st, path),
    }
    found: list[dict[str, Any]] = []
    truncated = False
    if stat.S_ISDIR(st.st_mode):
        with os.scandir(path) as entries:
            for entry in entries:
                if len(found) >= most:
                    truncated = True
                    break
                found.append(describe(entry.name, entry.stat(follow_symlinks=False), entry.path))
    found.sort(key=lambda e: e["name"])
    listing["entries"] = found
    listing["truncated"] = truncated
    report("ready")
    _write_all(out, json.dumps(listing).encode())
    os.close(out)
    report("done", entries=len(found))


def describe(name: str, st: os.stat_result, path: str | None = None) -> dict[str, Any]:
    """An entry as the wire's ``FileEntry`` has it."""
    entry = {
        "name": name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
        "type": _kind(st.st_mode),
        "size": st.st_size,
        "mode": f"{stat.S_IMODE(st.st_mode):04o}",
        "mtime": st.st_mtime,
        "uid": st.st_uid,
        "gid": st.st_gid,
    }
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        import base64

        raw = name.encode("utf-8", "surrogateescape")
        entry["name_b64"] = base64.b64encode(raw).decode()
    if path is not None and stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        entry["target"] = target.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return entry


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def read_archive(request: Request) -> None:
    """The directory as a tar stream to ``data_fd``: its entries, named relative to it.

    Directories, regular files and symlinks (never followed); sockets, FIFOs
    and devices are left out. Everything is looked at before the first byte
    is sent, so a refusal or an unreadable entry comes before any data.
    """
    import tarfile

    root, out = request["path"], request["data_fd"]
    if not stat.S_ISDIR(os.lstat(root).st_mode):
        raise Failed("ENOTDIR", root, "is not a directory; fetch a file with GET /v1/files")
    entries, total, skipped = _survey(root, request["limit"])
    report("ready", size=total, entries=len(entries), skipped=skipped)
    stream = os.fdopen(out, "wb", buffering=CHUNK)
    with stream, tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for name, st in entries:
            _add(archive, root, name, st)
    report("done", size=total, entries=len(entries))


def _survey(root: str, limit: int) -> tuple[list[tuple[str, os.stat_result]], int, int]:
    entries = []
    total = skipped = 0
    pending = [""]
    while pending:
        relative = pending.pop()
        directory = posixpath.join(root, relative) if relative else root
        if not os.access(directory, os.R_OK | os.X_OK):
            raise Failed("EACCES", directory, "cannot be listed by the role's uid")
        with os.scandir(directory) as listing:
            found = sorted(listing, key=lambda e: e.name)
        for entry in found:
            name = posixpath.join(relative, entry.name) if relative else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                pending.append(name)
            elif stat.S_ISREG(st.st_mode):
                if not os.access(entry.path, os.R_OK):
                    raise Failed("EACCES", entry.path, "cannot be read by the role's uid")
                total += st.st_size
            elif not stat.S_ISLNK(st.st_mode):
                skipped += 1
                continue
            entries.append((name, st))
            if len(entries) > MAX_ENTRIES:
                raise Refused("too-many-entries", f"holds more than {MAX_ENTRIES} entries")
            if total > limit:
                raise Refused("file-too-large", "too large", size=total)
    return entries, total, skipped


def _add(archive: tarfile.TarFile, root: str, name: str, st: os.stat_result) -> None:
    import tarfile

    path = posixpath.join(root, name)
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        archive.addfile(info)
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(path)
        archive.addfile(info)
    else:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as source:
            now = os.fstat(fd)
            if not stat.S_ISREG(now.st_mode):
                raise Failed("EINVAL", path, "stopped being a regular file while archived")
            info.size = now.st_size
            archive.addfile(info, source)


# --- writing a file --------------------------------------------------------------------


def write_file(request: Request) -> None:
    """The body from ``data_fd`` into a temporary file beside ``path``; renamed over it on
    ``commit``. Without a mode given, a replaced file keeps its own, a new one gets 0644."""
    path = request["path"]
    directory, name = posixpath.split(path)
    dir_fd = os.open(directory, DIR_OPEN)
    try:
        before = _lstat_at(dir_fd, name)
        if before is not None and stat.S_ISDIR(before.st_mode):
            raise Failed("EISDIR", path, "is a directory; name a file inside it")
        if request.get("mode"):
            mode = int(request["mode"], 8)
        elif before is not None and stat.S_ISREG(before.st_mode):
            mode = stat.S_IMODE(before.st_mode) & 0o777
        else:
            mode = 0o644
        temporary = Temporary(dir_fd)
        try:
            report("ready")
            size = _receive(request["data_fd"], temporary.fd, request["limit"])
            report("received", size=size)
            if not _committed():
                return
            os.fchmod(temporary.fd, mode)
            os.fsync(temporary.fd)
            temporary.place(name)
            os.fsync(dir_fd)
        finally:
            temporary.discard()
        after = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    finally:
        os.close(dir_fd)
    report(
        "done",
        size=after.st_size,
        mode=f"{stat.S_IMODE(after.st_mode):04o}",
        uid=after.st_uid,
        created=before is None,
    )


class Temporary:
    """A file in a directory that has no name until ``place`` gives it one.

    ``O_TMPFILE`` where the filesystem has it: a write abandoned, or a helper
    killed, leaves nothing. Elsewhere a hidden name, removed by ``discard``.
    """

    def __init__(self, dir_fd: int, readable: bool = False) -> None:
        self.dir_fd = dir_fd
        self.name: str | None = None
        flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CLOEXEC
        try:
            self.fd = os.open(".", flags | os.O_TMPFILE, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            self.name = ".paddock-upload-" + os.urandom(8).hex()
            self.fd = os.open(
                self.name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
            )

    def place(self, name: str) -> None:
        """Rename the file over ``name``: whoever opens ``name`` gets the old file or this one."""
        if self.name is None:
            # An unnamed file gets a name first (linkat through /proc: no capability needed).
            self.name = ".paddock-upload-" + os.urandom(8).hex()
            os.link(
                f"/proc/self/fd/{self.fd}",
                self.name,
                dst_dir_fd=self.dir_fd,
                follow_symlinks=True,
            )
        os.replace(self.name, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.name = None

    def discard(self) -> None:
        if self.name is not None:
            # Not contextlib.suppress: importing contextlib costs every operation's start.
            try:  # noqa: SIM105 - see above
                os.unlink(self.name, dir_fd=self.dir_fd)
            except OSError:
                pass
            self.name = None
        os.close(self.fd)


def _receive(data: int, out: int, limit: int) -> int:
    size = 0
    while True:
        chunk = os.read(data, CHUNK)
        if not chunk:
            return size
        size += len(chunk)
        if size > limit:
            raise Refused("file-too-large", "too large", size=size)
        _write_all(out, chunk)


def _committed() -> bool:
    return sys.stdin.readline().strip() == "commit"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


# --- writing an archive ----------------------------------------------------------------


def write_archive(request: Request) -> None:
    """Extract a tar into ``path``, all or nothing (the module docstring says how)."""
    target = request["path"]
    exists = request["exists"]
    base = target if exists else posixpath.dirname(target)
    base_fd = os.open(base, DIR_OPEN)
    try:
        spool = Temporary(base_fd, readable=True)
        try:
            report("ready")
            size = _receive(request["data_fd"], spool.fd, request["limit"])
            report("received", size=size)
            if not _committed():
                return
            os.lseek(spool.fd, 0, os.SEEK_SET)
            with os.fdopen(os.dup(spool.fd), "rb") as source:
                plan = check_archive(source, request, target if exists else None)
                _extract_and_place(plan, request, base, base_fd)
        finally:
            spool.discard()
    finally:
        os.close(base_fd)
    report("done", entries=len(plan.members), size=plan.size, created=not exists)


class ArchivePlan:
    """An archive's members as they will land: the last of each name, all checked."""

    def __init__(self, archive: tarfile.TarFile) -> None:
        self.archive = archive
        self.members: dict[Parts, tarfile.TarInfo] = {}
        self.root_mode: int | None = None
        self.size = 0


def check_archive(source: BinaryIO, request: Request, existing: str | None) -> ArchivePlan:
    """Every member checked against every rule before anything is written.

    ``existing``: the directory the archive merges into, if it exists (what is
    already there counts: no member may land under a symlink, or turn a
    directory into a file); None when the archive makes a new one.
    """
    import tarfile

    try:
        archive = tarfile.open(fileobj=source, mode="r:*")  # noqa: SIM115 - kept by the plan
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise Refused("bad-archive", f"is not a tar archive ({exc})") from None
    plan = ArchivePlan(archive)
    count = 0
    try:
        for member in archive:
            count += 1
            if count > MAX_ENTRIES:
                raise Refused("bad-archive", f"holds more than {MAX_ENTRIES} members")
            _take(plan, member, request)
    except (tarfile.TarError, EOFError) as exc:
        raise Refused("bad-archive", f"is damaged or cut short ({exc})") from None
    plan.size = sum(m.size for m in plan.members.values() if m.isreg())
    if plan.size > request["limit"]:
        raise Refused("file-too-large", "unpacks too large", size=plan.size)
    tree = _Tree(plan, existing)
    for parts, member in plan.members.items():
        tree.check_place(parts, member)
        if member.issym():
            tree.check_link(parts, member.linkname)
        elif member.islnk():
            _check_hard_link(plan, parts, member)
    return plan


def _take(plan: ArchivePlan, member: tarfile.TarInfo, request: Request) -> None:
    name = member.name
    parts = member_parts(name)
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        what = "a device file" if member.ischr() or member.isblk() else "a FIFO"
        if not member.isfifo() and not member.isdev():
            what = "of an unknown type"
        raise Refused("bad-archive", f"is {what}, which is never extracted", name)
    if member.mode & (stat.S_ISUID | stat.S_ISGID):
        raise Refused("bad-archive", "has the setuid or setgid bit set", name)
    if not parts:
        if not member.isdir():
            raise Refused("bad-archive", "names the directory itself but is not a directory", name)
        plan.root_mode = member.mode & ALLOWED_MODE
        return
    _check_protected(parts, request, name)
    earlier = plan.members.pop(parts, None)
    if earlier is not None and earlier.isdir() != member.isdir():
        raise Refused("bad-archive", "appears twice, once as a directory and once not", name)
    plan.members[parts] = member


def member_parts(name: str) -> Parts:
    """A member's name as components below the directory; refused if it could leave it."""
    if "\0" in name:
        raise Refused("bad-archive", "has a NUL in its name", name)
    if name.startswith("/"):
        raise Refused("bad-archive", "has an absolute name", name)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused("bad-archive", "has '..' in its name", name)
    return tuple(parts)


def _check_protected(parts: Parts, request: Request, name: str) -> None:
    below = list(request["prefix"]) + list(parts)
    for pattern in request["protected"]:
        width = len(pattern)
        for i in range(len(below) - width + 1):
            # A match must take in the member's own components: the directory's are checked.
            if below[i : i + width] == pattern and i + width > len(request["prefix"]):
                shown = "/".join(pattern)
                raise Refused(
                    "protected-path", f"is, or lies inside, a protected name ({shown})", name
                )
    here = posixpath.join(request["path"], *parts)
    for kept in request["keep"]:
        if here == kept or here.startswith(kept + "/"):
            raise Refused("protected-path", f"lies inside {kept}, which stays read-only", name)


def _check_hard_link(plan: ArchivePlan, parts: Parts, member: tarfile.TarInfo) -> None:
    target = member_parts(member.linkname)
    linked = plan.members.get(target)
    if linked is None or not linked.isreg() or target == parts:
        raise Refused(
            "bad-archive",
            f"is a hard link to {member.linkname!r}, not to a regular file of this archive",
            member.name,
        )


class _Tree:
    """The directory as it will be once the archive is in: its members over what exists."""

    def __init__(self, plan: ArchivePlan, existing: str | None) -> None:
        self.members = plan.members
        self.existing = existing

    def on_disk(self, parts: Parts) -> os.stat_result | None:
        if self.existing is None:
            return None
        try:
            return os.lstat(posixpath.join(self.existing, *parts))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def check_place(self, parts: Parts, member: tarfile.TarInfo) -> None:
        """Every directory above the member is one (or will be), never a symlink; the
        member does not turn a directory into something else, or the reverse."""
        for depth in range(1, len(parts)):
            above = parts[:depth]
            made = self.members.get(above)
            if made is not None:
                if not made.isdir():
                    raise Refused(
                        "bad-archive",
                        "lies under {}, which the archive makes a {}".format(
                            "/".join(above), "link" if made.issym() else "file"
                        ),
                        member.name,
                    )
                continue
            there = self.on_disk(above)
            if there is not None and not stat.S_ISDIR(there.st_mode):
                raise Refused(
                    "bad-archive",
                    "lies under {}, which is a {} on the target, not a directory".format(
                        "/".join(above), _kind(there.st_mode)
                    ),
                    member.name,
                )
        there = self.on_disk(parts)
        if there is not None and stat.S_ISDIR(there.st_mode) != member.isdir():
            raise Refused(
                "bad-archive",
                "would replace a {} on the target with a {}".format(
                    _kind(there.st_mode), "directory" if member.isdir() else "non-directory"
                ),
                member.name,
            )

    def link_at(self, parts: Parts) -> str | None:
        member = self.members.get(parts)
        if member is not None:
            return member.linkname if member.issym() else None
        there = self.on_disk(parts)
        if there is not None and stat.S_ISLNK(there.st_mode):
            return os.readlink(posixpath.join(self.existing or "", *parts))
        return None

    def check_link(self, parts: Parts, target: str) -> None:
        """Resolve the link in the tree as the kernel will on disk; it must stay inside.

        Component by component, each symlink met followed where it stands (a
        member's, or one already on the target), ``..`` applied to what was
        resolved: the walk of ``shared.walk``, rooted at the directory. Climbing
        above it, an absolute target, or a loop refuses the member.
        """
        name = "/".join(parts)
        if not target or target.startswith("/"):
            raise Refused("bad-archive", f"is a symlink to an absolute path ({target})", name)
        resolved = list(parts[:-1])
        pending = target.split("/")
        hops = 0
        while pending:
            component = pending.pop(0)
            if component in ("", "."):
                continue
            if component == "..":
                if not resolved:
                    raise Refused(
                        "bad-archive",
                        f"is a symlink pointing out of the directory ({target})",
                        name,
                    )
                resolved.pop()
                continue
            resolved.append(component)
            found = self.link_at(tuple(resolved))
            if found is None:
                continue
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise Refused("bad-archive", f"is a symlink in a loop ({target})", name)
            if found.startswith("/"):
                raise Refused(
                    "bad-archive",
                    "is a symlink through {}, which points to an absolute path".format(
                        "/".join(resolved)
                    ),
                    name,
                )
            resolved.pop()
            pending = found.split("/") + pending


def _extract_and_place(plan: ArchivePlan, request: Request, base: str, base_fd: int) -> None:
    staging = request["staging"]
    os.mkdir(staging, 0o700, dir_fd=base_fd)
    stage_fd = os.open(staging, DIR_OPEN, dir_fd=base_fd)
    placed = False
    try:
        _extract(plan, stage_fd)
        os.sync()  # every byte on disk before any of it appears in place
        if request["exists"]:
            new_dirs = Merge(base, base_fd, staging).run(stage_fd)
            place_fd = base_fd
        else:
            name = posixpath.basename(request["path"])
            os.rename(staging, name, src_dir_fd=base_fd, dst_dir_fd=base_fd)
            placed = True
            new_dirs = None
            place_fd = os.open(name, DIR_OPEN, dir_fd=base_fd)
        try:
            _finish_directories(plan, place_fd, new_dirs)
            if not request["exists"]:
                os.chmod(place_fd, 0o755 if plan.root_mode is None else plan.root_mode)
        finally:
            if place_fd != base_fd:
                os.close(place_fd)
        os.sync()
    finally:
        os.close(stage_fd)
        if not placed:
            import shutil

            shutil.rmtree(posixpath.join(base, staging), ignore_errors=True)


def _extract(plan: ArchivePlan, stage_fd: int) -> None:
    """Write every member into the staging directory; hard links last, modes later.

    Directories are made owner-only until every member is in (``_finish_directories``
    gives them their own modes); those only implied by a member's name get 0755.
    """
    archive = plan.archive
    made: set[Parts] = set()
    links = []
    for member in archive.getmembers():
        parts = member_parts(member.name)
        if not parts or plan.members.get(parts) is not member:
            continue  # the directory itself, or a name a later member replaces
        _make_parents(stage_fd, parts, made)
        relative = "/".join(parts)
        if member.isdir():
            if parts not in made:
                os.mkdir(relative, 0o700, dir_fd=stage_fd)
                made.add(parts)
        elif member.issym():
            os.symlink(member.linkname, relative, dir_fd=stage_fd)
        elif member.islnk():
            links.append((member, relative))
        else:
            _write_member(archive, member, relative, stage_fd)
    for member, relative in links:
        source = "/".join(member_parts(member.linkname))
        os.link(source, relative, src_dir_fd=stage_fd, dst_dir_fd=stage_fd, follow_symlinks=False)


def _make_parents(stage_fd: int, parts: Parts, made: set[Parts]) -> None:
    for depth in range(1, len(parts)):
        above = parts[:depth]
        if above not in made:
            os.mkdir("/".join(above), 0o755, dir_fd=stage_fd)
            made.add(above)


def _write_member(
    archive: tarfile.TarFile, member: tarfile.TarInfo, relative: str, stage_fd: int
) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(relative, flags, 0o600, dir_fd=stage_fd)
    try:
        source = archive.extractfile(member)
        left = member.size
        while source is not None and left > 0:
            chunk = source.read(min(left, CHUNK))
            if not chunk:
                raise Failed("EIO", member.name, "the archive ends inside this member")
            _write_all(fd, chunk)
            left -= len(chunk)
        os.fchmod(fd, member.mode & 0o777)
        os.utime(fd, (member.mtime, member.mtime))
    finally:
        os.close(fd)


def _finish_directories(plan: ArchivePlan, place_fd: int, new_dirs: set[Parts] | None) -> None:
    """Give the directories the archive made their modes and times, deepest first.

    Only directories made by this archive: one that was already there keeps its own.
    """
    made = [p for p, m in plan.members.items() if m.isdir()]
    for parts in sorted(made, key=len, reverse=True):
        if new_dirs is not None and not any(parts[: len(n)] == n for n in new_dirs):
            continue
        member = plan.members[parts]
        relative = "/".join(parts)
        os.chmod(relative, member.mode & ALLOWED_MODE, dir_fd=place_fd, follow_symlinks=False)
        os.utime(relative, (member.mtime, member.mtime), dir_fd=place_fd, follow_symlinks=False)


class Merge:
    """Move a staged tree into an existing directory, or put everything back.

    What is absent there is renamed in whole; a directory on both sides is
    entered; a file or link on both sides replaces the one there, which is
    kept aside until the end. Every step is journalled and undone in reverse
    on any failure.
    """

    def __init__(self, dest: str, dest_fd: int, staging: str) -> None:
        self.dest = dest
        self.dest_fd = dest_fd
        self.aside_name = staging + "-replaced"
        self.aside_fd = -1
        self.journal: list[tuple[int, str, int, str]] = []
        self.opened: list[int] = []
        self.new_dirs: set[Parts] = set()
        self.count = 0

    def run(self, stage_fd: int) -> set[Parts]:
        os.mkdir(self.aside_name, 0o700, dir_fd=self.dest_fd)
        self.aside_fd = os.open(self.aside_name, DIR_OPEN, dir_fd=self.dest_fd)
        try:
            self._merge(stage_fd, self.dest_fd, ())
        except BaseException:
            self._undo()
            raise
        finally:
            for fd in self.opened:
                os.close(fd)
            os.close(self.aside_fd)
            import shutil

            shutil.rmtree(posixpath.join(self.dest, self.aside_name), ignore_errors=True)
        return self.new_dirs

    def _merge(self, source_fd: int, dest_fd: int, above: Parts) -> None:
        for name in sorted(os.listdir(source_fd)):
            here = os.stat(name, dir_fd=source_fd, follow_symlinks=False)
            there = _lstat_at(dest_fd, name)
            if there is None:
                self._rename(source_fd, name, dest_fd, name)
                if stat.S_ISDIR(here.st_mode):
                    self.new_dirs.add((*above, name))
            elif stat.S_ISDIR(here.st_mode) and stat.S_ISDIR(there.st_mode):
                inner_source = os.open(name, DIR_OPEN, dir_fd=source_fd)
                self.opened.append(inner_source)
                inner_dest = os.open(name, DIR_OPEN, dir_fd=dest_fd)
                self.opened.append(inner_dest)
                self._merge(inner_source, inner_dest, (*above, name))
            elif not stat.S_ISDIR(here.st_mode) and not stat.S_ISDIR(there.st_mode):
                self.count += 1
                kept = str(self.count)
                self._rename(dest_fd, name, self.aside_fd, kept)
                self._rename(source_fd, name, dest_fd, name)
            else:
                raise Failed("EEXIST", "/".join((*above, name)), "changed type while extracting")

    def _rename(self, from_fd: int, from_name: str, to_fd: int, to_name: str) -> None:
        os.rename(from_name, to_name, src_dir_fd=from_fd, dst_dir_fd=to_fd)
        self.journal.append((from_fd, from_name, to_fd, to_name))

    def _undo(self) -> None:
        for from_fd, from_name, to_fd, to_name in reversed(self.journal):
            try:  # noqa: SIM105 - as in Temporary.discard
                os.rename(to_name, from_name, src_dir_fd=to_fd, dst_dir_fd=from_fd)
            except OSError:
                pass


OPERATIONS = {
    "read": read_file,
    "list": list_dir,
    "archive-read": read_archive,
    "write": write_file,
    "archive-write": write_archive,
}


if __name__ == "__main__":
    sys.exit(main())
