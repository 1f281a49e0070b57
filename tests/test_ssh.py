"""Turns through SSH: a real OpenSSH sshd on 127.0.0.1, a real target behind it, no mocks.

The target listens on plain HTTP on loopback (as a deployed one does behind
SSH); the only way the client reaches it is through the sshd. Each test says
whether it drives the ``paddock`` CLI (a subprocess, as a user would) or the
Python API (``agent_side.Target``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from conftest import (
    BUILDER_TOKEN,
    make_settings,
    processes_with,
    stop_session_muxes,
    wait_until,
)
from conftest import Target as TlsTarget
from sshd import CLIENT_PASSPHRASE, SSHD, Sshd, free_port, keygen

from agent_side import AsyncTarget, Target
from agent_side.errors import (
    HostKeyChanged,
    HostKeyUnknown,
    SshAuthFailed,
    TargetUnreachable,
    TlsFailure,
    UsageError,
    WrongScheme,
)
from shared.walk import canonical_path
from target_side.service.server import ServerThread

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not os.path.exists(SSHD), reason="needs OpenSSH's sshd")


@dataclass(frozen=True)
class Listener:
    """A target on plain HTTP at 127.0.0.1, reachable from here only through the sshd."""

    url: str
    workspace: Path


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    with Sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture(scope="module")
def known_hosts(sshd: Sshd, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sshd.write_known_hosts(tmp_path_factory.mktemp("known") / "known_hosts")


@pytest.fixture(scope="module")
def listener(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Listener]:
    root = Path(canonical_path(tmp_path_factory.mktemp("ssh-target")))
    settings = make_settings(root, ca)
    plain = settings.server.model_copy(update={"tls_cert": None, "tls_key": None})
    with ServerThread(settings.model_copy(update={"server": plain})) as server:
        try:
            yield Listener(server.url, root / "ws")
        finally:
            stop_session_muxes()


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home and no agent: only what a test names is trusted or offered."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without paddock or ssh-agent settings, and ``home`` as HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDOCK_", "SSH_"))}
    env |= {
        "PYTHONPATH": str(REPO),
        "HOME": str(home),
        "PADDOCK_TOKEN": BUILDER_TOKEN,
        "PADDOCK_ROLE": "builder",
    }
    return env | extra


def paddock(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CLI, *args],
        env=cli_env(home, **env),
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def via_ssh(
    sshd: Sshd, known_hosts: Path | None, listener: Listener, key: Path | None = None
) -> list[str]:
    args = ["--ssh", sshd.destination, "-i", str(key or sshd.client_key), "--target", listener.url]
    return args if known_hosts is None else [*args, "--known-hosts", str(known_hosts)]


def open_ssh(sshd: Sshd, known_hosts: Path, url: str, **options: object) -> Target:
    options.setdefault("identity_files", [str(sshd.client_key)])
    return Target.ssh(
        sshd.destination,
        token=BUILDER_TOKEN,
        url=url,
        role="builder",
        known_hosts=[str(known_hosts)],
        **options,
    )


# -- the CLI over the tunnel ------------------------------------------------------------


def test_ssh_cli_run_passes_output_and_exit_status_through(
    sshd, known_hosts, listener, home
) -> None:
    before = sshd.accepted_logins()
    result = paddock(
        "run",
        *via_ssh(sshd, known_hosts, listener),
        "--",
        "sh",
        "-c",
        "echo out; printf '\\377' >&2; exit 7",
        home=home,
    )
    assert result.returncode == 7, result.stderr
    assert result.stdout == b"out\n"
    assert result.stderr == b"\xff"
    # submit, events and the final turn all went through one SSH connection
    assert sshd.accepted_logins() - before == 1


def test_ssh_cli_unknown_host_is_refused_saying_how_to_add_it(sshd, listener, home) -> None:
    result = paddock("run", *via_ssh(sshd, None, listener), "--", "true", home=home)
    assert result.returncode == 125
    text = result.stderr.decode()
    assert "host key unknown" in text
    assert f"ssh-keyscan -p {sshd.port} -t ssh-ed25519 127.0.0.1 >> ~/.ssh/known_hosts" in text
    fingerprint = subprocess.run(
        ["ssh-keygen", "-lf", f"{sshd.host_key}.pub"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    assert fingerprint in text  # the fingerprint to compare before adding it
    assert not (home / ".ssh" / "known_hosts").exists()  # nothing was added
    assert BUILDER_TOKEN.encode() not in result.stderr + result.stdout


def _key_of(path: Path) -> str:
    """A new key's ``TYPE BLOB``, as a known_hosts line holds it."""
    return " ".join(Path(f"{keygen(path)}.pub").read_text().split()[:2])


