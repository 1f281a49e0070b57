"""The contract both halves of paddock share: wire models, exit statuses, the walk.

Nothing here imports ``agent_side`` or ``target_side``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("paddock")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0+unknown"
