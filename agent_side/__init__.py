"""The agent half of paddock: the ``paddock`` command and its client for a target.

``Target`` and ``AsyncTarget`` (from ``agent_side.api``) run turns from Python
code with the same semantics as ``paddock run``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_side.api import AsyncTarget, RunResult, Target

__all__ = ["AsyncTarget", "RunResult", "Target"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so ``python -m agent_side.cli`` pays only for what it runs.
    if name in __all__:
        from agent_side import api

        return getattr(api, name)
    raise AttributeError(f"module 'agent_side' has no attribute {name!r}")
