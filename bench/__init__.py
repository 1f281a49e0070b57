"""paddock benchmarks: `python bench/run.py` from the repository root (see README.md)."""
