"""The multiplexer's two settings: whether ``paddock run`` uses it, and how long it stays idle.

    --no-mux            PADDOCK_NO_MUX=1         run without it (as before it existed)
    --mux-persist DUR   PADDOCK_MUX_PERSIST=DUR  idle time before it exits (default 10m)

DUR is seconds, or a number with ``s``, ``m`` or ``h``. The latest
``paddock run`` sets the daemon's idle time, as each one starts its idle clock.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from agent_side.errors import UsageError

NO_MUX_VARIABLE = "PADDOCK_NO_MUX"
PERSIST_VARIABLE = "PADDOCK_MUX_PERSIST"
DEFAULT_PERSIST_S = 600.0
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m`` or ``1.5h`` as seconds; ``ValueError`` naming the problem."""
    stripped = text.strip().lower()
    scale = _UNITS.get(stripped[-1:]) if stripped else None
    number = stripped[:-1] if scale is not None else stripped
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a duration (seconds, or a number with s, m or h)"
        ) from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{text!r} must be a positive duration")
    return value


def persist_seconds(args: argparse.Namespace, environ: Mapping[str, str]) -> float:
    """``--mux-persist``, else ``PADDOCK_MUX_PERSIST``, else ten minutes."""
    if args.mux_persist is not None:
        return float(args.mux_persist)
    text = environ.get(PERSIST_VARIABLE)
    if not text:
        return DEFAULT_PERSIST_S
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{PERSIST_VARIABLE}: {exc}") from None


def duration_argument(text: str) -> float:
    """argparse's type for ``--mux-persist``."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
