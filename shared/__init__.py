"""The contract both halves of paddock share: wire models, exit statuses, the walk.

Nothing here imports ``agent_side`` or ``target_side``.
"""

from __future__ import annotations

import functools


def __getattr__(name: str) -> str:
    # Looked up on first use: importlib.metadata costs ~30 ms, which every start of
    # the ``paddock`` command would otherwise pay for a string it rarely prints.
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'shared' has no attribute {name!r}")


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("paddock")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "0.0.0+unknown"
