"""Exit statuses shared by turn results and the agent CLI (same convention as ``timeout``)."""

from enum import IntEnum


class ExitStatus(IntEnum):
    """The statuses paddock itself assigns; 0..123 belong to the command."""

    TIMED_OUT = 124
    PADDOCK_FAILED = 125
    REFUSED = 126
    NOT_FOUND = 127
    SIGNAL_BASE = 128


def for_signal(signum: int) -> int:
    """The status of a turn killed by signal ``signum`` (137 for SIGKILL)."""
    return ExitStatus.SIGNAL_BASE + signum


def signal_of(status: int) -> int | None:
    """The signal number a status of 129..192 stands for, else None."""
    n = status - ExitStatus.SIGNAL_BASE
    return n if 1 <= n <= 64 else None


def is_exit_status(status: int) -> bool:
    """Whether ``status`` is something a process can exit with (0..255)."""
    return 0 <= status <= 255
