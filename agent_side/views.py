"""How the ``paddock`` command shows what the target answered.

Nearly everything printed here came from the target, so control characters
are made visible before they reach a terminal: a target must not be able to
drive it (escape sequences, fake lines).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # For annotations only: ``say`` is all a fast ``paddock run`` needs from here.
    from collections.abc import Mapping

    from shared.wire import PlanResult, Refusal, Session, Turn


def print_plan(result: PlanResult, *, as_json: bool) -> int:
    """Print a plan; returns 0 if the turn would launch, else the refusal's exit status."""
    if as_json:
        print(result.model_dump_json())
        return result.exit_code
    if result.refusal is not None:
        say(refusal_sentence(result.refusal))
        return result.exit_code
    fence = result.fence
    if fence is None:
        return result.exit_code
    _line(f"backend     {fence.backend}")
    _line(f"argv        {' '.join(fence.argv)}")
    exe = fence.executable
    _line(f"executable  {exe.path} (dev {exe.dev}, ino {exe.ino})")
    _line(f"cwd         {fence.cwd}")
    _line(f"uid         {fence.uid}")
    _line(f"network     {'host' if fence.network else 'none'}")
    limits = fence.limits
    _line(
        f"limits      wall {limits.wall_s:g}s, memory {limits.memory_mb} MB, pids {limits.pids}, "
        f"cpu {limits.cpu:g}, output {limits.output_mb} MB"
    )
    _line(f"env         {' '.join(fence.env_names)}")
    _line("mounts")
    for mount in fence.mounts:
        where = mount.dest if mount.source == mount.dest else f"{mount.dest} <- {mount.source}"
        _line(f"  {mount.kind:<7} {where}  [{mount.subject}]")
    return 0


def print_turns(turns: list[Turn], *, as_json: bool) -> int:
    """Print turns as a table (or JSON lines), newest first."""
    if as_json:
        for turn in turns:
            print(turn.model_dump_json())
        return 0
    rows = [("TURN", "ROLE", "STATE", "EXIT", "CREATED", "WALL")]
    for turn in turns:
        wall = f"{turn.usage.wall_s:.2f}s" if turn.usage is not None else "-"
        exit_code = "-" if turn.exit_code is None else str(turn.exit_code)
        created = turn.created_at.strftime("%Y-%m-%d %H:%M:%S")
        rows.append((turn.turn_id, turn.role, turn.state, exit_code, created, wall))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        _line(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0


def print_sessions(sessions: list[Session], *, as_json: bool) -> int:
    """Print sessions as a table (or JSON lines), newest first."""
    if as_json:
        for session in sessions:
            print(session.model_dump_json())
        return 0
    rows = [("SESSION", "ROLE", "STATE", "TURNS", "CREATED", "NOW / WHY ENDED")]
    for session in sessions:
        created = session.created_at.strftime("%Y-%m-%d %H:%M:%S")
        now = f"running {session.turn_id}" if session.turn_id else "idle"
        said = now if session.state == "open" else (session.ended or "")
        if session.refusal is not None:
            said = f"{session.refusal.rule} ({session.refusal.subject})"
        rows.append(
            (session.session_id, session.role, session.state, str(session.turns), created, said)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        _line(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0


CLI_FIXES: dict[tuple[str, str], str] = {
    ("network-not-allowed", "network"): (
        "drop --net, or have the operator set allow_network for the role"
    ),
    ("bad-mount", "cwd"): "create it on the target, or give --cwd an existing directory",
    ("bad-mount", "fs.write"): "create it on the target, or give --write an existing directory",
    ("bad-mount", "fs.read"): "create it on the target, or give --read an existing path",
    ("limit-exceeds-role", "limits.wall_s"): "give a lower --timeout, or none",
}
"""The fix in the command line's words, by (rule, request field): the target speaks the wire's."""


def refusal_sentence(refusal: Refusal, fixes: Mapping[tuple[str, str], str] = CLI_FIXES) -> str:
    """``refused (RULE, SUBJECT): DETAIL``, naming the path and what it resolved to.

    Where the caller has its own words for the fix (the command line's ``drop
    --net`` rather than ``ask for network "none"``), they replace the target's.
    """
    detail = refusal.detail.strip().rstrip(".")
    fix = fixes.get((refusal.rule, refusal.subject.partition("[")[0]))
    if fix is not None:
        # A refusal's detail reads "what is wrong; what to change": keep the what.
        detail = f"{detail.partition('; ')[0]}; {fix}"
    where = _refused_path(refusal.path, refusal.resolved)
    return f"refused ({refusal.rule}, {refusal.subject}): {detail}{where}."


def _refused_path(path: str | None, resolved: str | None) -> str:
    if path and resolved and path != resolved:
        return f" (path {path} resolves to {resolved})"
    if path or resolved:
        return f" (path {path or resolved})"
    return ""


def say(message: str) -> None:
    """One ``paddock: ...`` line on stderr, control characters made visible."""
    print(f"paddock: {visible(message)}", file=sys.stderr, flush=True)


def visible(text: str) -> str:
    """``text`` with every non-printable character shown as its escape."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _line(text: str) -> None:
    sys.stdout.write(visible(text) + "\n")
