"""The contract both halves of paddock share: wire models, exit statuses, the walk.

Nothing here imports ``agent_side`` or ``target_side``.
"""

__version__ = "0.1.0"
