"""Every turn starts with every signal at its default action and none blocked, whatever its
starter inherited.

An ignored signal survives exec, and so does the mask of blocked ones; a
handled signal does not. A server (or the launcher) started as a shell's
background job ignores SIGINT and SIGQUIT, under ``nohup`` SIGHUP; one
started by a program that blocked signals has them blocked. Handed on, a
turn's processes would be deaf to the Ctrl-C forwarded to them. So each, as
it starts and before its first thread, keeps what it inherited to itself
(``stop_passing_on_inherited``): a signal inherited ignored, or blocked with
an action that ends the process, gets a handler that does nothing, and the
mask is emptied. The process itself shrugs them off as before; nothing it
starts inherits either. A signal ignored at a launch all the same (set
later, or a job-control signal, which stays ignored here) is reset by
``env --default-signal`` before bubblewrap: an extra program each such
turn, 0.17-0.2 ms of a ``true`` turn (1.03x, 500 alternated turns, with
SIGQUIT ignored).

Standard library only: the privileged launcher imports it too.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half: no stub in typeshed
import signal
from collections.abc import Callable
from types import FrameType

RESTORED_BY_SPAWN = frozenset({signal.SIGPIPE, signal.SIGXFSZ})
"""Ignored by Python itself, and put back to their defaults in every child it spawns."""
CATCHABLE = tuple(
    int(s)
    for s in signal.valid_signals()
    if s not in (signal.SIGKILL, signal.SIGSTOP, *RESTORED_BY_SPAWN)
)
Handler = Callable[[int, FrameType | None], None] | signal.Handlers
HARMLESS = frozenset({signal.SIGCHLD, signal.SIGURG, signal.SIGWINCH, signal.SIGCONT})
"""Signals whose default action ends nothing: unblocked, they need no handler."""
JOB_CONTROL = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
"""Ignored where they were ignored or blocked, never caught: caught, a background process
writing to its terminal (under ``stty tostop``) would have each write interrupted again and
again, not let through."""


def any_ignored() -> bool:
    """Whether a signal a child would inherit ignored is ignored here now.

    A microsecond: ``signal.getsignal`` would make an enum of every answer.
    """
    return _signal.SIG_IGN in map(_signal.getsignal, CATCHABLE)


def stop_passing_on_inherited() -> list[int]:
    """Signals inherited ignored or blocked, still shrugged off here but handed to nothing
    started from now on (main thread, at start, before any other thread): those changed."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    changed = []
    for signum in CATCHABLE:
        kept = _kept_to_itself(signum, _signal.getsignal(signum), signum in blocked)
        if kept is not None:
            signal.signal(signum, kept)
            changed.append(signum)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    return changed


def _kept_to_itself(signum: int, action: object, blocked: bool) -> Handler | None:
    """What ``signum`` does here from now on, so that this process takes it as it did while no
    child inherits that; None: as it is (a handler of the process's own is only unblocked)."""
    if signum in JOB_CONTROL:
        # Ignored where it was blocked (either lets a background write to the terminal through),
        # and reset for each turn by ``env --default-signal``.
        return signal.SIG_IGN if blocked and action == _signal.SIG_DFL else None
    if action == _signal.SIG_IGN:
        return _ignore
    if blocked and action == _signal.SIG_DFL and signum not in HARMLESS:
        return _ignore
    return None


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Ignored, as the process inherited it."""
