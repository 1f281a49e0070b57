"""The fence: what touches the system to make a plan real.

Held paths, bubblewrap's command line, the running process, limits, the filter.
"""
