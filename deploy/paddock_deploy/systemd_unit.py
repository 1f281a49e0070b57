"""The hardened systemd units where systemd is PID 1: the server's, and its launcher's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from paddock_deploy.commands import base_env, run
from paddock_deploy.errors import Refused

UNIT_NAME = "paddock-target.service"
LAUNCHER_UNIT_NAME = "paddock-launcher.service"
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
    """The server's hardened unit; every directive left out on purpose says why."""
    value = unit_path_value
    return f"""\
# paddock target. Written by paddock-deploy; re-running it rewrites this file.
[Unit]
Description=paddock target: fenced turns for an AI agent
After=network-online.target {LAUNCHER_UNIT_NAME}
Wants=network-online.target {LAUNCHER_UNIT_NAME}

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

# No privilege to gain and none kept: turns run as their role's uid through
# {LAUNCHER_UNIT_NAME}. A config that says [fence] identity = "server" runs
# bubblewrap in this unit instead, as an unprivileged user namespace (the kernel
# grants bubblewrap a full capability set of its own there): so RestrictNamespaces=
# and PrivateUsers= stay absent, since either one breaks every such fence.
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
RestrictSUIDSGID=yes

{_filesystem(state_root, workspaces, [])}
[Install]
WantedBy=multi-user.target
"""


def render_launcher_unit(
    *,
    prefix: Path,
    config: Path,
    state_root: Path,
    workspaces: list[str],
    socket: Path,
) -> str:
    """The launcher's unit: root, bounded to the capabilities starting a turn as a role takes."""
    value = unit_path_value
    runtime, writable = "", []
    if socket.parent.parent == Path("/run"):
        runtime = (
            "# The socket's directory, made at each start (root's, 0755).\n"
            f"RuntimeDirectory={value(socket.parent.name)}\nRuntimeDirectoryMode=0755\n"
        )
    else:
        writable = [str(socket.parent)]
    return f"""\
# paddock launcher. Written by paddock-deploy; re-running it rewrites this file.
[Unit]
Description=paddock launcher: starts each turn as its role's own uid
Before={UNIT_NAME}

[Service]
# Ready once it listens on {value(str(socket))} (the socket named in the config).
Type=notify
ExecStart={value(str(prefix))}/current/bin/paddock-target launcher --config {value(str(config))}
Restart=on-failure
RestartSec=2s
TimeoutStopSec=20s
UMask=0077
Environment=LANG=C.UTF-8
{runtime}
# Root, with only what starting a turn as its role's uid takes: CAP_SETUID and
# CAP_SETGID (the role's uid and gid, and no supplementary group), CAP_KILL (the
# turns it started run as other uids), CAP_CHOWN (a new role home, the socket's
# group) and CAP_DAC_OVERRIDE (the server's turn cgroups and state root belong to
# the service user). Not CAP_FOWNER: a home's mode is set while root still owns
# it, or by the role. Not CAP_SYS_PTRACE: a fence's pid namespace is walked as its
# role. The config it reads is root's: a compromised server cannot widen a role.
CapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_KILL CAP_CHOWN CAP_DAC_OVERRIDE
AmbientCapabilities=
NoNewPrivileges=yes
RestrictSUIDSGID=yes

# Every fence is made in this unit's view of the filesystem, so it is the server's.
{_filesystem(state_root, workspaces, writable)}
[Install]
WantedBy=multi-user.target
"""


def _filesystem(state_root: Path, workspaces: list[str], extra: list[str]) -> str:
    """The filesystem and kernel hardening both units share (fences need all it leaves)."""
    value = unit_path_value
    in_homes = [w for w in workspaces if under(w, *HIDDEN_BY_PROTECT_HOME)]
    writable = " ".join(value(p) for p in [str(state_root), *workspaces, *extra])
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
"""


# --- systemctl ---------------------------------------------------------------------------------


def systemctl(*args: str) -> None:
    run(["systemctl", *args])


def systemctl_says_yes(*args: str, unit: str = UNIT_NAME) -> bool:
    """``systemctl is-enabled|is-active --quiet UNIT`` as a boolean."""
    proc = subprocess.run(["systemctl", *args, "--quiet", unit], check=False, env=base_env())
    return proc.returncode == 0


def unit_pid(unit: str = UNIT_NAME) -> int | None:
    proc = run(["systemctl", "show", "--property=MainPID", "--value", unit])
    value = proc.stdout.strip()
    return int(value) if value.isdigit() and value != "0" else None
