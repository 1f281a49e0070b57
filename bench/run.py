"""Run paddock's benchmarks and print their tables.

    .venv/bin/python bench/run.py [--quick] [--full] [--only latency|throughput|memory|resume ...]

Every ratio is against a baseline measured in the same run, on the same machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
