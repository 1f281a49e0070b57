"""The deploy's steps, one module each, run in ``protocol.STEPS`` order.

Each module's ``run(ctx)`` does its part (registering the undo of every
change with ``ctx.tx``) and returns an ``Outcome``; each says "nothing to do"
when the host already matches.
"""

from __future__ import annotations

from collections.abc import Callable

from paddock_deploy.context import Context, Outcome
from paddock_deploy.protocol import STEPS
from paddock_deploy.steps import (
    config,
    dirs,
    health,
    preflight,
    release,
    restart,
    service,
    switch,
    tls,
    user,
)

Step = Callable[[Context], Outcome]

RUN: dict[str, Step] = {
    "preflight": preflight.run,
    "user": user.run,
    "dirs": dirs.run,
    "release": release.run,
    "tls": tls.run,
    "config": config.run,
    "service": service.run,
    "switch": switch.run,
    "restart": restart.run,
    "health": health.run,
}
if tuple(RUN) != STEPS:
    raise ImportError("paddock_deploy.steps.RUN must list protocol.STEPS in order")
