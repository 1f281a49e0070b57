"""Build ``paddock-deploy.pyz``: this package as one file a target's python3 runs.

``paddock deploy`` builds it at deploy time and uploads it; from a checkout,
``PYTHONPATH=deploy python3 -m paddock_deploy.archive [OUT]`` writes one
(default ``deploy/paddock-deploy.pyz``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipapp
from pathlib import Path

from paddock_deploy.protocol import ARCHIVE_NAME

PACKAGE = Path(__file__).resolve().parent
INTERPRETER = "/usr/bin/env python3"
FIXED_MTIME = 315532800
"""1980-01-01, the earliest a zip file can say: the archive does not change with file times."""


def build_archive(out: Path) -> Path:
    """Write the zipapp of this package to ``out`` (a file path) and return it."""
    with tempfile.TemporaryDirectory(prefix="paddock-deploy-pyz-") as staging:
        tree = Path(staging) / PACKAGE.name
        shutil.copytree(PACKAGE, tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        # The package's own __main__ at the top too (zipapp's generated one would drop the
        # exit status).
        shutil.copy(tree / "__main__.py", Path(staging) / "__main__.py")
        for path in (Path(staging), *Path(staging).rglob("*")):
            os.utime(path, (FIXED_MTIME, FIXED_MTIME))
        zipapp.create_archive(staging, out, interpreter=INTERPRETER, compressed=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else PACKAGE.parent / ARCHIVE_NAME
    built = build_archive(out)
    print(f"{built} ({built.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