def _refused_by(sshd: Sshd, known: Path, listener: Listener, home: Path) -> str:
    """What ``paddock run --ssh`` says, trusting ``known`` alone, as it exits 125."""
    result = paddock("run", *via_ssh(sshd, known, listener), "--", "true", home=home)
    assert result.returncode == 125, result.stderr
    assert BUILDER_TOKEN.encode() not in result.stderr + result.stdout
    return result.stderr.decode()


def test_ssh_cli_changed_host_key_is_refused_loudly(sshd, listener, home, tmp_path) -> None:
    stale = tmp_path / "known_hosts"
    stale.write_text(f"[127.0.0.1]:{sshd.port} {_key_of(tmp_path / 'impostor')}\n")
    text = _refused_by(sshd, stale, listener, home)
    assert "SSH HOST KEY CHANGED" in text
    assert "has CHANGED" in text and "intercepting" in text
    assert f"ssh-keygen -R '[127.0.0.1]:{sshd.port}'" in text


def test_ssh_cli_key_not_authorized_is_auth_failed(
    sshd, known_hosts, listener, home, tmp_path
) -> None:
    stranger = keygen(tmp_path / "stranger")
    result = paddock(
        "run", *via_ssh(sshd, known_hosts, listener, key=stranger), "--", "true", home=home
    )
    assert result.returncode == 125
    text = result.stderr.decode()
    assert "SSH auth failed" in text
    assert str(stranger) in text and "authorized_keys" in text


@pytest.mark.parametrize("listed", ["its_own_key", "another_key"])
def test_ssh_cli_revoked_host_key_is_refused_whatever_else_is_listed(
    sshd, listener, home, tmp_path, listed
) -> None:
    # OpenSSH refuses a key marked @revoked wherever else it is listed; the line must not
    # be skipped as one paramiko cannot read (nor break the reading of the file).
    key = sshd.host_public_key if listed == "its_own_key" else _key_of(tmp_path / "other")
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {key}\n@revoked * {sshd.host_public_key}\n")
    text = _refused_by(sshd, known, listener, home)
    assert "REVOKED" in text and "@revoked" in text and str(known) in text


