"""Operator tools: the ``paddock-target`` command, ``doctor``, config files and TLS material."""
