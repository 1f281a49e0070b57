"""``paddock-target doctor``: what this target enforces and what is degraded, and what to do.

Every finding is ``ok``, ``degraded`` (with a fix an operator can act on) or
``info``. Nothing here changes the machine: in particular the limit detection
of ``limits.Limiter.detect`` is not called, because it moves the calling
process into a cgroup leaf of its own. Limits are reported the way the running
server found them at its start (its ``/v1/health``), and the cgroups below the
server's own process are inspected read-only.

Run as root, the checks re-run as the owner of the state root: bubblewrap,
cgroups and file modes look different to root than to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import grp
import http.client
import json
import os
import pwd
import shutil
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from paddock_deploy.protocol import CONFIG_FILE
from shared.walk import canonical_path, mount_conflict
from shared.wire import Health
from target_side.config import Settings
from target_side.errors import BackendError, LauncherError, RefusedError
from target_side.fence import landlock, syscall_filter
from target_side.fence.cgroupfs import (
    CONTROLLERS,
    CgroupMount,
    cgroup_mounts,
    memberships,
    under,
    v1_mount,
    v2_mount,
    words,
)
from target_side.fence.identity import Identity, InProcess, for_settings
from target_side.fence.launch import find_bwrap, probe
from target_side.fence.launcher_client import START_HINT, ViaLauncher
from target_side.policy.forbidden import ForbiddenEntry, forbidden_for
from target_side.policy.plan import host_ids
from target_side.service.turns import low_water
from target_side.tools import config_file

DEFAULT_CONFIG = Path(CONFIG_FILE)
CERT_RENEW_DAYS = 30

Status = Literal["ok", "degraded", "info"]


@dataclass(frozen=True)
class Finding:
    """One thing checked: its state, a sentence, and for a degraded one, what to do."""

    area: str
    status: Status
    summary: str
    fix: str | None = None
    details: tuple[str, ...] = ()


@dataclass
class Server:
    """The running server as seen from here: its process and what its health said."""

    pid: int | None = None
    environ: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    health: Health | None = None
    error: str | None = None


def run(config: Path, *, as_json: bool = False) -> int:
    """Print the findings; 0 when everything is enforced, 1 when something is degraded."""
    dropped = _rerun_as_state_owner(config, as_json)
    if dropped is not None:
        return dropped
    findings = examine(config)
    print(_as_json(config, findings) if as_json else _as_text(config, findings))
    return 1 if any(f.status == "degraded" for f in findings) else 0


def examine(config: Path) -> list[Finding]:
    """Every finding for the target configured by ``config``, in the order they are printed."""
    settings, checked = _config(config)
    findings = [checked]
    if settings is None:
        return [*findings, *_backend(None)]
    server = _find_server(settings, config)
    findings += [
        _server(server),
        _launcher(settings),
        _workspaces(settings),
        *_backend(settings),
        _seccomp(),
        abstract_sockets(settings),
        crash_dumps(),
        _limits(server),
        _cgroups(server),
        _state_root(settings),
        _disk(settings),
        *_tls(settings),
        *_forbidden(settings, server),
    ]
    return findings


# --- config ---------------------------------------------------------------------------------


def _config(path: Path) -> tuple[Settings | None, Finding]:
    settings, problems = config_file.check(path)
    if problems:
        return settings, Finding(
            "config",
            "degraded",
            f"{path} has {len(problems)} problem(s)",
            f"fix each one, then run: paddock-target config check {path}",
            tuple(problems),
        )
    if settings is None:
        return None, Finding("config", "degraded", f"{path} could not be read")
    roles = ", ".join(settings.roles)
    return settings, Finding(
        "config",
        "ok",
        f"{path} checks clean: role(s) {roles}",
    )


# --- the running server ---------------------------------------------------------------------


def _find_server(settings: Settings, config: Path) -> Server:
    server = Server(pid=_server_pid(config))
    if server.pid is not None:
        server.environ = _environ(server.pid)
    host, port = settings.server.host, settings.server.port
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - a bind address read from the config
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if settings.server.tls_cert else "http"
    server.url = f"{scheme}://{shown}:{port}"
    try:
        server.health = _get_health(host, port, settings.server.tls_cert)
    except (OSError, ssl.SSLError, http.client.HTTPException, ValueError) as exc:
        server.error = str(exc) or type(exc).__name__
    return server


def _server_pid(config: Path) -> int | None:
    """The process serving ``config`` (``paddock-target serve --config CONFIG``), if any."""
    wanted = [b"serve", b"--config", str(config).encode()]
    for pid, argv in _processes():
        if any(a.endswith(b"paddock-target") for a in argv) and _contains(argv, wanted):
            return pid
    return None


def _processes() -> Iterator[tuple[int, list[bytes]]]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            yield int(entry), Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue


def _contains(argv: list[bytes], run: list[bytes]) -> bool:
    return any(argv[i : i + len(run)] == run for i in range(len(argv)))


def _environ(pid: int) -> dict[str, str]:
    """The server's own environment: its $HOME and SSH_AUTH_SOCK shape the forbidden list."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def _get_health(host: str, port: int, cert: str | None) -> Health:
    conn: http.client.HTTPConnection
    if cert is None:
        conn = http.client.HTTPConnection(host, port, timeout=5)
    else:
        context = ssl.create_default_context()
        context.load_verify_locations(cert)  # the chain the server presents holds its CA
        # This asks the server's own loopback address, which its certificate may not
        # name; the chain is still verified, and nothing secret is sent.
        context.check_hostname = False
        conn = http.client.HTTPSConnection(host, port, timeout=5, context=context)
    try:
        conn.request("GET", "/v1/health")
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise ValueError(f"/v1/health answered HTTP {response.status}")
    return Health.model_validate_json(body)


