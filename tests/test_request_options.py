"""The turn a command line asks for (agent_side.request_options)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent_side.cli import build_parser
from agent_side.errors import UsageError
from agent_side.request_options import RequestOptions, request_options
from shared.wire import TurnRequest


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def build(
    *argv: str, environ: dict[str, str] | None = None, local_cwd: str | None = None
) -> TurnRequest:
    return request_options(parse(*argv), environ or {}, local_cwd).request("default")


def test_run_takes_the_command_after_double_dash() -> None:
    request = build("--cwd", "/w", "--", "ls", "-la", "--", "--cwd")
    assert request.argv == ["ls", "-la", "--", "--cwd"]
    assert request.cwd == "/w"


def test_run_takes_a_command_without_double_dash() -> None:
    assert build("make", "-j2").argv == ["make", "-j2"]


def test_flags_map_to_the_request() -> None:
    args = parse(
        "-e", "A=1", "--env", "B=x=y", "-e", "EMPTY=",
        "--read", "/r1", "--read", "/r2", "--write", "/w",
        "--net", "--timeout", "2.5", "--", "true",
    )  # fmt: skip
    request = request_options(args, {}, None).request("builder")
    assert request.role == "builder"
    assert request.env == {"A": "1", "B": "x=y", "EMPTY": ""}
    assert request.fs.read == ["/r1", "/r2"]
    assert request.fs.write == ["/w"]
    assert request.network == "host"
    assert request.limits.wall_s == 2.5
    assert request.cwd is None


def test_defaults_are_no_network_and_no_limits() -> None:
    request = build("--", "true")
    assert request.network == "none"
    assert request.limits.wall_s is None


def test_w_is_cwd_as_docker_spells_it() -> None:
    assert build("-w", "/srv/work", "--", "true").cwd == "/srv/work"


@pytest.mark.parametrize("flag", ["--cwd", "--read", "--write"])
def test_relative_path_refused_for_a_remote_target(flag: str) -> None:
    with pytest.raises(UsageError, match=f"{flag} 'src' is relative; give an absolute path"):
        build(flag, "src", "--", "true")


def test_relative_paths_joined_to_local_cwd_without_normalising() -> None:
    args = ("--cwd", "sub/../x", "--read", "r", "--write", "./w", "--", "true")
    request = build(*args, local_cwd="/home/me/proj")
    # ".." is left for the target's walk, which resolves it physically.
    assert request.cwd == "/home/me/proj/sub/../x"
    assert request.fs.read == ["/home/me/proj/r"]
    assert request.fs.write == ["/home/me/proj/./w"]


def test_local_cwd_is_the_default_cwd() -> None:
    assert build("--", "true", local_cwd="/home/me/proj").cwd == "/home/me/proj"


def test_run_without_command_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="give the command to run after '--'"):
        build("--")


# -- the environment, as docker run takes it ----------------------------------------------


@pytest.mark.parametrize("pair", ["=value", "TWO WORDS=x", ""])
def test_env_entry_needs_a_name(pair: str) -> None:
    with pytest.raises(UsageError, match="give NAME=VALUE, or NAME"):
        build("-e", pair, "--", "true")


def test_env_name_alone_passes_this_shells_value_on() -> None:
    environ = {"API_URL": "https://api.example", "OTHER": "not asked for"}
    assert build("-e", "API_URL", "--", "true", environ=environ).env == {
        "API_URL": "https://api.example"
    }


def test_env_name_alone_that_is_not_set_here_is_left_out() -> None:
    assert build("-e", "NOT_SET_ANYWHERE", "--", "true").env == {}


def test_env_file_lines_then_e_flags_later_wins(tmp_path: Path) -> None:
    env_file = tmp_path / "ci.env"
    env_file.write_text(
        "# a comment\n"
        "\n"
        "A=from-file\n"
        "  B=kept as written, 'quotes' and # too  \n"
        "C=x=y\r\n"
        "PASSED\n"
        "UNSET_HERE\n"
        "LINE=a\u2028b\n"
    )
    request = build(
        "--env-file", str(env_file), "-e", "A=from-flag", "--", "true",
        environ={"PASSED": "through"},
    )  # fmt: skip
    assert request.env == {
        "A": "from-flag",
        "B": "kept as written, 'quotes' and # too  ",
        "C": "x=y",
        "PASSED": "through",
        "LINE": "a\u2028b",
    }


def test_env_file_problems_name_the_file_and_line(tmp_path: Path) -> None:
    env_file = tmp_path / "bad.env"
    env_file.write_text("GOOD=1\nBAD NAME=2\n")
    with pytest.raises(UsageError, match=rf"--env-file {env_file} line 2: give NAME=VALUE"):
        build("--env-file", str(env_file), "--", "true")
    missing = tmp_path / "missing.env"
    with pytest.raises(UsageError, match=rf"cannot read --env-file {missing}"):
        build("--env-file", str(missing), "--", "true")


def test_options_repr_shows_no_env_values() -> None:
    options = RequestOptions(argv=("true",), env={"TOKEN": "s3cret-value"})
    assert "s3cret-value" not in repr(options)
