"""Every turn starts with every signal at its default action, whatever its starter inherited.

An ignored signal survives exec, a handled one does not. A server (or the
launcher) started as a background job ignores SIGINT and SIGQUIT, under
``nohup`` SIGHUP: handed on, a turn's processes would be deaf to the Ctrl-C
forwarded to them. So each, as it starts, keeps ignoring what it inherited
ignored with a handler that does nothing (``stop_passing_on_ignored``): the
same to the process itself, and nothing its children inherit. A signal that
is ignored at a launch all the same (set later, or one of the job-control
signals left alone here) is reset by ``env --default-signal`` before
bubblewrap: an extra program each such turn, 0.17-0.2 ms of a ``true`` turn
(1.03x, 500 alternated turns, with SIGQUIT ignored).

Standard library only: the privileged launcher imports it too.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half: no stub in typeshed
import signal
from types import FrameType

RESTORED_BY_SPAWN = frozenset({signal.SIGPIPE, signal.SIGXFSZ})
"""Ignored by Python itself, and put back to their defaults in every child it spawns."""
CATCHABLE = tuple(
    int(s)
    for s in signal.valid_signals()
    if s not in (signal.SIGKILL, signal.SIGSTOP, *RESTORED_BY_SPAWN)
)
JOB_CONTROL = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
"""Left ignored where they are: caught instead, a background process writing to its terminal
(under ``stty tostop``) would have each write interrupted again and again, not let through."""


def any_ignored() -> bool:
    """Whether a signal a child would inherit ignored is ignored here now.

    A microsecond: ``signal.getsignal`` would make an enum of every answer.
    """
    return _signal.SIG_IGN in map(_signal.getsignal, CATCHABLE)


def stop_passing_on_ignored() -> list[int]:
    """Ignore each inherited-ignored signal through a handler that does nothing instead (main
    thread, at start): the signals so changed."""
    changed = []
    for signum in CATCHABLE:
        if signum not in JOB_CONTROL and _signal.getsignal(signum) == _signal.SIG_IGN:
            signal.signal(signum, _ignore)
            changed.append(signum)
    return changed


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Ignored, as the process inherited it."""