def _server(server: Server) -> Finding:
    start = (
        "start it: systemctl start paddock-target (with systemd), or as root "
        "PREFIX/bin/paddock-supervise start (without)"
    )
    if server.health is None:
        where = f" (pid {server.pid})" if server.pid else ""
        return Finding(
            "server", "degraded", f"{server.url} does not answer{where}: {server.error}", start
        )
    pid = f", pid {server.pid}" if server.pid else ""
    health = server.health
    causes = tuple(
        # limits get a finding of their own below, sentence by sentence
        f"{c.cause}: " + ("see limits below" if c.cause == "limits" else c.detail)
        for c in health.causes
    )
    summary = f"{server.url} answers{pid}: health {health.status}, version {health.version}"
    if not causes:
        return Finding("server", "ok", summary)
    return Finding(
        "server", "degraded", summary, "each cause is explained below, with its fix", causes
    )


# --- the launcher ---------------------------------------------------------------------------


def _launcher(settings: Settings) -> Finding:
    """How turns get their role's uid here: root, the launcher (and does it answer?), or not."""
    fence, owner = settings.fence, _state_owner(settings)
    if fence.identity == "server":
        return Finding(
            "launcher",
            "info",
            'every turn runs as the server\'s own uid ([fence] identity = "server"): no '
            "launcher is used, and only the fence stands between a turn and the server's files",
        )
    ids = tuple(f"role {r}: uid {u}, gid {g}" for r, (u, g) in _role_ids(settings).items())
    if fence.launcher is None:
        if owner == 0:
            return Finding(
                "launcher",
                "ok",
                "the server runs as root and starts each turn as its role's uid itself",
                details=ids,
            )
        return Finding(
            "launcher",
            "degraded",
            f"every turn is refused: the server runs as {_name(owner)}, not root, and "
            "[fence] launcher is not set",
            config_file.LAUNCHER_FIX,
        )
    clashes = _id_clashes(settings, owner)
    try:
        pid, hello = asyncio.run(ViaLauncher(fence.launcher).hello())
    except LauncherError as exc:
        return Finding("launcher", "degraded", f"every turn is refused: {exc}", START_HINT)
    if "error" in hello:
        summary = (
            f"the launcher at {fence.launcher} runs as root (pid {pid}) but refused this "
            f"check: {hello['error']}"
        )
        return Finding("launcher", "degraded", summary, "run doctor as root or as the server")
    summary = (
        f"the launcher at {fence.launcher} answers (pid {pid}, root, paddock "
        f"{hello.get('version')}): turns run as their role's uid"
    )
    if clashes:
        return Finding(
            "launcher",
            "degraded",
            summary + ", but it refuses some roles",
            "give each of those roles a uid and gid of its own ([roles.NAME] uid, gid)",
            clashes,
        )
    return Finding("launcher", "ok", summary, details=ids)


