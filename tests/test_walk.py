"""The walk, checked against GNU ``realpath -m`` and the kernel.

``realpath -m`` is the oracle for every path that resolves. It is not one for
symlink loops: where the kernel says ELOOP, ``realpath -m`` gives up silently
and prints the looping link as unresolved text, or, for a loop whose pending
text grows on each turn, never returns. ``canonical_path`` refuses loops
instead, so loop cases are checked against the kernel (``os.stat``) and, where
it terminates, ``realpath -e``, which report ELOOP.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shared.walk import (
    MAX_SYMLINK_HOPS,
    Conflict,
    RelativePathError,
    SymlinkLoopError,
    WalkError,
    canonical_path,
    is_within,
    mount_conflict,
)

# On a failing example hypothesis's pytest plugin imports libcst, which warns
# on import under this mypy_extensions; with warnings as errors that warning
# would crash the session and lose the falsifying example.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

REALPATH = "/usr/bin/realpath"
ELOOP_MESSAGE = "Too many levels of symbolic links"
# Generous: realpath answers in milliseconds, but the machine may be busy.
ORACLE_TIMEOUT = 10.0
WALK_TIMEOUT = 5.0


def gnu_realpath_m(*paths: str, timeout: float = ORACLE_TIMEOUT) -> list[str]:
    """``realpath -m`` of each path, in order, from one invocation."""
    if not paths:
        return []
    done = subprocess.run(
        [REALPATH, "-m", "-z", "--", *paths],
        capture_output=True,
        check=True,
        timeout=timeout,
    )
    return [os.fsdecode(out) for out in done.stdout.split(b"\0")[:-1]]


def gnu_realpath_e_fails(path: str) -> str:
    """The stderr of ``realpath -e path``, which must fail."""
    done = subprocess.run(
        [REALPATH, "-e", "--", path],
        capture_output=True,
        text=True,
        timeout=ORACLE_TIMEOUT,
    )
    assert done.returncode != 0, f"realpath -e {path!r} succeeded: {done.stdout!r}"
    return done.stderr


@contextmanager
def finishing_within(seconds: float) -> Iterator[None]:
    """Fail, rather than hang the session, if a loop is never noticed."""

    def give_up(signum: int, frame: object) -> None:
        raise TimeoutError(f"the walk did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def walk(path: str) -> str:
    with finishing_within(WALK_TIMEOUT):
        return canonical_path(path)


def assert_matches_oracle(*paths: str) -> None:
    expected = gnu_realpath_m(*paths)
    assert len(expected) == len(paths)
    for path, want in zip(paths, expected, strict=True):
        assert walk(path) == want, path


def assert_loop_refused(path: str) -> None:
    with pytest.raises(SymlinkLoopError):
        walk(path)
    assert ELOOP_MESSAGE in gnu_realpath_e_fails(path)


def kernel_errno(path: str) -> int | None:
    """The errno ``stat(path)`` fails with, or None if it succeeds."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno
    return None


# --- canonical_path: example cases ------------------------------------------


def test_canonical_path_existing_paths_match_realpath(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "f").write_text("")
    assert_matches_oracle(
        "/",
        "/etc",
        "/etc/passwd",
        str(tmp_path),
        str(tmp_path / "d"),
        str(tmp_path / "d" / "e"),
        str(tmp_path / "d" / "f"),
    )


def test_canonical_path_root_is_root() -> None:
    assert canonical_path("/") == "/"


