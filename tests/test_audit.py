"""The audit after a turn: what it finds by looking alone is exactly what it would move.

The launcher looks first, as root (``deviations``), and forks a child as the role
to move things aside (``enforce``) only when something is not as planned. Each case
here is one way a protected name can stand after a turn; both must agree on every one,
and looking must change nothing.
"""

from __future__ import annotations

from pathlib import Path

from target_side.fence.audit import QUARANTINE_SUFFIX, deviations, enforce

TURN = "t-0123456789abcdef0123456789abcdef"


def _layout(root: Path) -> dict[str, str | None]:
    """A workspace after a turn, and what its plan expected of each protected name."""
    (root / "git").mkdir()
    (root / "git" / "hooks").mkdir()
    (root / "ok-link").symlink_to("/usr/bin/true")
    (root / "moved-link").symlink_to("/usr/bin/env")
    (root / ".envrc").write_text("echo planted\n")
    (root / ".vscode").mkdir()
    (root / "git" / "hooks" / "pre-commit").symlink_to("/tmp/anything")
    (root / "elsewhere").mkdir()
    (root / "swapped").symlink_to(root / "elsewhere")  # a directory replaced by a link
    (root / "elsewhere" / ".envrc").write_text("never looked at through a link\n")
    return {
        str(root / ".bashrc"): None,  # still absent: as planned
        str(root / "ok-link"): "/usr/bin/true",  # still the same link: as planned
        str(root / "moved-link"): "/usr/bin/true",  # another target: changed
        str(root / ".envrc"): None,  # a file where nothing was: appeared
        str(root / ".vscode"): None,  # a directory where nothing was: appeared
        str(root / "git" / "hooks" / "pre-commit"): None,  # a link where nothing was
        str(root / "swapped" / ".envrc"): None,  # below a link: never followed
        str(root / "gone" / ".envrc"): None,  # below what no longer exists
    }


NOT_AS_PLANNED = {"moved-link", ".envrc", ".vscode", "git/hooks/pre-commit"}


def test_deviations_name_exactly_what_enforce_moves_and_change_nothing(tmp_path: Path) -> None:
    expected = _layout(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    found = deviations(expected)
    assert sorted(found) == sorted(str(tmp_path / name) for name in NOT_AS_PLANNED)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "looking changed something"
    moved = enforce(expected, TURN)
    assert len(moved) == len(NOT_AS_PLANNED)
    for name in NOT_AS_PLANNED:
        path = tmp_path / name
        assert not path.is_symlink() and not path.exists(), name
        assert path.with_name(f"{path.name}{QUARANTINE_SUFFIX}{TURN}").is_symlink() or (
            path.with_name(f"{path.name}{QUARANTINE_SUFFIX}{TURN}").exists()
        ), name
    assert (tmp_path / "elsewhere" / ".envrc").exists(), "the audit followed a link"
    assert deviations(expected) == [], "moved aside, yet still found"


def test_a_clean_workspace_has_nothing_to_look_at_twice(tmp_path: Path) -> None:
    (tmp_path / "ok-link").symlink_to("/usr/bin/true")
    expected: dict[str, str | None] = {
        str(tmp_path / ".bashrc"): None,
        str(tmp_path / "ok-link"): "/usr/bin/true",
    }
    assert deviations(expected) == []
    assert enforce(expected, TURN) == []
