"""The turn a command line asks for: its command, cwd, environment, paths, network and time.

Read before any connection is made, so a mistake costs nothing. The
environment follows ``docker run``: ``--env-file F`` lines first, then each
``-e``, a later value winning; ``-e NAME`` (and a bare ``NAME`` line) passes
this process's value through, and is left out when it is not set here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from agent_side.errors import UsageError

if TYPE_CHECKING:
    from shared.wire import TurnRequest


class RequestOptions(NamedTuple):
    """Everything of a TurnRequest but the role, which may take asking the target.

    A NamedTuple, not a dataclass, for the same reason as ``connection.Connection``.
    """

    argv: tuple[str, ...]
    cwd: str | None = None
    env: Mapping[str, str] = MappingProxyType({})
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    network: bool = False
    wall_s: float | None = None
    lease: tuple[str, str, int] | None = None
    """(lease id, seat, generation) the turn acts under (``paddock run --lease ID``)."""
    session: str | None = None
    """Run in this session's shell: its fence, so none of the fields above but argv and wall_s."""

    def __repr__(self) -> str:  # the names of the variables, never their values
        return (
            f"RequestOptions(argv={self.argv!r}, cwd={self.cwd!r}, env={sorted(self.env)!r}, "
            f"read={self.read!r}, write={self.write!r}, network={self.network!r}, "
            f"wall_s={self.wall_s!r}, lease={self.lease!r}, session={self.session!r})"
        )

    def request(self, role: str) -> TurnRequest:
        """The TurnRequest for ``role``; what the contract rejects is a ``UsageError``."""
        # The wire models (pydantic) are loaded only here: a run through the
        # multiplexer hands these options over and never builds a request itself.
        from agent_side.turns import new_request

        return new_request(
            role=role,
            argv=self.argv,
            cwd=self.cwd,
            env=self.env,
            read=self.read,
            write=self.write,
            network=self.network,
            wall_s=self.wall_s,
            lease=self.lease,
            session=self.session,
        )


def request_options(
    args: argparse.Namespace, environ: Mapping[str, str], local_cwd: str | None
) -> RequestOptions:
    """What ``args`` asks of the turn.

    ``local_cwd`` is set only for ``--local``: relative paths then mean paths
    on this machine and are joined to it (not normalised: the target's walk
    resolves ``..`` physically). For a remote target they are an error.
    """
    argv = list(args.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("give the command to run after '--', e.g. paddock run -- make test")
    session = getattr(args, "session", None)
    if session is not None:
        _refuse_fence_options(args, local_cwd)
        return RequestOptions(
            argv=tuple(argv), wall_s=args.timeout, lease=_lease(args, environ), session=session
        )
    cwd = _target_path(args.cwd, "--cwd", local_cwd) if args.cwd else local_cwd
    return RequestOptions(
        argv=tuple(argv),
        cwd=cwd,
        env=environment(args.env_file, args.env, environ),
        read=tuple(_target_path(p, "--read", local_cwd) for p in args.read),
        write=tuple(_target_path(p, "--write", local_cwd) for p in args.write),
        network=args.net,
        wall_s=args.timeout,
        lease=_lease(args, environ),
    )


def _lease(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str, int] | None:
    """The lease ``--lease ID`` names, as ``paddock lease take`` kept it in this user's files."""
    lease_id = getattr(args, "lease", None)
    if not lease_id:
        return None
    from agent_side.leases import stored_ref

    return stored_ref(lease_id, environ)


def fence_options(
    args: argparse.Namespace, environ: Mapping[str, str], local_cwd: str | None
) -> RequestOptions:
    """What ``args`` asks of a fence with no command yet (``paddock session start``)."""
    cwd = _target_path(args.cwd, "--cwd", local_cwd) if args.cwd else local_cwd
    return RequestOptions(
        argv=(),
        cwd=cwd,
        env=environment(args.env_file, args.env, environ),
        read=tuple(_target_path(p, "--read", local_cwd) for p in args.read),
        write=tuple(_target_path(p, "--write", local_cwd) for p in args.write),
        network=args.net,
        wall_s=args.timeout,
        lease=_lease(args, environ),
    )


def _refuse_fence_options(args: argparse.Namespace, local_cwd: str | None) -> None:
    """A turn in a session gets the session's fence: say which option would try to change it."""
    if local_cwd is not None:
        raise UsageError("--session with --local: a session lives on a target, not in one run")
    given = [
        flag
        for flag, value in (
            ("--cwd", args.cwd),
            ("-e/--env", args.env),
            ("--env-file", args.env_file),
            ("--write", args.write),
            ("--read", args.read),
            ("--net", args.net),
        )
        if value
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)}: a turn in a session runs in the session's fence; give these "
            "to paddock session start (and use cd or export in the session)"
        )


def _target_path(path: str, flag: str, local_cwd: str | None) -> str:
    if path.startswith("/"):
        return path
    if local_cwd is None:
        raise UsageError(
            f"{flag} {path!r} is relative; give an absolute path on the target "
            "(relative paths are accepted only with --local)"
        )
    return os.path.join(local_cwd, path)


def environment(
    env_files: Sequence[str], pairs: Sequence[str], environ: Mapping[str, str]
) -> dict[str, str]:
    """The turn's variables: each ``--env-file`` in order, then each ``-e``; later wins."""
    env: dict[str, str] = {}
    for path in env_files:
        for number, line in _env_file_lines(path):
            _add(env, line, environ, f"--env-file {path} line {number}")
    for pair in pairs:
        _add(env, pair, environ, f"-e {pair!r}")
    return env


def _add(env: dict[str, str], entry: str, environ: Mapping[str, str], where: str) -> None:
    name, sep, value = entry.partition("=")
    if not name or any(c.isspace() for c in name):
        raise UsageError(f"{where}: give NAME=VALUE, or NAME to pass this shell's value on")
    if sep:
        env[name] = value
    elif name in environ:
        env[name] = environ[name]


def _env_file_lines(path: str) -> list[tuple[int, str]]:
    """An env file's entries with their line numbers; blank lines and ``#`` comments skipped."""
    try:
        with open(path, encoding="utf-8-sig") as source:
            text = source.read()
    except OSError as exc:
        raise UsageError(f"cannot read --env-file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"--env-file {path} is not UTF-8 text") from exc
    entries = []
    # Only \n ends a line (\r\n too): a value may hold any other character.
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.removesuffix("\r").lstrip()
        if line and not line.startswith("#"):
            entries.append((number, line))
    return entries