def test_canonical_path_missing_tail_is_normalised(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    base = str(tmp_path)
    assert_matches_oracle(
        "/nonexistent/../etc",
        "/nonexistent/a/b/../c",
        f"{base}/missing",
        f"{base}/missing/x/./y/..",
        f"{base}/d/missing/../../d",
        f"{base}/missing/../d/./missing2/",
    )
    assert canonical_path("/nonexistent/../etc") == canonical_path("/etc")


def test_canonical_path_follows_links_again_after_dotdot_out_of_missing(tmp_path: Path) -> None:
    # Once ``..`` climbs back out of a missing part, the walk is on real
    # directories again and must follow what it meets there: creating
    # ``missing`` later would make the path name the link's target.
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to("d")
    base = str(tmp_path)
    (root,) = gnu_realpath_m(base)
    assert canonical_path(f"{base}/missing/../link") == f"{root}/d"
    assert_matches_oracle(f"{base}/missing/../link", f"{base}/missing/x/../../link/y")


def test_canonical_path_dots_and_duplicate_slashes(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    base = str(tmp_path)
    assert_matches_oracle(
        "//etc///./passwd",
        "/etc/./../etc//",
        "/./etc/.",
        f"{base}//d/./e/",
        f"{base}/d/e/../../d/e/.",
        f"{base}/./d/../d//e///",
    )


def test_canonical_path_dotdot_applies_to_resolved_parent(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "secret" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "link").symlink_to("../secret/sub")
    path = f"{tmp_path}/a/link/../x"
    (root,) = gnu_realpath_m(str(tmp_path))
    assert canonical_path(path) == f"{root}/secret/x"
    assert canonical_path(path) != canonical_path(os.path.normpath(path))
    assert_matches_oracle(path, f"{tmp_path}/a/link/..", f"{tmp_path}/a/link/../../a")


def test_canonical_path_follows_relative_symlink(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "rel").symlink_to("d/e")
    (tmp_path / "d" / "up").symlink_to("..")
    (tmp_path / "d" / "dot").symlink_to(".")
    base = str(tmp_path)
    (root,) = gnu_realpath_m(base)
    assert canonical_path(f"{base}/rel") == f"{root}/d/e"
    assert_matches_oracle(
        f"{base}/rel",
        f"{base}/rel/",
        f"{base}/rel/x",
        f"{base}/rel/..",
        f"{base}/d/up/d/up/rel",
        f"{base}/d/dot/dot/e",
    )


def test_canonical_path_follows_absolute_symlink(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "abs").symlink_to(tmp_path / "d" / "e")
    (tmp_path / "etc").symlink_to("/etc")
    (tmp_path / "root").symlink_to("/")
    base = str(tmp_path)
    assert canonical_path(f"{base}/etc/passwd") == canonical_path("/etc/passwd")
    assert_matches_oracle(
        f"{base}/abs",
        f"{base}/abs/..",
        f"{base}/abs/missing/..",
        f"{base}/etc/passwd",
        f"{base}/root",
        f"{base}/root/..",
        f"{base}/root/etc",
    )


def test_canonical_path_follows_symlink_chain(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "file").write_text("")
    (tmp_path / "l1").symlink_to("d/file")
    (tmp_path / "l2").symlink_to("l1")
    (tmp_path / "l3").symlink_to(tmp_path / "l2")
    (tmp_path / "d" / "l4").symlink_to("../l3")
    base = str(tmp_path)
    (root,) = gnu_realpath_m(base)
    assert canonical_path(f"{base}/d/l4") == f"{root}/d/file"
    assert_matches_oracle(f"{base}/l3", f"{base}/d/l4", f"{base}/d/l4/..", f"{base}/d/l4/x")


def test_canonical_path_two_link_loop_raises(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert_loop_refused(f"{tmp_path}/a")
    assert_loop_refused(f"{tmp_path}/b/x")
    # realpath -m, unlike the kernel, prints the loop as text and exits 0.
    (printed,) = gnu_realpath_m(f"{tmp_path}/a")
    assert stat.S_ISLNK(os.lstat(printed).st_mode)


def test_canonical_path_self_loop_raises(tmp_path: Path) -> None:
    (tmp_path / "self").symlink_to("self")
    assert_loop_refused(f"{tmp_path}/self")
    assert_loop_refused(f"{tmp_path}/self/")
    (printed,) = gnu_realpath_m(f"{tmp_path}/self")
    assert stat.S_ISLNK(os.lstat(printed).st_mode)


def test_canonical_path_loop_through_a_directory_raises(tmp_path: Path) -> None:
    # Plain directories between the hops must not reset the count.
    (tmp_path / "d").mkdir()
    (tmp_path / "a").symlink_to("d/b")
    (tmp_path / "d" / "b").symlink_to("../a")
    assert_loop_refused(f"{tmp_path}/a")
    assert_loop_refused(f"{tmp_path}/d/b/x")


def test_canonical_path_loop_before_dotdot_raises(tmp_path: Path) -> None:
    # The kernel has to resolve the link before ``..`` can apply to it.
    (tmp_path / "self").symlink_to("self")
    assert kernel_errno(f"{tmp_path}/self/..") == errno.ELOOP
    with pytest.raises(SymlinkLoopError):
        walk(f"{tmp_path}/self/..")


def test_canonical_path_loop_through_dotdot_raises(tmp_path: Path) -> None:
    # Each hop adds a ``..`` to the pending text, so the walk never repeats a
    # state textually: GNU realpath (-m and -e alike) spins forever on this,
    # so only the kernel is asked.
    (tmp_path / "pa").symlink_to("pb/..")
    (tmp_path / "pb").symlink_to("pa/..")
    assert kernel_errno(f"{tmp_path}/pa") == errno.ELOOP
    with pytest.raises(SymlinkLoopError):
        walk(f"{tmp_path}/pa")


def test_canonical_path_chain_at_hop_limit_resolves(tmp_path: Path) -> None:
    chain_end = make_chain(tmp_path, MAX_SYMLINK_HOPS)
    assert kernel_errno(chain_end) is None
    assert_matches_oracle(chain_end)


def test_canonical_path_chain_over_hop_limit_raises(tmp_path: Path) -> None:
    # Not a loop, and realpath -m resolves it; the kernel refuses it, and so
    # does the walk, because anything the kernel will not open must not be
    # judged as if it could be.
    chain_end = make_chain(tmp_path, MAX_SYMLINK_HOPS + 1)
    assert kernel_errno(chain_end) == errno.ELOOP
    with pytest.raises(SymlinkLoopError):
        canonical_path(chain_end)


def make_chain(directory: Path, links: int) -> str:
    """``l<links> -> ... -> l1 -> l0`` (a file); returns the head's path."""
    (directory / "l0").write_text("")
    for i in range(1, links + 1):
        (directory / f"l{i}").symlink_to(f"l{i - 1}")
    return str(directory / f"l{links}")


def test_canonical_path_hop_count_spans_the_whole_walk(tmp_path: Path) -> None:
    # Each ``d/up`` is one hop, between plain directories; the kernel counts
    # hops across the whole lookup, not per component.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "up").symlink_to("..")
    base = str(tmp_path)
    at_limit = base + "/d/up" * MAX_SYMLINK_HOPS
    over_limit = at_limit + "/d/up"
    assert kernel_errno(at_limit) is None
    assert kernel_errno(over_limit) == errno.ELOOP
    assert_matches_oracle(at_limit)
    with pytest.raises(SymlinkLoopError):
        canonical_path(over_limit)


def test_canonical_path_dangling_link_resolves_to_missing_target(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "dangling").symlink_to("d/missing/deeper")
    (tmp_path / "dangling_abs").symlink_to(tmp_path / "gone")
    (tmp_path / "dangling_up").symlink_to("missing/../d")
    base = str(tmp_path)
    (root,) = gnu_realpath_m(base)
    assert canonical_path(f"{base}/dangling") == f"{root}/d/missing/deeper"
    assert_matches_oracle(
        f"{base}/dangling",
        f"{base}/dangling/x",
        f"{base}/dangling/..",
        f"{base}/dangling/../../..",
        f"{base}/dangling_abs",
        f"{base}/dangling_abs/../d",
        f"{base}/dangling_up",
    )


def test_canonical_path_file_used_as_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "to_file").symlink_to("file")
    base = str(tmp_path)
    assert canonical_path("/etc/passwd/x") == canonical_path("/etc/passwd") + "/x"
    assert_matches_oracle(
        "/etc/passwd/x",
        "/etc/passwd/x/../y",
        "/etc/passwd/..",
        f"{base}/file/x",
        f"{base}/file/x/y/..",
        f"{base}/file/..",
        f"{base}/to_file/x",
        f"{base}/to_file/../file",
    )


def test_canonical_path_overlong_name_is_text(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(".")
    base = str(tmp_path)
    long_name = "x" * (os.pathconf(base, "PC_NAME_MAX") + 1)
    assert_matches_oracle(
        f"{base}/{long_name}",
        f"{base}/{long_name}/../link",
        f"{base}/link/{long_name}/y/..",
    )


def test_canonical_path_nul_byte_raises_walk_error() -> None:
    with pytest.raises(WalkError):
        canonical_path("/etc/\0passwd")


def test_canonical_path_dotdot_above_root_stays_at_root() -> None:
    assert canonical_path("/..") == "/"
    assert canonical_path("/../..") == "/"
    assert canonical_path("/../../etc") == canonical_path("/etc")
    assert_matches_oracle("/..", "/../..", "/../../etc", "/etc/../../..", "/nonexistent/../../x")


@pytest.mark.parametrize("path", ["etc", "./x", "", ".", "..", "a/../b", "~/x"])
def test_canonical_path_relative_input_raises(path: str) -> None:
    with pytest.raises(RelativePathError):
        canonical_path(path)


def test_canonical_path_relative_pathlike_raises() -> None:
    with pytest.raises(RelativePathError):
        canonical_path(Path("etc"))


def test_canonical_path_accepts_pathlike(tmp_path: Path) -> None:
    assert canonical_path(tmp_path) == canonical_path(str(tmp_path))


def test_canonical_path_errors_are_walk_errors() -> None:
    assert issubclass(RelativePathError, WalkError)
    assert issubclass(SymlinkLoopError, WalkError)


# --- canonical_path: generated trees -----------------------------------------

NAMES = ("n0", "n1", "n2", "n3")
ABSENT = "zz"
COMPONENTS = (*NAMES, ABSENT, ".", "..")
MAX_ENTRIES = 10
MAX_LINKS = 5


@dataclass(frozen=True)
class Entry:
    parent: str  # relative to the tree root; "" is the root
    name: str
    kind: str  # "dir" | "file" | "link"
    target: tuple[str, ...] = ()
    absolute: bool = False  # target is the tree root + target, not relative
    trailing_slash: bool = False

    @property
    def rel(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name


@dataclass(frozen=True)
class Case:
    entries: tuple[Entry, ...]
    paths: tuple[tuple[tuple[str, ...], str, bool], ...]  # components, separator, trailing /


@st.composite
def entries(draw: st.DrawFn) -> tuple[Entry, ...]:
    dirs = [""]
    taken: set[str] = set()
    made: list[Entry] = []
    links = 0
    for _ in range(draw(st.integers(1, MAX_ENTRIES))):
        parent = draw(st.sampled_from(dirs))
        name = draw(st.sampled_from(NAMES))
        # Links weigh double: they are what the walk is about.
        kinds = ["dir", "file", "link", "link"] if links < MAX_LINKS else ["dir", "file"]
        kind = draw(st.sampled_from(kinds))
        entry = Entry(parent, name, kind)
        if kind == "link":
            entry = Entry(
                parent,
                name,
                kind,
                target=tuple(draw(st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=3))),
                absolute=draw(st.booleans()),
                trailing_slash=draw(st.booleans()),
            )
        if entry.rel in taken:
            continue
        taken.add(entry.rel)
        made.append(entry)
        links += kind == "link"
        if kind == "dir":
            dirs.append(entry.rel)
    return tuple(made)


def acyclic_hop_bound(tree: tuple[Entry, ...]) -> dict[str, int]:
    """Per name, the most hops a walk can spend on one component of that name without a loop.

    A link's expansion does not depend on what follows it, so meeting the same
    link again inside its own expansion is a loop. Without loops the hops
    behind one component form a tree whose chains repeat no link, whatever
    directory a name happens to be looked up in; this bounds that tree by
    letting each named component of a target be any link of that name.
    """
    links = [e for e in tree if e.kind == "link"]

    def expansion(link: Entry, chain: frozenset[Entry]) -> int:
        inside = chain | {link}
        return 1 + sum(best(part, inside) for part in link.target)

    def best(name: str, chain: frozenset[Entry]) -> int:
        return max(
            (expansion(link, chain) for link in links if link.name == name and link not in chain),
            default=0,
        )

    return {name: best(name, frozenset()) for name in NAMES}


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tree = draw(entries())
    bound = acyclic_hop_bound(tree)
    paths = []
    for _ in range(draw(st.integers(4, 16))):
        parts = draw(st.lists(st.sampled_from(COMPONENTS), max_size=8))
        # GNU realpath -m follows any non-looping chain however long; the
        # kernel, and the walk, stop after MAX_SYMLINK_HOPS. Paths are cut
        # so that no loop-free walk through them can exceed that, which
        # leaves a refusal only where there is a genuine loop.
        spent = 0
        for i, part in enumerate(parts):
            spent += bound.get(part, 0)
            if spent > MAX_SYMLINK_HOPS:
                parts = parts[:i]
                break
        separator = draw(st.sampled_from(["/", "//", "/./"]))
        paths.append((tuple(parts), separator, draw(st.booleans())))
    return Case(tree, tuple(paths))


def build(root: str, tree: tuple[Entry, ...]) -> None:
    for entry in tree:
        where = os.path.join(root, entry.rel)
        if entry.kind == "dir":
            os.mkdir(where)
        elif entry.kind == "file":
            Path(where).write_text("")
        else:
            target = "/".join(entry.target) + ("/" if entry.trailing_slash else "")
            if entry.absolute:
                target = f"{root}/{target}"
            os.symlink(target, where)


def join(root: str, parts: tuple[str, ...], separator: str = "/", trailing: bool = False) -> str:
    text = separator.join((root, *parts))
    return text + "/" if trailing else text


def has_symlink_prefix(path: str) -> bool:
    """Whether some leading part of canonical-looking ``path`` is a symlink."""
    here = ""
    for part in path.split("/")[1:]:
        here += "/" + part
        try:
            mode = os.lstat(here).st_mode
        except OSError:
            return False
        if stat.S_ISLNK(mode):
            return True
    return False


def first_refused_prefix(root: str, parts: tuple[str, ...]) -> int:
    """How many components of ``parts`` it takes for the walk to refuse."""
    for k in range(1, len(parts) + 1):
        try:
            walk(join(root, parts[:k]))
        except SymlinkLoopError:
            return k
    raise AssertionError(f"no prefix of {parts} is refused")


def assert_genuine_loop(link: str) -> None:
    """``link`` must loop, by the kernel's account or by realpath -m's."""
    assert stat.S_ISLNK(os.lstat(link).st_mode), f"refused at {link!r}, which is no symlink"
    if kernel_errno(link) == errno.ELOOP:
        event("loop: kernel ELOOP")
        return
    # The kernel stops at a missing component where the walk, like realpath -m,
    # goes on as text; a loop met after that is visible only to realpath -m.
    try:
        (printed,) = gnu_realpath_m(link, timeout=2.0)
    except subprocess.TimeoutExpired:
        event("loop: realpath -m never returns")
        return
    assert has_symlink_prefix(printed), f"{link!r} was refused; realpath -m gives {printed!r}"
    event("loop: realpath -m leaves a link unresolved")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_canonical_path_agrees_with_realpath_on_generated_trees(case: Case) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        (root,) = gnu_realpath_m(scratch)
        build(root, case.entries)
        resolved: list[str] = []
        refused: list[tuple[str, ...]] = []
        for parts, separator, trailing in case.paths:
            path = join(root, parts, separator, trailing)
            try:
                walk(path)
            except SymlinkLoopError:
                refused.append(parts)
            else:
                resolved.append(path)
        # Only the last component of the shortest refused prefix is new to the
        # walk, so the prefix before it must resolve like realpath -m, and the
        # link that component names must itself loop.
        cut = [(parts, first_refused_prefix(root, parts)) for parts in refused]
        before = [join(root, parts[: k - 1]) for parts, k in cut]
        assert_matches_oracle(*resolved, *before)
        physical = any(canonical_path(p) != os.path.normpath(p) for p in resolved)
        event(f"some path resolves other than lexically: {physical}")
        for (parts, k), prefix in zip(cut, before, strict=True):
            assert_genuine_loop(os.path.join(canonical_path(prefix), parts[k - 1]))
        event(f"some path refused: {bool(refused)}")


# --- is_within and mount_conflict --------------------------------------------


@pytest.mark.parametrize(
    ("path", "ancestor", "expected"),
    [
        ("/h/.ssh", "/h/.ssh", True),
        ("/h/.ssh/id_ed25519", "/h/.ssh", True),
        ("/h/.ssh/a/b/c", "/h/.ssh", True),
        ("/h", "/h/.ssh", False),
        ("/h/.ssh2", "/h/.ssh", False),
        ("/h/.ssh.d/x", "/h/.ssh", False),
        ("/h/.ss", "/h/.ssh", False),
        ("/hx", "/h", False),
        ("/other", "/h/.ssh", False),
        ("/", "/", True),
        ("/h", "/", True),
        ("/h/.ssh/x", "/", True),
        ("/", "/h", False),
    ],
)
def test_is_within_separator_boundaries(path: str, ancestor: str, expected: bool) -> None:
    assert is_within(path, ancestor) is expected


@pytest.mark.parametrize(
    ("mount", "forbidden", "expected"),
    [
        ("/h/.ssh", "/h/.ssh", Conflict.EXACT),
        ("/h/.ssh/id_ed25519", "/h/.ssh", Conflict.DESCENDANT),
        ("/h/.ssh/a/b/c", "/h/.ssh", Conflict.DESCENDANT),
        ("/h", "/h/.ssh", Conflict.PARENT),
        ("/h", "/h/.ssh/a/b", Conflict.PARENT),
        ("/h/.ssh2", "/h/.ssh", None),
        ("/h/.ssh", "/h/.ssh2", None),
        ("/h/.ss", "/h/.ssh", None),
        ("/h/.ssh.d/x", "/h/.ssh", None),
        ("/hx", "/h", None),
        ("/h/work", "/h/.ssh", None),
        ("/", "/", Conflict.EXACT),
        ("/", "/h/.ssh", Conflict.PARENT),
        ("/h/.ssh", "/", Conflict.DESCENDANT),
        ("/etc", "/", Conflict.DESCENDANT),
    ],
)
def test_mount_conflict_classifies(mount: str, forbidden: str, expected: Conflict | None) -> None:
    assert mount_conflict(mount, forbidden) is expected


def test_mount_conflict_parent_is_a_conflict() -> None:
    # Binding $HOME exposes ~/.ssh, so PARENT must be truthy like the others.
    assert mount_conflict("/home/u", "/home/u/.ssh")
    assert mount_conflict("/home/u/.ssh2", "/home/u/.ssh") is None
