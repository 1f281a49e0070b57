"""The hardened systemd unit the server runs under where systemd is PID 1."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from paddock_deploy.commands import base_env, run
from paddock_deploy.errors import Refused

UNIT_NAME = "paddock-target.service"
UNIT_DIR = Path("/etc/systemd/system")
HIDDEN_BY_PROTECT_HOME = ("/home", "/root", "/run/user")
UNIT_UNSAFE = re.compile(r"[\s\"'\\;]|[\x00-\x1f]")


def unit_path_value(path: str) -> str:
    """A path as a unit file value: '%' doubled, whitespace and quotes refused."""
    if UNIT_UNSAFE.search(path):
        raise Refused(
            f"{path!r} holds whitespace, quotes or control characters; "
            "systemd unit files cannot carry it safely: choose another path"
        )
    return path.replace("%", "%%")


def under(path: str, *tops: str) -> bool:
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in tops)


def render_unit(
    *,
    user: str,
    group: str,
    prefix: Path,
    config: Path,
    state_root: Path,
    workspaces: list[str],
) -> str:
    """The hardened systemd unit; every directive left out on purpose says why."""
    value = unit_path_value
    in_homes = [w for w in workspaces if under(w, *HIDDEN_BY_PROTECT_HOME)]
    writable = " ".join(value(p) for p in [str(state_root), *workspaces])
    if in_homes:
        homes = (
            "# Workspaces under /home, /root or /run/user: every home is hidden behind an empty\n"
            "# tmpfs, and only those workspaces are bound back in.\n"
            "ProtectHome=tmpfs\n" + "".join(f"BindPaths={value(w)}\n" for w in in_homes)
        )
    else:
        homes = (
            "# /home, /root and /run/user are invisible to the server and its turns.\n"
            "ProtectHome=yes\n"
        )
    return f"""\
# paddock target. Written by paddock-deploy; re-running it rewrites this file.
[Unit]
Description=paddock target: fenced turns for an AI agent
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
User={user}
Group={group}
ExecStart={value(str(prefix))}/current/bin/paddock-target serve --config {value(str(config))}
Restart=on-failure
RestartSec=2s
TimeoutStopSec=20s
UMask=0077
Environment=LANG=C.UTF-8
# Turns get cgroups of their own below the server's: memory, pids and cpu limits.
Delegate=yes

# No privilege to gain and none kept. bubblewrap needs neither a setuid bit nor a
# capability here: each fence is an unprivileged user namespace, in which the
# kernel grants it a full capability set of its own. So RestrictNamespaces= and
# PrivateUsers= are deliberately absent: either one breaks every fence.
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
RestrictSUIDSGID=yes

# The filesystem is read-only except the state root and the workspaces.
ProtectSystem=strict
ReadWritePaths={writable}
{homes}PrivateTmp=yes
PrivateDevices=yes
ProtectKernelModules=yes
ProtectClock=yes
ProtectHostname=yes
# Deliberately absent: ProtectKernelTunables=, ProtectKernelLogs=, ProtectProc= and
# ProcSubset= cover parts of /proc, and the kernel then refuses the fresh /proc that
# every fence mounts. ProtectControlGroups= would make the delegated cgroup read-only.
# SystemCallFilter= and MemoryDenyWriteExecute= would reach into every turn (bubblewrap
# needs mount(2); JIT compilers need writable-executable memory).

# bubblewrap brings up each fence's loopback interface over netlink.
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
RestrictRealtime=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
"""


# --- systemctl ---------------------------------------------------------------------------------


def systemctl(*args: str) -> None:
    run(["systemctl", *args])


def systemctl_says_yes(*args: str) -> bool:
    """``systemctl is-enabled|is-active --quiet UNIT`` as a boolean."""
    proc = subprocess.run(["systemctl", *args, "--quiet", UNIT_NAME], check=False, env=base_env())
    return proc.returncode == 0


def unit_pid() -> int | None:
    proc = run(["systemctl", "show", "--property=MainPID", "--value", UNIT_NAME])
    value = proc.stdout.strip()
    return int(value) if value.isdigit() and value != "0" else None
