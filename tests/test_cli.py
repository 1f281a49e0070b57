"""The ``paddock`` command line (agent_side.cli): parsing, usage errors, how failures are told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trustme
from conftest import BUILDER_TOKEN, Target
from scripted_server import TOKEN, Scripted, closed_port, reply_json

from agent_side import cli

pytestmark = pytest.mark.usefixtures("no_paddock_env")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "required: COMMAND"),
        (["run", "--bogus", "--", "true"], "unrecognized arguments: --bogus"),
        (["run", "--timeout", "0", "--", "true"], "positive number of seconds"),
        (["run", "--timeout", "soon", "--", "true"], "not a number of seconds"),
        (["kill", "t-1", "--signal", "STOP"], "invalid choice: 'STOP'"),
    ],
)
def test_usage_errors_exit_125(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 125
    captured = capsys.readouterr()
    assert captured.err.startswith("paddock: usage: ")
    assert says in captured.err
    assert captured.out == ""


def test_help_and_version_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert cli.main(["--version"]) == 0
    assert "paddock" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "-it", "--", "python3"],
        ["run", "-ti", "--", "python3"],
        ["run", "--cwd", "/w", "-it", "python3"],
        ["run", "--tty", "--", "python3"],
    ],
)
def test_docker_it_asks_run_for_a_terminal(argv: list[str]) -> None:
    parser = cli.build_parser("run")
    args = cli._terminal_options(parser, argv, parser.parse_args(argv))
    assert args.tty
    assert args.identity == [] and args.target_name is None  # not -i t, not -t i
    assert args.command[-1] == "python3"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "-i", "--", "python3"], "-i names an SSH key"),
        (["plan", "-it", "--", "bash"], "only paddock run (and shell) runs on a terminal"),
        (["run", "-it", "--json", "--local", "--", "true"], "--json and --tty"),
    ],
)
def test_terminal_flags_where_they_mean_nothing_say_so(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 125
    err = capsys.readouterr().err
    assert says in err
    assert "no such key file" not in err and "no stored target" not in err


@pytest.mark.parametrize("argv", [["run", "--", "ls", "-it"], ["run", "ls", "-it"]])
def test_it_inside_the_command_belongs_to_the_command(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 125  # for want of a target, not because of -it
    err = capsys.readouterr().err
    assert "no target" in err
    assert "terminals" not in err


def test_json_mode_errors_are_one_json_object_on_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"https://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    assert cli.main(["run", "--json", "--target", url, "--role", "r", "--", "true"]) == 125
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    record = json.loads(line)
    assert record["error"] == "target unreachable"
    assert record["message"].startswith(f"cannot connect to {url}/v1/turns")
    assert record["exit_code"] == 125
    assert captured.err.startswith("paddock: target unreachable: ")
    assert TOKEN not in captured.out + captured.err


def test_json_mode_usage_errors_are_json_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--json", "--timeout", "0", "--", "true"]) == 125
    record = json.loads(capsys.readouterr().out)
    assert record["error"] == "usage"
    assert "positive number of seconds" in record["message"]


def test_run_against_a_closed_port_exits_125_target_unreachable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"https://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    assert cli.main(["run", "--target", url, "--role", "r", "--", "true"]) == 125
    err = capsys.readouterr().err
    assert err.startswith(f"paddock: target unreachable: cannot connect to {url}/v1/turns")
    assert "check the target is running" in err
    assert TOKEN not in err


def test_run_against_an_untrusted_certificate_exits_125_tls_failure(
    tls_scripted: Scripted,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    monkeypatch.setenv("PADDOCK_TOKEN", TOKEN)
    argv = ["run", "--target", tls_scripted.url, "--cacert", str(other_ca), "--role", "r"]
    assert cli.main([*argv, "--", "true"]) == 125
    err = capsys.readouterr().err
    assert err.startswith(f"paddock: TLS failure: TLS handshake with {tls_scripted.url}")
    assert "certificate not trusted" in err
    assert "check --cacert / PADDOCK_CACERT" in err
    assert tls_scripted.seen == []


def test_run_with_http_for_an_https_target_says_so(
    target: Target, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PADDOCK_TOKEN", BUILDER_TOKEN)
    plain = target.url.replace("https://", "http://")
    assert cli.main(["run", "--target", plain, "--", "true"]) == 125
    err = capsys.readouterr().err
    where = plain.removeprefix("http://")
    assert err.startswith(f"paddock: wrong scheme: {where} speaks HTTPS, not plain HTTP")


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_health_prints_json_with_or_without_json_flag(
    tls_scripted: Scripted,
    scripted_ca: trustme.CA,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
) -> None:
    ca_file = tmp_path / "ca.pem"
    scripted_ca.cert_pem.write_to_path(str(ca_file))
    body = {"status": "degraded", "causes": [], "version": "0.1.0", "backend": "none"}
    tls_scripted.routes["GET", "/v1/health"] = lambda h, s: reply_json(h, 200, body)
    argv = ["health", *flags, "--target", tls_scripted.url, "--cacert", str(ca_file)]
    assert cli.main(argv) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "degraded"
    assert "authorization" not in {k.lower() for k in tls_scripted.seen[0].headers}


def _help(parser: cli.CommandParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ended:
        parser.parse_args(argv)
    assert ended.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", [entry[0] for entry in cli._SUBCOMMANDS])
def test_the_parser_for_one_command_knows_every_option_of_it(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fast path registers only the command being run: it must lose none of its options.
    whole = _help(cli.build_parser(), [name, "--help"], capsys)
    alone = _help(cli.build_parser(name), [name, "--help"], capsys)
    assert alone == whole
    assert whole.count("\n") > 3


def test_a_command_that_is_none_of_them_is_told_every_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["rum", "--", "true"]) == 125
    err = capsys.readouterr().err
    assert "invalid choice: 'rum'" in err
    assert all(f"'{name}'" in err for name, _, _ in cli._SUBCOMMANDS)
