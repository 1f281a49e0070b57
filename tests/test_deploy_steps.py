"""The deploy's parts that need no deployed host: the step table, running commands with a
heartbeat, the progress output, the command link and its undo, releases to prune."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from deploy_support import STEPS

from paddock_deploy import protocol
from paddock_deploy.commands import run
from paddock_deploy.context import Context
from paddock_deploy.errors import DeployError, Interrupted
from paddock_deploy.progress import Progress
from paddock_deploy.steps import RUN
from paddock_deploy.steps.preflight import interpreter_hidden_from_others
from paddock_deploy.steps.release import RELEASE_MARKER, releases_to_prune
from paddock_deploy.steps.switch import link_command


def test_steps_run_one_module_per_step_in_protocol_order() -> None:
    assert tuple(RUN) == STEPS
    assert [RUN[s].__module__ for s in STEPS] == [f"paddock_deploy.steps.{s}" for s in STEPS]


# --- commands and progress ------------------------------------------------------------------


def test_commands_run_beats_while_a_command_runs() -> None:
    beats: list[float] = []
    done = run(["sh", "-c", "sleep 1; echo done"], waiting=beats.append, every=0.2)
    assert done.stdout == "done\n"
    assert beats and beats == sorted(beats)  # at least one beat, each later than the last


def test_commands_run_kills_the_command_when_the_heartbeat_cannot_be_delivered(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "pid"

    def lost(_seconds: float) -> None:
        raise Interrupted("the output channel went away")

    with pytest.raises(Interrupted):
        run(["sh", "-c", f"echo $$ > {pid_file}; exec sleep 30"], waiting=lost, every=0.2)
    assert not Path(f"/proc/{pid_file.read_text().strip()}").exists()


def test_commands_run_says_which_command_did_not_finish_in_time() -> None:
    with pytest.raises(DeployError, match="sleep 30 did not finish within 1s"):
        run(["sleep", "30"], timeout=1)


def test_progress_lines_for_a_person_and_heartbeats_only_inside_a_step() -> None:
    out = io.StringIO()
    progress = Progress(False, out)
    beat = progress.waiting("pip install")
    beat(5.0)  # between steps: nothing to say
    progress.started("release")
    beat(5.0)
    progress.finished("release", True, "built", 12.0)
    assert out.getvalue().splitlines() == [
        "[4/10] release ...",
        "  release: pip install: still running after 5s",
        "[4/10] release: built",
    ]


def test_progress_json_lines_and_a_lost_channel_interrupts() -> None:
    out = io.StringIO()
    progress = Progress(True, out)
    progress.started("user")
    assert json.loads(out.getvalue()) == protocol.step_event("user", "started")
    out.close()
    with pytest.raises(Interrupted, match="output channel went away"):
        progress.finished("user", False, "nothing to do", 0.1)
    progress.note("a warning need not arrive")  # no exception
    assert progress.lost


# --- the command link (step switch) -----------------------------------------------------------


def _context(tmp_path: Path) -> tuple[Context, io.StringIO]:
    out = io.StringIO()
    opts = argparse.Namespace(prefix=str(tmp_path / "opt"), bin_dir=str(tmp_path / "bin"))
    (tmp_path / "bin").mkdir()
    return Context(opts, Progress(False, out)), out


def test_switch_links_the_command_and_the_undo_removes_it(tmp_path: Path) -> None:
    ctx, _ = _context(tmp_path)
    said = link_command(ctx)
    link = tmp_path / "bin" / "paddock-target"
    assert os.readlink(link) == str(tmp_path / "opt" / "current" / "bin" / "paddock-target")
    assert said == f"{link} -> {os.readlink(link)}"
    assert link_command(ctx) is None  # nothing to do the second time
    assert ctx.tx.roll_back(lambda _: None) == []
    assert not link.is_symlink()


def test_switch_replaces_a_foreign_link_and_the_undo_puts_it_back(tmp_path: Path) -> None:
    ctx, _ = _context(tmp_path)
    link = tmp_path / "bin" / "paddock-target"
    link.symlink_to("/elsewhere/paddock-target")
    assert "(was -> /elsewhere/paddock-target)" in (link_command(ctx) or "")
    ctx.tx.roll_back(lambda _: None)
    assert os.readlink(link) == "/elsewhere/paddock-target"


def test_switch_leaves_a_command_that_is_not_a_link_alone(tmp_path: Path) -> None:
    ctx, out = _context(tmp_path)
    command = tmp_path / "bin" / "paddock-target"
    command.write_text("#!/bin/sh\n")
    assert link_command(ctx) is None
    assert command.read_text() == "#!/bin/sh\n" and not ctx.tx.changed
    assert "is not a symlink, so it is left as it is" in out.getvalue()


# --- releases and the interpreter -------------------------------------------------------------


def test_release_prunes_all_but_two_old_releases(tmp_path: Path) -> None:
    for age, name in enumerate(["a", "b", "c", "d", "current"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / RELEASE_MARKER).write_text(json.dumps({"built_at": 1000 + age}))
    (tmp_path / "half-built").mkdir()  # no marker: removed by the release step, not here
    pruned = releases_to_prune(tmp_path, tmp_path / "current")
    assert sorted(p.name for p in pruned) == ["a", "b"]


def test_preflight_finds_an_interpreter_the_service_user_cannot_reach() -> None:
    # Directly under /tmp, so the private directory is the only one others cannot enter.
    private = Path(tempfile.mkdtemp(prefix="paddock-hidden-", dir="/tmp"))
    try:
        (private / "python3").write_text("")
        assert interpreter_hidden_from_others(private / "python3") == private
        assert interpreter_hidden_from_others(Path("/usr/bin/python3")) is None
    finally:
        shutil.rmtree(private)
