"""The root of every exception paddock raises on purpose.

    PaddockError
     ├── shared.walk.WalkError
     │    ├── RelativePathError      an absolute path was required
     │    └── SymlinkLoopError       more than 40 symlinks on one walk
     ├── target_side.errors.TargetError   (and its subclasses)
     └── agent_side.errors.AgentError     (and its subclasses)

Each package derives its own base from this one, so a caller can catch
"anything paddock meant to raise" without catching programming errors.
"""


class PaddockError(Exception):
    """Something paddock detected and reported on purpose."""
