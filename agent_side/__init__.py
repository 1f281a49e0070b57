"""The agent half of paddock: the ``paddock`` command and its client for a target."""
