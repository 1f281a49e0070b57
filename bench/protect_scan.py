"""What protecting a writable mount costs: the planner's scan of a 10,000-directory tree.

Every turn searches its writable mounts for git directories and protected
names (``target_side.policy.protect.scan``) before it starts. This section
builds a tree of ``DIRS`` directories (a workspace of a few dozen
repositories, each with a few hundred directories of sources and its
``.git``), and times the scan against two baselines walking the same tree in
the same run: ``find -type d`` (C, one process) and ``os.walk``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from bench.common import Samples, ms, ratio, render_table, temp_dir
from target_side.policy.protect import PROTECTED_NAMES, scan
from target_side.policy.reach import Reach

DIRS = 10_000
REPOS = 25
FILES_PER_DIR = 3
AS_A_ROLE = Reach(65534, 65534)
"""As a turn is scanned for: a uid of its own (never root), so each directory is looked at."""


def run(runs: int) -> str:
    with temp_dir("paddock-bench-scan-") as root:
        root.chmod(0o755)  # a workspace its role can enter: else nothing in it is protected
        made = _tree(root)
        find = _time(
            runs,
            lambda: subprocess.run(
                ["find", str(root), "-type", "d"], check=True, stdout=subprocess.DEVNULL
            ),
        )
        walk = _time(runs, lambda: sum(1 for _ in os.walk(root)))
        found = scan([("cwd", str(root))], PROTECTED_NAMES, 100_000, AS_A_ROLE)
        assert len(found.git_dirs) == REPOS, "the scan must find what a turn's would"
        scanned = _time(
            runs, lambda: scan([("cwd", str(root))], PROTECTED_NAMES, 100_000, AS_A_ROLE)
        )
    rows = [
        ("find -type d (baseline)", ms(find.p50), ms(find.p95), "1.00x"),
        ("os.walk", ms(walk.p50), ms(walk.p95), ratio(walk.p50, find.p50)),
        ("paddock protect scan", ms(scanned.p50), ms(scanned.p95), ratio(scanned.p50, find.p50)),
    ]
    title = (
        f"Protected-name scan of one writable mount: {made} directories, {REPOS} repositories "
        f"({len(found.git_dirs)} git directories found, {len(found.read_only)} read-only "
        f"entries, {len(found.audit)} audited paths), {runs} runs"
    )
    return render_table(title, ("what", "p50", "p95", "vs find"), rows)


def _time(runs: int, action: object) -> Samples:
    values = []
    for _ in range(runs):
        started = time.perf_counter()
        action()  # type: ignore[operator]
        values.append(time.perf_counter() - started)
    return Samples(tuple(values))


def _tree(root: Path) -> int:
    """``DIRS`` directories: ``REPOS`` repositories of nested source directories, with files."""
    per_repo = DIRS // REPOS
    made = 0
    for r in range(REPOS):
        repo = root / f"repo{r}"
        git = repo / ".git"
        for sub in ("hooks", "objects", "refs/heads", "info"):
            (git / sub).mkdir(parents=True)
        (git / "config").write_text("[core]\n")
        (git / "HEAD").write_text("ref: refs/heads/main\n")
        made += 6
        for d in range(per_repo - 6):
            here = repo / f"pkg{d % 20}" / f"mod{d}"
            here.mkdir(parents=True, exist_ok=True)
            for f in range(FILES_PER_DIR):
                (here / f"f{f}.py").touch()
            made += 1
    (root / ".bashrc").touch()
    return made + REPOS * 20
