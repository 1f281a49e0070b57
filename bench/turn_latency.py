"""Turn latency only: ``python bench/turn_latency.py [--quick]`` is ``run.py --only latency``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], "--only", "latency"]))
