"""The systemd unit (paddock_deploy.systemd_unit), as ``--print-unit`` gives it from a checkout.

systemd is not PID 1 here, so the unit is read strictly as unit-file syntax;
the deploy tests also run ``systemd-analyze verify`` on it where it is installed.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from deploy_support import SYSTEM_PYTHON, checkout_env, from_checkout, print_unit

pytestmark = pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no system python3")


REQUIRED = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "PrivateTmp": "yes",
    "Restart": "on-failure",
    "Delegate": "yes",
    "CapabilityBoundingSet": "",
}
ABSENT = (
    "RestrictNamespaces",
    "PrivateUsers",
    "ProtectKernelTunables",
    "ProtectKernelLogs",
    "ProtectProc",
    "ProcSubset",
    "ProtectControlGroups",
    "SystemCallFilter",
    "MemoryDenyWriteExecute",
)
"""Each of these breaks bubblewrap (or the delegated cgroup, or every turn's JIT)."""
KNOWN_SECTIONS = {"Unit", "Service", "Install"}


def _parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A strict reading of unit-file syntax: sections, then Key=value lines, nothing else."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith(("#", ";")):
            continue
        header = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if header:
            assert header[1] in KNOWN_SECTIONS and header[1] not in sections, line
            current = sections.setdefault(header[1], {})
            continue
        pair = re.fullmatch(r"([A-Za-z][A-Za-z0-9]*)=(.*)", line)
        assert pair and current is not None, f"line {number} is not Key=value: {line!r}"
        current.setdefault(pair[1], []).append(pair[2])
    return sections


def test_unit_file_is_hardened_and_leaves_what_bubblewrap_needs() -> None:
    unit = _parse_unit(
        print_unit(
            "--state-root", "/var/lib/pdk", "--workspace", "/srv/w1", "--workspace", "/srv/w2"
        )
    )
    service = unit["Service"]
    for key, value in REQUIRED.items():
        assert service[key] == [value], key
    for key in ABSENT:
        assert key not in service, key
    assert service["ReadWritePaths"] == ["/var/lib/pdk /srv/w1 /srv/w2"]
    assert service["ProtectHome"] == ["yes"]
    families = service["RestrictAddressFamilies"][0].split()
    assert "AF_NETLINK" in families  # bubblewrap brings up each fence's loopback over netlink
    assert service["User"] == ["paddock"]
    assert service["ExecStart"] == [
        "/opt/paddock/current/bin/paddock-target serve --config /etc/paddock/target.toml"
    ]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_file_binds_back_workspaces_under_home() -> None:
    service = _parse_unit(print_unit("--workspace", "/home/alice/work"))["Service"]
    assert service["ProtectHome"] == ["tmpfs"]
    assert service["BindPaths"] == ["/home/alice/work"]


def test_unit_file_refuses_paths_it_cannot_carry() -> None:
    proc = subprocess.run(
        from_checkout("--wheel", "/x.whl", "--print-unit", "--workspace", "/srv/my work"),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
        env=checkout_env(),
    )
    assert proc.returncode == 2 and "whitespace" in proc.stderr
    escaped = _parse_unit(print_unit("--workspace", "/srv/100%"))["Service"]["ReadWritePaths"]
    assert escaped == ["/var/lib/paddock /srv/100%%"]  # '%' starts a specifier in unit files


def test_launcher_unit_is_root_bounded_to_its_capabilities_in_the_servers_view() -> None:
    options = ("--state-root", "/var/lib/pdk", "--workspace", "/srv/w1")
    launcher = _parse_unit(print_unit("--print-launcher-unit", *options))
    server = _parse_unit(print_unit(*options))
    service = launcher["Service"]
    assert "User" not in service  # root: it switches uids
    assert service["CapabilityBoundingSet"] == [
        "CAP_SETUID CAP_SETGID CAP_KILL CAP_CHOWN CAP_DAC_OVERRIDE"
    ]
    assert service["AmbientCapabilities"] == [""] and service["NoNewPrivileges"] == ["yes"]
    assert service["Type"] == ["notify"]  # ready once it listens: the server starts after
    assert service["RuntimeDirectory"] == ["paddock"]
    assert service["ExecStart"] == [
        "/opt/paddock/current/bin/paddock-target launcher --config /etc/paddock/target.toml"
    ]
    # Fences are made in the launcher's view of the filesystem: the server's, to the letter.
    shared = ("ProtectSystem", "ReadWritePaths", "ProtectHome", "PrivateTmp", "PrivateDevices")
    for key in shared:
        assert service[key] == server["Service"][key], key
    for key in ABSENT:
        assert key not in service, key
    assert "paddock-launcher.service" in server["Unit"]["After"][0].split()
    assert "paddock-launcher.service" in server["Unit"]["Wants"][0].split()


def test_launcher_unit_writes_a_socket_directory_outside_run() -> None:
    service = _parse_unit(
        print_unit("--print-launcher-unit", "--launcher-socket", "/srv/sock/launcher.sock")
    )["Service"]
    assert "RuntimeDirectory" not in service
    assert service["ReadWritePaths"] == ["/var/lib/paddock /srv/paddock/work /srv/sock"]
