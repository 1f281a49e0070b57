"""Policy: pure planning, from a request and the target's own config to a fence plan or a refusal.

Nothing here changes the machine; it only looks (``stat``, ``readlink``).
"""