def _workspaces(settings: Settings) -> Finding:
    """Whether each role's uid can write its workspaces, the server read them, and no one else."""
    own = settings.fence.identity == "server"
    server = os.getuid() if own else _state_owner(settings)
    try:
        entry = pwd.getpwuid(server)
        primary: int | None = entry.pw_gid
        groups = {entry.pw_gid, *(g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem)}
    except KeyError:
        primary, groups = None, set()
    problems, fixes = [], []
    for role, config in settings.roles.items():
        uid, gid = (server, None) if own else settings.role_ids(role)
        for workspace in config.workspaces:
            said = _workspace_problems(workspace, uid, gid, server, groups)
            problems += [f"role {role}: {workspace} {s}" for s in said]
            if said:
                group = _group_name(primary)
                fixes.append(f"chown {uid}:{group} {workspace} && chmod 2750 {workspace}")
    if not problems:
        return Finding(
            "workspaces",
            "ok",
            "each role's uid can write its workspaces, the server can read them, no one else can",
        )
    return Finding(
        "workspaces",
        "degraded",
        "some workspaces do not fit the uids that use them",
        "; ".join(dict.fromkeys(fixes)) or "create the missing workspaces",
        tuple(problems),
    )


def _workspace_problems(
    path: str, uid: int, gid: int | None, server: int, groups: set[int]
) -> list[str]:
    try:
        st = os.stat(path)
    except OSError as exc:
        return [f"cannot be looked at: {exc.strerror}"]
    mode = stat.S_IMODE(st.st_mode)

    def may(bits: int, who: int, their_groups: set[int]) -> bool:
        if who == 0:
            return True
        if st.st_uid == who:
            return mode & (bits << 6) == bits << 6
        if st.st_gid in their_groups:
            return mode & (bits << 3) == bits << 3
        return mode & bits == bits

    found = []
    if not may(0o3, uid, {gid} if gid is not None else groups):
        found.append(f"is not writable by uid {uid}, which its turns run as")
    if not may(0o5, server, groups):
        found.append(f"cannot be searched and read by the server (uid {server}), which plans there")
    if mode & 0o005:
        found.append(f"has mode {mode:04o}: any uid may enter it, other roles' included")
    return found


def _group_name(gid: int | None) -> str:
    if gid is None:
        return "SERVICE-GROUP"
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _state_owner(settings: Settings) -> int:
    try:
        return settings.state_root.stat().st_uid
    except OSError:
        return os.getuid()


def _role_ids(settings: Settings) -> dict[str, tuple[int, int]]:
    return {role: settings.role_ids(role) for role in settings.roles}


def _id_clashes(settings: Settings, owner: int) -> tuple[str, ...]:
    """Roles the launcher refuses: the server's own uid, or the server's group."""
    try:
        group = pwd.getpwuid(owner).pw_gid
    except KeyError:
        group = None
    found = []
    for role, (uid, gid) in _role_ids(settings).items():
        if uid == owner:
            found.append(f"role {role}: uid {uid} is the server's own")
        if gid == group:
            found.append(f"role {role}: gid {gid} is the server's group")
    return tuple(found)


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# --- the fence backend ----------------------------------------------------------------------


