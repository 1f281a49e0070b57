"""paddock_deploy.protocol: the one vocabulary the deploy script and ``paddock deploy`` share."""

from __future__ import annotations

import json

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from deploy_support import STEPS

from agent_side import cli
from agent_side.deploy import passed_options, script_options
from agent_side.errors import UsageError
from paddock_deploy import protocol
from paddock_deploy.cli import parser as script_parser


def test_protocol_steps_and_exit_statuses_are_the_documented_ones() -> None:
    assert protocol.STEPS == STEPS
    assert [int(e) for e in protocol.Exit] == [0, 1, 2, 3]


def test_protocol_step_event_counts_from_one_and_rounds_seconds() -> None:
    event = protocol.step_event("dirs", protocol.CHANGED, "made it", 0.123456)
    assert event == {
        "event": "step",
        "index": 3,
        "total": 10,
        "step": "dirs",
        "status": "changed",
        "detail": "made it",
        "seconds": 0.12,
    }
    assert "seconds" not in protocol.step_event("dirs", protocol.STARTED)


@pytest.mark.parametrize(
    ("event", "line"),
    [
        (protocol.step_event("user", protocol.STARTED), "[2/10] user ..."),
        (protocol.step_event("release", protocol.RUNNING, "pip: 5s"), "  release: pip: 5s"),
        (
            protocol.step_event("tls", protocol.UNCHANGED, "nothing to do"),
            "[5/10] tls: nothing to do",
        ),
        (protocol.step_event("config", protocol.FAILED, "boom"), "[6/10] config: FAILED: boom"),
        (protocol.note_event("careful"), "  careful"),
        (protocol.rollback_event("undone: x"), "  rollback: undone: x"),
        (protocol.failure_result("x", "e", rolled_back=True, problems=[], summary="s"), None),
    ],
)
def test_protocol_describe_gives_the_line_a_person_sees(event, line) -> None:
    assert protocol.describe(event) == line


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"detail": "x"}', '{"event": 3}'])
def test_protocol_parse_event_refuses_what_is_not_an_event_line(line) -> None:
    assert protocol.parse_event(line) is None


def test_protocol_parse_event_reads_what_the_script_writes() -> None:
    event = protocol.note_event("hello")
    assert protocol.parse_event(json.dumps(event)) == event


def test_protocol_certificate_sha256_is_the_der_fingerprint() -> None:
    pem = trustme.CA().cert_pem.bytes().decode()
    expected = x509.load_pem_x509_certificate(pem.encode()).fingerprint(hashes.SHA256())
    assert protocol.certificate_sha256("junk\n" + pem) == expected.hex(":").upper()
    with pytest.raises(ValueError, match="not a PEM certificate"):
        protocol.certificate_sha256("no certificate here")


def test_protocol_passed_options_reach_the_script_as_the_agent_gives_them() -> None:
    given = {
        "--listen": ["--listen", "0.0.0.0:9"],
        "--prefix": ["--prefix", "/p"],
        "--state-root": ["--state-root", "/s"],
        "--config-dir": ["--config-dir", "/c"],
        "--user": ["--user", "svc"],
        "--service": ["--service", "supervised"],
        "--bin-dir": ["--bin-dir", "/b"],
        "--workspace": ["--workspace", "/w1", "--workspace", "/w2"],
        "--launcher-socket": ["--launcher-socket", "/r/l.sock"],
        "--tls-host": ["--tls-host", "h1"],
    }
    assert {o.flag for o in protocol.PASSED_OPTIONS} == set(given)
    argv = [arg for args in given.values() for arg in args]
    agent = cli.build_parser().parse_args(["deploy", "root@h", *argv])
    passed = script_options(passed_options(vars(agent)), None)
    script = script_parser().parse_args(["--wheel", "/x.whl", *passed])
    for option in protocol.PASSED_OPTIONS:
        values = given[option.flag][1::2]
        assert getattr(script, option.dest) == (values if option.repeated else values[0])


def test_protocol_passed_options_left_out_are_not_passed_and_defaults_stay_the_scripts() -> None:
    agent = cli.build_parser().parse_args(["deploy", "root@h"])
    assert script_options(passed_options(vars(agent)), None) == ()
    script = script_parser().parse_args(["--wheel", "/x.whl"])
    assert (script.prefix, script.bin_dir, script.service) == (
        "/opt/paddock",
        "/usr/local/bin",
        "auto",
    )


def test_protocol_path_options_must_be_absolute_on_the_agent_side_too() -> None:
    for option in protocol.PASSED_OPTIONS:
        if option.path:
            with pytest.raises(UsageError, match="absolute path on the target"):
                script_options([(option.flag, "relative/dir")], None)
    with pytest.raises(UsageError, match="--fail-at 'nope'"):
        script_options([], "nope")
