"""Signalling a fence's pid namespace from the host never reaches beyond the fence."""

from __future__ import annotations

import os

from target_side.fence.pidns import pid_namespace, signal_namespace


def test_the_servers_own_pid_namespace_is_never_signalled_as_a_fence() -> None:
    # Signal 0 only checks that a process can be signalled: counting them harms nothing.
    own = pid_namespace(os.getpid())
    assert own is not None
    assert signal_namespace(own, None, 0) == 0


def test_an_unknown_namespace_signals_nothing() -> None:
    assert signal_namespace(None, None, 0) == 0