def _backend(settings: Settings | None) -> list[Finding]:
    try:
        bwrap = find_bwrap()
    except BackendError as exc:
        return [Finding("backend", "degraded", str(exc), "apt-get install bubblewrap")]
    version = _bwrap_version(bwrap)
    userns = _userns()
    role, (uid, gid) = _probe_ids(settings)
    identity = for_settings(settings) if settings is not None else InProcess()
    failure = asyncio.run(_probe(bwrap, role, (uid, gid), identity))
    if failure is None:
        return [
            Finding(
                "backend",
                "ok",
                f"{version} at {bwrap} fences a test command as uid {uid} ({userns[0]})",
            )
        ]
    return [
        Finding(
            "backend",
            "degraded",
            f"{version} at {bwrap} cannot make a fence as uid {uid}: {failure}",
            userns[1] or "check that unprivileged user namespaces are allowed (see details)",
            (userns[0],),
        )
    ]


def _probe_ids(settings: Settings | None) -> tuple[str, tuple[int, int]]:
    """A role and its host ids, as turns use them; the server's own where it cannot switch."""
    own = ("", (os.getuid(), os.getgid()))
    if settings is None:
        return own
    role = next(iter(settings.roles))
    try:
        return role, host_ids(settings, role)
    except RefusedError:
        return own


async def _probe(bwrap: str, role: str, ids: tuple[int, int], identity: Identity) -> str | None:
    try:
        return await probe(bwrap, role, ids, identity)
    except (BackendError, OSError) as exc:
        return str(exc)


