"""``paddock status`` (agent_side.status): per-cause status of every stored target.

The rules first, on observations made by hand; then real TLS targets on
127.0.0.1 — one up, one stopped, one holding a wrong token — polled by the
real command, across runs and restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from conftest import BUILDER_TOKEN, make_settings
from sshd import free_port

from agent_side import targets_file
from agent_side.status import Cause, Observation, TargetStatus, apply, check
from agent_side.targets_file import StoredTarget
from shared.walk import canonical_path
from target_side.service.server import ServerThread

CLI = [sys.executable, "-m", "agent_side.cli"]
REPO = Path(__file__).resolve().parent.parent


# --- the rules ----------------------------------------------------------------------------


def _status(**causes: str) -> TargetStatus:
    return TargetStatus("t", "T0", {c: Cause(c, since, "was") for c, since in causes.items()})


def _seen(*recoveries: str, **failures: str) -> Observation:
    return Observation(failures=dict(failures), recoveries=set(recoveries))


def test_status_cause_keeps_the_time_it_began_while_it_stays_set() -> None:
    first = apply(_status(), _seen(offline="refused"), "T1")
    assert first.causes["offline"] == Cause("offline", "T1", "refused")
    again = apply(first, _seen(offline="still refused"), "T2")
    assert again.causes["offline"] == Cause("offline", "T1", "still refused")
    assert again.checked_at == "T2"


def test_status_health_poll_never_clears_auth_an_accepted_token_does() -> None:
    before = _status(auth="T0", connectivity="T0", offline="T0")
    polled = apply(before, _seen("reached", "served", "verified", "armed"), "T1")
    assert set(polled.causes) == {"auth"} and polled.causes["auth"].since == "T0"
    assert apply(polled, _seen("accepted"), "T2").armed


def test_status_each_signal_clears_only_its_own_cause() -> None:
    every = _status(connectivity="T0", offline="T0", tls="T0", auth="T0", degraded="T0")
    for signal, cause in (
        ("reached", "connectivity"),
        ("served", "offline"),
        ("verified", "tls"),
        ("accepted", "auth"),
        ("armed", "degraded"),
    ):
        after = apply(every, _seen(signal), "T1")
        assert set(every.causes) - set(after.causes) == {cause}, signal


def test_status_a_poll_that_saw_nothing_leaves_causes_as_they_were() -> None:
    before = _status(auth="T0", degraded="T0")
    after = apply(before, _seen(connectivity="no route"), "T1")
    assert set(after.causes) == {"auth", "degraded", "connectivity"}
    assert after.causes["auth"].since == "T0"


# --- real targets ----------------------------------------------------------------------------


@contextlib.contextmanager
def _serving(root: Path, ca: trustme.CA, port: int) -> Iterator[None]:
    """A TLS target on 127.0.0.1:``port`` (the same state root each time: a restart)."""
    settings = make_settings(root, ca)
    server = settings.server.model_copy(update={"listen": f"127.0.0.1:{port}"})
    with ServerThread(settings.model_copy(update={"server": server})):
        yield


def _store(environ: dict[str, str], name: str, port: int, ca_pem: str, token: str) -> None:
    entry = StoredTarget(
        name=name,
        route="https",
        url=f"https://127.0.0.1:{port}",
        ca_sha256=targets_file.fingerprint(ca_pem),
        default_role="builder",
    )
    targets_file.save(entry, tokens={"builder": token}, ca_pem=ca_pem, environ=environ)


def _status_cli(environ: dict[str, str]) -> tuple[int, dict[str, dict[str, object]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDOCK_", "XDG_"))}
    result = subprocess.run(
        [*CLI, "status", "--json", "--timeout", "5"],
        env=env | environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode in (0, 1), result.stderr
    targets = json.loads(result.stdout)["targets"]
    return result.returncode, {t["name"]: t for t in targets}


def _causes(target: dict[str, object]) -> dict[str, str]:
    """Each cause set, with when it began (degraded aside: that is the machine's business)."""
    listed = target["causes"]
    assert isinstance(listed, list)
    return {c["cause"]: c["since"] for c in listed if c["cause"] != "degraded"}


@pytest.fixture
def environ(tmp_path: Path) -> dict[str, str]:
    return {
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }


def test_status_of_targets_up_stopped_and_with_a_wrong_token(
    tmp_path: Path, ca: trustme.CA, environ: dict[str, str]
) -> None:
    root = Path(canonical_path(tmp_path))
    ca_pem = ca.cert_pem.bytes().decode()
    ports = {name: free_port() for name in ("up", "down", "bad")}
    for name, port in ports.items():
        token = "not-the-token" if name == "bad" else BUILDER_TOKEN
        _store(environ, name, port, ca_pem, token)
    with _serving(root / "up", ca, ports["up"]):
        with _serving(root / "bad", ca, ports["bad"]):
            status, first = _status_cli(environ)
            assert status == 1
            assert _causes(first["up"]) == {}
            assert set(_causes(first["down"])) == {"offline"}
            assert set(_causes(first["bad"])) == {"auth"}
            assert "role builder: the target refused its token" in json.dumps(first["bad"])
            time.sleep(1.1)  # so that a start time rewritten by the second run would differ
            _, second = _status_cli(environ)
            assert _causes(second["down"]) == _causes(first["down"])  # began at the first run
            assert _causes(second["bad"]) == _causes(first["bad"])
            assert second["bad"]["checked_at"] > first["bad"]["checked_at"]
        # "bad" is stopped now; its token is put right, but nothing can tell yet.
        token_file = Path(environ["XDG_CONFIG_HOME"]) / "paddock/targets/bad/token-builder"
        token_file.write_text(BUILDER_TOKEN + "\n")
        with _serving(root / "down", ca, ports["down"]):
            _, third = _status_cli(environ)
        assert "offline" not in _causes(third["down"])  # a health poll answered
        assert _causes(third["bad"])["auth"] == _causes(first["bad"])["auth"]
        assert "offline" in _causes(third["bad"])
        assert _causes(third["up"]) == {}
        with _serving(root / "bad", ca, ports["bad"]):
            _, fourth = _status_cli(environ)
        assert _causes(fourth["bad"]) == {}  # the token was accepted: auth cleared
    # Kept between runs in the user's state directory, privately.
    book = Path(environ["XDG_STATE_HOME"]) / "paddock" / "status.json"
    assert book.stat().st_mode & 0o777 == 0o600
    assert set(json.loads(book.read_text())["targets"]) == {"up", "down", "bad"}


def test_status_degraded_mirrors_the_targets_own_causes(
    tmp_path: Path, ca: trustme.CA, environ: dict[str, str]
) -> None:
    import ssl

    import httpx

    trust = ssl.create_default_context()
    ca.configure_trust(trust)
    port = free_port()
    ca_pem = ca.cert_pem.bytes().decode()
    _store(environ, "one", port, ca_pem, BUILDER_TOKEN)
    with _serving(Path(canonical_path(tmp_path)) / "one", ca, port):
        (status,) = check([], environ)
        health = httpx.get(f"https://127.0.0.1:{port}/v1/health", verify=trust).json()
    own = [c["cause"] for c in health["causes"]]
    assert [c["cause"] for c in status.target_causes] == own
    assert ("degraded" in status.causes) == bool(own)


def test_status_wrong_pinned_ca_is_tls_and_a_dead_ssh_host_is_connectivity(
    tmp_path: Path, ca: trustme.CA, environ: dict[str, str]
) -> None:
    port = free_port()
    other = trustme.CA().cert_pem.bytes().decode()
    _store(environ, "pinned-elsewhere", port, other, BUILDER_TOKEN)
    nobody = StoredTarget(
        name="gone", route="ssh", url="https://127.0.0.1:8443", ssh=f"root@127.0.0.1:{free_port()}"
    )
    targets_file.save(nobody, tokens={}, ca_pem=None, environ=environ)
    with _serving(Path(canonical_path(tmp_path)) / "t", ca, port):
        statuses = {s.name: s for s in check([], environ, timeout_s=5)}
    assert set(statuses["pinned-elsewhere"].causes) == {"tls"}
    assert "certificate" in statuses["pinned-elsewhere"].causes["tls"].detail
    assert set(statuses["gone"].causes) == {"connectivity"}


def test_status_names_an_unknown_target(environ: dict[str, str]) -> None:
    from agent_side.errors import UsageError

    with pytest.raises(UsageError, match="no stored target 'nope'"):
        check(["nope"], environ)