def test_ssh_cli_reads_past_lines_it_does_not_trust_by(sshd, listener, home, tmp_path) -> None:
    """A certificate authority (host certificates are not checked), another key revoked, a
    line that is no key at all: the host's own key, named by a pattern, is still trusted."""
    other = _key_of(tmp_path / "other")
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority *.example.org {other}\n@revoked * {other}\nnot a key\n")
    with known.open("a") as lines:
        # By a pattern, as a fleet's known_hosts often names its hosts.
        lines.write(f"[127.0.0.1]:*,!elsewhere {sshd.host_public_key}\n")
    result = paddock("run", *via_ssh(sshd, known, listener), "--", "echo", "in", home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"in\n"


def test_ssh_cli_host_trusted_only_by_a_certificate_authority_is_told_so(
    sshd, listener, home, tmp_path
) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority * {_key_of(tmp_path / 'authority')}\n")
    text = _refused_by(sshd, known, listener, home)
    assert "host key unknown" in text
    assert "@cert-authority" in text and "host certificates" in text


def test_ssh_cli_no_sshd_listening_is_unreachable(sshd, known_hosts, listener, home) -> None:
    args = via_ssh(sshd, known_hosts, listener)
    args[1] = f"{sshd.user}@127.0.0.1:{free_port()}"
    result = paddock("run", *args, "--", "true", home=home)
    assert result.returncode == 125
    assert b"SSH unreachable" in result.stderr
    assert b"Connection refused" in result.stderr


def test_ssh_cli_host_alias_from_ssh_config(sshd, listener, home) -> None:
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir()
    sshd.write_known_hosts(ssh_dir / "known_hosts")
    (ssh_dir / "config").write_text(
        "Host buildbox\n"
        "    HostName 127.0.0.1\n"
        f"    Port {sshd.port}\n"
        f"    User {sshd.user}\n"
        f"    IdentityFile {sshd.client_key}\n"
    )
    result = paddock(
        "run", "--ssh", "buildbox", "--target", listener.url, "--", "echo", "alias", home=home
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"alias\n"


def test_ssh_cli_passphrase_protected_key(sshd, known_hosts, listener, home) -> None:
    args = via_ssh(sshd, known_hosts, listener, key=sshd.locked_key)
    locked = paddock("run", *args, "--", "true", home=home)
    assert locked.returncode == 125
    assert b"needs a passphrase" in locked.stderr
    assert b"PADDOCK_SSH_PASSPHRASE" in locked.stderr

    unlocked = paddock(
        "run", *args, "--", "echo", "unlocked", home=home, PADDOCK_SSH_PASSPHRASE=CLIENT_PASSPHRASE
    )
    assert unlocked.returncode == 0, unlocked.stderr
    assert unlocked.stdout == b"unlocked\n"
    assert CLIENT_PASSPHRASE.encode() not in unlocked.stderr + locked.stderr


def test_ssh_cli_ctrl_c_reaches_the_turn_through_the_tunnel(
    sshd, known_hosts, listener, home
) -> None:
    marker = "321.75"
    command = ["sh", "-c", f"echo ready; sleep {marker}"]
    with subprocess.Popen(
        [*CLI, "run", *via_ssh(sshd, known_hosts, listener), "--", *command],
        env=cli_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert wait_until(lambda: not processes_with("sleep", marker))


def mux_ready(home: Path, args: list[str]) -> None:
    """Wait until the multiplexer the last run started for this route (``args``) answers.

    Asked of that route's daemon alone: the session's other tests keep theirs in
    the same runtime directory, and any of them answering says nothing of this one.
    """

    def answers() -> bool:
        status = paddock("mux", "status", *args, "--json", home=home)
        return any(json.loads(line).get("t") == "status" for line in status.stdout.splitlines())

    assert wait_until(answers, timeout=30), "no multiplexer came up"


def test_ssh_cli_runs_share_one_connection_through_the_mux(
    sshd, known_hosts, listener, home
) -> None:
    args = via_ssh(sshd, known_hosts, listener)
    before = sshd.accepted_logins()
    first = paddock("run", *args, "--", "echo", "first", home=home)  # in-process
    assert (first.returncode, first.stdout) == (0, b"first\n"), first.stderr
    mux_ready(home, args)
    for n in range(3):
        result = paddock("run", *args, "--", "echo", str(n), home=home)
        assert (result.returncode, result.stdout) == (0, f"{n}\n".encode()), result.stderr
    assert sshd.accepted_logins() - before == 2  # the first run's, and the multiplexer's one
    direct = paddock("run", "--no-mux", *args, "--", "true", home=home)
    assert direct.returncode == 0, direct.stderr
    assert sshd.accepted_logins() - before == 3


def test_ssh_cli_mux_reconnects_after_its_connection_is_killed(
    sshd, known_hosts, listener, home
) -> None:
    args = via_ssh(sshd, known_hosts, listener)
    assert paddock("run", *args, "--", "true", home=home).returncode == 0
    mux_ready(home, args)
    assert paddock("run", *args, "--", "true", home=home).returncode == 0
    assert sshd.kill_sessions() >= 1  # the multiplexer's connection dies under it
    result = paddock("run", *args, "--", "echo", "back", home=home)
    assert (result.returncode, result.stdout) == (0, b"back\n"), result.stderr


def test_ssh_cli_mux_passphrase_from_the_environment(sshd, known_hosts, listener, home) -> None:
    args = via_ssh(sshd, known_hosts, listener, key=sshd.locked_key)
    secret = {"PADDOCK_SSH_PASSPHRASE": CLIENT_PASSPHRASE}
    assert paddock("run", *args, "--", "true", home=home, **secret).returncode == 0
    mux_ready(home, args)
    result = paddock("run", *args, "--", "echo", "unlocked", home=home, **secret)
    assert (result.returncode, result.stdout) == (0, b"unlocked\n"), result.stderr
    assert CLIENT_PASSPHRASE.encode() not in result.stderr


# -- the same turns over an OpenSSH-forwarded port (`ssh -L`) -----------------------------


@pytest.fixture(scope="module")
def forwarded(sshd: Sshd, known_hosts: Path, listener: Listener) -> Iterator[Listener]:
    """``ssh -N -L`` from a local port to the target's listener, as the README suggests."""
    local_port = free_port()
    target_port = listener.url.rsplit(":", 1)[1]
    with subprocess.Popen(
        [
            "ssh",
            "-N",
            "-F",
            "/dev/null",
            "-p",
            str(sshd.port),
            "-i",
            str(sshd.client_key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ExitOnForwardFailure=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={known_hosts}",
            "-L",
            f"127.0.0.1:{local_port}:127.0.0.1:{target_port}",
            f"{sshd.user}@127.0.0.1",
        ],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    ) as forwarder:
        try:
            assert wait_until(lambda: _listening(local_port) or forwarder.poll() is not None)
            assert forwarder.poll() is None, forwarder.stderr and forwarder.stderr.read()
            yield Listener(f"http://127.0.0.1:{local_port}", listener.workspace)
        finally:
            forwarder.terminate()
            forwarder.wait(timeout=10)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("route", ["paramiko", "ssh -L"])
@pytest.mark.parametrize(
    ("tail", "status", "stdout", "stderr_has"),
    [
        (["--", "sh", "-c", "echo out; echo err >&2; exit 3"], 3, b"out\n", b"err\n"),
        (["--read", "/etc/shadow", "--", "true"], 126, b"", b"forbidden-path"),
    ],
)
def test_ssh_turn_behaves_the_same_over_paramiko_and_openssh_forwarding(
    route, tail, status, stdout, stderr_has, sshd, known_hosts, listener, forwarded, home
) -> None:
    if route == "paramiko":
        via = via_ssh(sshd, known_hosts, listener)
    else:
        via = ["--target", forwarded.url]
    result = paddock("run", *via, *tail, home=home)
    assert result.returncode == status, result.stderr
    assert result.stdout == stdout
    assert stderr_has in result.stderr


# -- the Python API ---------------------------------------------------------------------


def test_ssh_api_reuses_one_connection_for_every_turn(sshd, known_hosts, listener) -> None:
    before = sshd.accepted_logins()
    with open_ssh(sshd, known_hosts, listener.url) as target:
        results = [target.run(["sh", "-c", f"echo {n}; exit {n}"]) for n in range(4)]
        assert target.health().status in ("armed", "degraded")
        assert target.ssh_connection is not None
        assert target.ssh_connection.connects == 1
    assert [(r.exit_code, r.stdout) for r in results] == [(n, f"{n}\n".encode()) for n in range(4)]
    assert sshd.accepted_logins() - before == 1


def test_ssh_api_refusal_is_a_result_not_an_exception(sshd, known_hosts, listener) -> None:
    with open_ssh(sshd, known_hosts, listener.url) as target:
        result = target.run(["true"], read=["/etc/shadow"])
    assert result.exit_code == 126
    assert result.refusal is not None and result.refusal.rule == "forbidden-path"
    assert result.turn.state == "refused"


def test_ssh_api_reconnects_after_an_idle_drop(sshd, known_hosts, listener) -> None:
    with open_ssh(sshd, known_hosts, listener.url) as target:
        connection = target.ssh_connection
        assert connection is not None
        assert target.run(["echo", "one"]).stdout == b"one\n"
        connection.drop()
        assert target.run(["echo", "two"]).stdout == b"two\n"
        assert connection.connects == 2


def test_ssh_api_killed_connection_mid_turn_resumes_output_exactly_once(
    tmp_path, known_hosts, listener
) -> None:
    # Its own sshd: the test kills every session it has, then the listener for a while.
    with Sshd(tmp_path / "sshd") as server:
        known = server.write_known_hosts(tmp_path / "known_hosts")
        script = "for i in $(seq 0 39); do seq $((i*500+1)) $((i*500+500)); sleep 0.05; done"
        down_for_s = 1.0
        seen = {"stdout": 0}
        restarted = threading.Event()

        def on_event(event: object) -> None:
            if getattr(event, "kind", None) != "stdout" or seen["stdout"] == -1:
                return
            seen["stdout"] += 1
            if seen["stdout"] == 3:
                seen["stdout"] = -1
                server.stop()  # kills the session's sshd processes, then the listener
                threading.Timer(down_for_s, lambda: (server.start(), restarted.set())).start()

        with open_ssh(server, known, listener.url) as target:
            started = time.monotonic()
            result = target.run(["sh", "-c", script], on_event=on_event)
            took = time.monotonic() - started
            assert target.ssh_connection is not None
            connects = target.ssh_connection.connects
        assert restarted.is_set()
        assert result.exit_code == 0
        assert result.stdout == "".join(f"{n}\n" for n in range(1, 20001)).encode()
        assert connects == 2
        assert server.accepted_logins() == 2
        assert took >= down_for_s  # it waited out the outage rather than failing


def test_ssh_api_unknown_and_changed_host_keys_raise(sshd, listener, tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(HostKeyUnknown, match="ssh-keyscan"):
        open_ssh(sshd, empty, listener.url)
    impostor = keygen(tmp_path / "impostor")
    kind, blob = Path(f"{impostor}.pub").read_text().split()[:2]
    stale = tmp_path / "stale"
    stale.write_text(f"[127.0.0.1]:{sshd.port} {kind} {blob}\n")
    with pytest.raises(HostKeyChanged, match="CHANGED"):
        open_ssh(sshd, stale, listener.url)


def test_ssh_api_passphrase_protected_key(sshd, known_hosts, listener) -> None:
    asked: list[str] = []

    def passphrase(path: str) -> str:
        asked.append(path)
        return CLIENT_PASSPHRASE

    locked = [str(sshd.locked_key)]
    with open_ssh(
        sshd, known_hosts, listener.url, identity_files=locked, passphrase=passphrase
    ) as target:
        assert target.run(["echo", "ok"]).stdout == b"ok\n"
        assert target.ssh_connection is not None
        target.ssh_connection.drop()
        assert target.run(["echo", "again"]).stdout == b"again\n"
    assert asked == [str(sshd.locked_key)]  # the unlocked key is kept: a reconnect asks no more

    with pytest.raises(SshAuthFailed, match="does not unlock") as failed:
        open_ssh(sshd, known_hosts, listener.url, identity_files=locked, passphrase="wrong")
    assert "wrong" not in str(failed.value)


def test_ssh_api_https_listener_through_the_tunnel(
    sshd, known_hosts, target: TlsTarget, tmp_path
) -> None:
    # TLS inside the channel: the target's own certificate is still checked.
    with open_ssh(sshd, known_hosts, target.url, cacert=target.cacert) as over_tls:
        assert over_tls.run(["echo", "tls"]).stdout == b"tls\n"
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    with (
        open_ssh(sshd, known_hosts, target.url, cacert=str(other_ca)) as untrusted,
        pytest.raises(TlsFailure),
    ):
        untrusted.run(["true"])


def test_ssh_api_trusts_the_ca_read_from_the_host_when_none_is_given(
    sshd, known_hosts, target: TlsTarget, tmp_path
) -> None:
    # Read over the SSH connection whose host key was verified: the host's own CA file.
    with open_ssh(sshd, known_hosts, target.url, remote_cacert=target.cacert) as fetched:
        assert fetched.run(["echo", "pinned"]).stdout == b"pinned\n"
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    with (
        open_ssh(sshd, known_hosts, target.url, remote_cacert=str(other_ca)) as wrong,
        pytest.raises(TlsFailure),
    ):
        wrong.run(["true"])
    # No CA file on the host: the system's CAs, which do not know this one.
    missing = str(tmp_path / "no-such-ca.pem")
    with (
        open_ssh(sshd, known_hosts, target.url, remote_cacert=missing) as system,
        pytest.raises(TlsFailure),
    ):
        system.run(["true"])
    # A cacert given wins over the host's file, even a bad one.
    with open_ssh(
        sshd, known_hosts, target.url, cacert=target.cacert, remote_cacert=str(other_ca)
    ) as given:
        assert given.run(["echo", "given"]).stdout == b"given\n"


def test_ssh_api_remote_ca_that_is_no_certificate_is_refused(
    sshd, known_hosts, target: TlsTarget, tmp_path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(UsageError, match=f"{junk} on .* holds no usable CA certificate"):
        open_ssh(sshd, known_hosts, target.url, remote_cacert=str(junk))


def test_ssh_cli_https_listener_with_the_hosts_ca(
    sshd, known_hosts, target: TlsTarget, home
) -> None:
    args = ["--ssh", sshd.destination, "-i", str(sshd.client_key)]
    args += ["--known-hosts", str(known_hosts), "--target", target.url]
    result = paddock(
        "run", *args, "--remote-cacert", target.cacert, "--", "echo", "over tls", home=home
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"over tls\n"


def test_ssh_api_http_url_for_an_https_listener_is_named(
    sshd, known_hosts, target: TlsTarget
) -> None:
    plain = target.url.replace("https://", "http://")
    with open_ssh(sshd, known_hosts, plain) as wrong, pytest.raises(WrongScheme) as caught:
        wrong.run(["true"])
    assert "speaks HTTPS, not plain HTTP" in str(caught.value)


def test_ssh_cli_no_listener_says_so_without_paramikos_log(
    sshd, known_hosts, listener, home
) -> None:
    args = via_ssh(sshd, known_hosts, listener)
    args[args.index(listener.url)] = f"http://127.0.0.1:{free_port()}"
    result = paddock("run", *args, "--", "true", home=home)
    assert result.returncode == 125
    text = result.stderr.decode()
    assert "could not connect to 127.0.0.1" in text
    assert "Secsh" not in text and "paramiko" not in text
    assert text.count("\n") == 1


def test_ssh_api_refuses_plain_http_to_another_host_from_the_sshd(sshd, known_hosts) -> None:
    with pytest.raises(UsageError, match="unencrypted"):
        open_ssh(sshd, known_hosts, "http://192.0.2.7:8443")


def test_ssh_api_no_target_behind_the_sshd(sshd, known_hosts) -> None:
    with (
        open_ssh(sshd, known_hosts, f"http://127.0.0.1:{free_port()}") as target,
        pytest.raises(TargetUnreachable, match="could not connect"),
    ):
        target.run(["true"])


async def test_ssh_async_runs_turns_concurrently_over_one_connection(
    sshd, known_hosts, listener
) -> None:
    before = sshd.accepted_logins()
    async with AsyncTarget.ssh(
        sshd.destination,
        token=BUILDER_TOKEN,
        url=listener.url,
        role="builder",
        identity_files=[str(sshd.client_key)],
        known_hosts=[str(known_hosts)],
    ) as target:
        started = time.monotonic()
        results = await asyncio.gather(
            *(target.run(["sh", "-c", f"sleep 2; echo {n}"]) for n in range(3))
        )
        took = time.monotonic() - started
    assert [r.stdout for r in results] == [b"0\n", b"1\n", b"2\n"]
    assert took < 5.0  # side by side: one after another takes 6 s or more
    assert sshd.accepted_logins() - before == 1


async def test_ssh_async_cancelled_run_kills_its_turn(sshd, known_hosts, listener) -> None:
    marker = "321.25"
    async with AsyncTarget.ssh(
        sshd.destination,
        token=BUILDER_TOKEN,
        url=listener.url,
        role="builder",
        identity_files=[str(sshd.client_key)],
        known_hosts=[str(known_hosts)],
    ) as target:
        running = asyncio.ensure_future(target.run(["sh", "-c", f"echo ready; sleep {marker}"]))
        assert await asyncio.to_thread(wait_until, lambda: bool(processes_with("sleep", marker)))
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert await asyncio.to_thread(wait_until, lambda: not processes_with("sleep", marker))