def _bwrap_version(bwrap: str) -> str:
    try:
        found = subprocess.run(
            [bwrap, "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return "bubblewrap"
    return found.stdout.strip() or "bubblewrap"


def _userns() -> tuple[str, str | None]:
    """What the kernel says about unprivileged user namespaces, and the fix if they are off."""
    limit = _read_int("/proc/sys/user/max_user_namespaces")
    if limit == 0:
        return (
            "user.max_user_namespaces = 0",
            "sysctl -w user.max_user_namespaces=15000 (and persist it in /etc/sysctl.d)",
        )
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        return (
            "kernel.unprivileged_userns_clone = 0",
            "sysctl -w kernel.unprivileged_userns_clone=1 (and persist it in /etc/sysctl.d)",
        )
    if _read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == 1:
        return (
            "AppArmor restricts unprivileged user namespaces",
            "give bwrap an AppArmor profile that allows userns (Ubuntu: the 'bwrap' "
            "profile of the apparmor package), or set "
            "kernel.apparmor_restrict_unprivileged_userns=0",
        )
    return (f"user namespaces allowed, at most {limit}", None)


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _seccomp() -> Finding:
    reason = syscall_filter.unavailable_reason()
    if reason is None:
        return Finding(
            "seccomp",
            "ok",
            "every fence gets the system-call filter (TIOCSTI, TIOCLINUX, TIOCSETD, the new "
            "mount API, clone3, io_uring, the kernel's keyrings and log, bpf, perf events, "
            "userfaultfd, the socket families and protocols a fence does not keep, and "
            "32-bit system calls are refused)",
        )
    return Finding(
        "seccomp",
        "degraded",
        f"turns run without the system-call filter: {reason}",
        "apt-get install python3-seccomp (for the Python the server runs on), "
        "then restart the server",
    )


def abstract_sockets(settings: Settings, abi: int | None = None) -> Finding:
    """Whether a turn with the host's network reaches the host's abstract unix sockets
    (``fence.landlock``; ``abi``: the kernel's Landlock ABI, asked if None)."""
    abi = landlock.abi() if abi is None else abi
    setuid = os.getuid() != 0 and landlock.bwrap_setuid()
    if abi >= landlock.SCOPED_ABI and not setuid:
        return Finding(
            "abstract-sockets",
            "ok",
            f"fences reach no abstract unix socket of the host (Landlock ABI {abi})",
        )
    networked = sorted(role for role, config in settings.roles.items() if config.allow_network)
    why = f"Landlock ABI {abi}, which has no scopes" if abi else "no Landlock in this kernel"
    if abi >= landlock.SCOPED_ABI:
        why = "bubblewrap is setuid here, and a Landlock domain would take no_new_privs, under "
        why += "which it would lose its setuid bit"
    if not networked:
        return Finding(
            "abstract-sockets",
            "info",
            f"no role has the host's network; one that had it would reach every abstract unix "
            f"socket listening on the host ({why})",
        )
    return Finding(
        "abstract-sockets",
        "degraded",
        f"turns of {', '.join(networked)} with the host's network reach every abstract unix "
        f"socket listening on the host, such as a D-Bus bus or a container runtime's ({why})",
        "a kernel with Landlock ABI 6 or later (Linux 6.12) and landlock among its security "
        "modules (the lsm= boot option), or allow_network = false for those roles",
    )


CORE_PATTERN = Path("/proc/sys/kernel/core_pattern")


def crash_dumps(pattern: str | None = None) -> Finding:
    """Where a crash inside a fence goes (``pattern``: ``kernel.core_pattern``, read if None).

    A pattern that pipes makes the kernel start its program as root, outside
    every namespace, for each crash anywhere, reading what the crashed process
    made itself: a turn can crash at will. Any other pattern is a file the
    crashing process writes within its own mount namespace: inside the fence.
    """
    if pattern is None:
        try:
            pattern = CORE_PATTERN.read_text()
        except OSError as exc:
            return Finding("crash-dumps", "info", f"cannot read {CORE_PATTERN}: {exc.strerror}")
    pattern = pattern.strip()
    if not pattern.startswith("|"):
        return Finding(
            "crash-dumps",
            "ok",
            f"a crash inside a fence writes its core file inside the fence ({pattern!r}), "
            "as far as its limit allows",
        )
    program = os.path.basename(pattern[1:].split(maxsplit=1)[0]) if pattern[1:].strip() else "?"
    return Finding(
        "crash-dumps",
        "degraded",
        f"a crash of any process in a fence starts {program} as root on the host "
        "(kernel.core_pattern pipes core dumps to it): every turn can hand it input of its "
        "choosing, and a flaw in it is a way out of the fence",
        "if turns' crash reports are not needed: sysctl -w kernel.core_pattern=core, and the "
        "same in /etc/sysctl.d/ to keep it (a crash then writes a core file inside its fence)",
        (f"kernel.core_pattern = {pattern}",),
    )


# --- limits and cgroups ---------------------------------------------------------------------


def _limits(server: Server) -> Finding:
    always = "wall_s and output_mb are always enforced by the server itself"
    if server.health is None:
        return Finding(
            "limits",
            "degraded",
            "unknown: the server is not answering, and only it "
            "knows which cgroups it could use; " + always,
            "start the server, then run doctor again",
        )
    cause = next((c for c in server.health.causes if c.cause == "limits"), None)
    if cause is None:
        return Finding(
            "limits",
            "ok",
            "memory_mb, pids and cpu are enforced per turn by cgroups "
            f"(the server reports no limits cause); {always}",
        )
    shortfalls = _per_limit(cause.detail)
    return Finding(
        "limits",
        "degraded",
        f"some limits fall short of a per-turn cgroup; {always}",
        "give the server a cgroup it may manage (see cgroups below), then restart it",
        shortfalls,
    )


def _per_limit(detail: str) -> tuple[str, ...]:
    """The health detail, one item per limit (a clause naming no limit stays with the last)."""
    items: list[str] = []
    for clause in (c.strip() for c in detail.split(";") if c.strip()):
        if items and not clause.startswith(CONTROLLERS):
            items[-1] += f"; {clause}"
        else:
            items.append(clause)
    return tuple(items)


def _cgroups(server: Server) -> Finding:
    """Read-only: which cgroup hierarchies the server's uid could make turn cgroups in."""
    pid = server.pid or os.getpid()
    whose = (
        f"the server (pid {pid})" if server.pid else f"this process (pid {pid}; no server found)"
    )
    try:
        places = memberships(Path(f"/proc/{pid}/cgroup").read_text())
        mounts = cgroup_mounts(Path(f"/proc/{pid}/mountinfo").read_text())
    except OSError as exc:
        return Finding("cgroups", "degraded", f"cannot read the cgroups of {whose}: {exc}")
    lines, usable = _v2_lines(places, mounts)
    for controller in CONTROLLERS:
        if controller in usable:
            continue
        line, ok = _v1_line(controller, places, mounts)
        lines.append(line)
        if ok:
            usable.add(controller)
    missing = [c for c in CONTROLLERS if c not in usable]
    if not missing:
        return Finding(
            "cgroups",
            "ok",
            f"{whose} may create turn cgroups for memory, pids and cpu",
            details=tuple(lines),
        )
    user = pwd.getpwuid(os.getuid()).pw_name
    return Finding(
        "cgroups",
        "degraded",
        f"{whose} cannot create turn cgroups for {', '.join(missing)} (not delegated to {user})",
        "under systemd, run the server from a unit with Delegate=yes (paddock-deploy's unit "
        f"has it); without systemd, as root, for each of {' '.join(missing)}: make a cgroup, "
        f"chown it to {user}, and start the server inside it (e.g. mkdir "
        f"/sys/fs/cgroup/memory/paddock && chown {user} /sys/fs/cgroup/memory/paddock && "
        "echo $$ > /sys/fs/cgroup/memory/paddock/cgroup.procs before starting the supervisor)",
        tuple(lines),
    )


def _v2_lines(memberships: dict[str, str], mounts: list[CgroupMount]) -> tuple[list[str], set[str]]:
    mount = v2_mount(mounts)
    path = memberships.get("")
    if mount is None or path is None:
        return ["cgroup v2: not mounted"], set()
    own = under(mount, path)
    if own is None:
        return [f"cgroup v2 at {mount.point}: the server's cgroup {path} is not visible"], set()
    base = own.parent if own.name == "paddock-server" else own
    available = set(words(base / "cgroup.controllers")) & set(CONTROLLERS)
    writable = os.access(base, os.W_OK) and os.access(base / "cgroup.subtree_control", os.W_OK)
    if not available:
        return [f"cgroup v2 at {base}: none of memory, pids, cpu is available there"], set()
    if not writable:
        return [
            f"cgroup v2 at {base}: {', '.join(sorted(available))} available, but not "
            "writable by this user (not delegated)"
        ], set()
    return [f"cgroup v2 at {base}: delegated, with {', '.join(sorted(available))}"], available


def _v1_line(
    controller: str, memberships: dict[str, str], mounts: list[CgroupMount]
) -> tuple[str, bool]:
    mount = v1_mount(mounts, controller)
    path = memberships.get(controller)
    if mount is None or path is None:
        return f"{controller}: no cgroup v1 hierarchy, and none in v2", False
    base = under(mount, path)
    if base is None:
        return f"{controller}: cgroup v1, but the server's cgroup {path} is not visible", False
    if os.access(base, os.W_OK):
        return f"{controller}: cgroup v1 at {base}, writable by this user", True
    owner = _owner(base)
    return f"{controller}: cgroup v1 at {base}, owned by {owner}: not writable by this user", False


def _owner(path: Path) -> str:
    try:
        uid = path.stat().st_uid
    except OSError:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# --- files and disk -------------------------------------------------------------------------


def _state_root(settings: Settings) -> Finding:
    root = settings.state_root
    try:
        st = root.lstat()
    except FileNotFoundError:
        return Finding("state", "info", f"{root} does not exist yet; the server makes it, 0711")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        me = pwd.getpwuid(os.getuid()).pw_name
        return Finding(
            "state",
            "degraded",
            f"{root} belongs to {_owner(root)}, not to the user the server runs as",
            f"chown -R {me}: {root}",
        )
    # Others may search it (turns reach their home below it by path), never list or write it.
    if mode & 0o066:
        return Finding(
            "state",
            "degraded",
            f"{root} has mode {mode:04o}: others may list or change turns, spools and the ledger",
            f"chmod 0711 {root}",
        )
    return Finding("state", "ok", f"{root} is private ({mode:04o}, {_owner(root)})")


def _disk(settings: Settings) -> Finding:
    root = settings.state_root
    where = root if root.exists() else root.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Finding("disk", "degraded", f"cannot measure free space under {where}: {exc}")
    free = f"{usage.free / (1 << 30):.1f} GiB free under {where}"
    floor = low_water(usage.total) >> 20
    if usage.free < low_water(usage.total):
        return Finding(
            "disk",
            "degraded",
            f"only {free}; health degrades below {floor} MiB",
            "free space, or lower retention_h in [server]",
        )
    return Finding("disk", "ok", f"{free} (health degrades below {floor} MiB)")


def _tls(settings: Settings) -> list[Finding]:
    cert, key = settings.server.tls_cert, settings.server.tls_key
    if cert is None or key is None:
        return [Finding("tls", "info", "plain HTTP, allowed only on loopback: reach it over SSH")]
    return [_tls_key(Path(key)), _tls_cert(Path(cert))]


def _tls_key(key: Path) -> Finding:
    try:
        st = key.lstat()
    except OSError as exc:
        return Finding("tls-key", "degraded", f"cannot look at {key}: {exc}")
    mode = stat.S_IMODE(st.st_mode)
    me = pwd.getpwuid(os.getuid()).pw_name
    if stat.S_ISLNK(st.st_mode):
        return Finding("tls-key", "degraded", f"{key} is a symlink", "point tls_key at the file")
    if st.st_uid != os.getuid():
        return Finding(
            "tls-key",
            "degraded",
            f"{key} belongs to {_owner(key)}; the server ({me}) must own it",
            f"chown {me} {key}",
        )
    if mode & 0o077:
        return Finding(
            "tls-key",
            "degraded",
            f"{key} has mode {mode:04o}: others can read the server's private key",
            f"chmod 0600 {key}, and consider a new key",
        )
    return Finding("tls-key", "ok", f"{key} is {me}'s alone (0600)")


def _tls_cert(cert: Path) -> Finding:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    try:
        leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError) as exc:
        return Finding("tls-cert", "degraded", f"cannot read {cert}: {exc}")
    left = leaf.not_valid_after_utc - dt.datetime.now(dt.UTC)
    ca = cert.parent / "ca.pem"
    pin = ""
    if ca.is_file():
        with contextlib.suppress(ValueError, OSError):
            ca_cert = x509.load_pem_x509_certificate(ca.read_bytes())
            pin = f"; CA SHA-256 {ca_cert.fingerprint(hashes.SHA256()).hex(':').upper()}"
    if left.days < 0:
        return Finding(
            "tls-cert",
            "degraded",
            f"{cert} expired {-left.days} day(s) ago",
            "make a new certificate (move the TLS files away and re-run paddock-deploy)",
        )
    if left.days < CERT_RENEW_DAYS:
        return Finding(
            "tls-cert",
            "degraded",
            f"{cert} expires in {left.days} day(s)",
            "make a new certificate before then",
        )
    return Finding("tls-cert", "ok", f"{cert} is valid for {left.days} more days{pin}")


# --- the forbidden list ---------------------------------------------------------------------


def _forbidden(settings: Settings, server: Server) -> list[Finding]:
    environ = server.environ or dict(os.environ)
    source = "the server's environment" if server.environ else "this process's environment"
    findings = []
    shown: tuple[str, ...] = ()
    for role in settings.roles:
        listed = forbidden_for(settings, role, environ)
        shown = shown or tuple(dict.fromkeys(f"{e.path}  ({e.why})" for e in listed.entries))
        findings += _workspace_clashes(settings, role, listed.entries)
    if "SSH_AUTH_SOCK" in environ:
        findings.append(
            Finding(
                "forbidden",
                "info",
                "the server has an SSH agent socket "
                f"({environ['SSH_AUTH_SOCK']}); it is forbidden to every turn, "
                "but a server should not carry one: start it without",
            )
        )
    summary = (
        f"{len(shown)} paths no turn of any role may see, nor anything inside them, "
        f"nor any directory holding them (homes from {source}); each role's own state "
        "dir is its only exception"
    )
    return [Finding("forbidden", "info", summary, details=shown), *findings]


def _workspace_clashes(
    settings: Settings, role: str, entries: tuple[ForbiddenEntry, ...]
) -> list[Finding]:
    found = []
    for workspace in settings.roles[role].workspaces:
        canonical = canonical_path(workspace)
        for entry in entries:
            conflict = mount_conflict(canonical, entry.path)
            if conflict is None:
                continue
            how = (
                "contains"
                if conflict == "parent"
                else "is"
                if conflict == "exact"
                else "lies inside"
            )
            found.append(
                Finding(
                    "forbidden",
                    "degraded",
                    f"role {role}: workspace {workspace} {how} {entry.path} ({entry.why}); turns "
                    "working there are refused",
                    "move the workspace, or the forbidden path",
                )
            )
    return found


# --- running as the server's user -----------------------------------------------------------


def _rerun_as_state_owner(config: Path, as_json: bool) -> int | None:
    """As root, run the checks again as the state root's owner: the user the server runs as."""
    if os.geteuid() != 0:
        return None
    settings, _ = config_file.check(config)
    if settings is None:
        return None
    try:
        owner = settings.state_root.stat().st_uid
    except OSError:
        return None
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    if owner == 0 or setpriv is None:
        return None
    pw = pwd.getpwuid(owner)
    if not as_json:
        print(
            f"(running the checks as {pw.pw_name}, the owner of {settings.state_root}, "
            "as the server runs)",
            flush=True,
        )
    argv = [
        setpriv,
        f"--reuid={pw.pw_uid}",
        f"--regid={pw.pw_gid}",
        "--init-groups",
        "--no-new-privs",
        "--",
        sys.executable,
        "-m",
        "target_side.tools.cli",
        "doctor",
        "--config",
        str(config),
        *(["--json"] if as_json else []),
    ]
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": pw.pw_dir,
        "USER": pw.pw_name,
        "LOGNAME": pw.pw_name,
    }
    return subprocess.run(argv, env=env, cwd="/", check=False).returncode


# --- output ---------------------------------------------------------------------------------


def _as_text(config: Path, findings: list[Finding]) -> str:
    me = pwd.getpwuid(os.getuid()).pw_name
    lines = [
        f"paddock-target doctor: {config}, on {socket.gethostname()}, checked as {me} "
        f"(uid {os.getuid()})",
        "",
    ]
    for f in findings:
        lines.append(f"{f.status.upper():<9} {f.area:<10} {f.summary}")
        lines += [f"{'':21}- {detail}" for detail in f.details]
        if f.fix:
            lines.append(f"{'':21}fix: {f.fix}")
    degraded = [f.area for f in findings if f.status == "degraded"]
    lines.append("")
    if degraded:
        lines.append(
            f"{len(degraded)} degraded ({', '.join(dict.fromkeys(degraded))}): each fix is above"
        )
    else:
        lines.append("everything is enforced")
    return "\n".join(lines)


def _as_json(config: Path, findings: list[Finding]) -> str:
    return json.dumps(
        {
            "config": str(config),
            "uid": os.getuid(),
            "degraded": any(f.status == "degraded" for f in findings),
            "findings": [asdict(f) for f in findings],
        }
    )
