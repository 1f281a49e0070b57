"""A turn's latency through the privileged launcher against the same turn started in process.

    .venv/bin/python bench/launcher_latency.py [--runs N] [--pause-ms MS]     (as root)

Two targets from one config, on the same interpreter (the system python, this
checkout on its path), run interleaved so load hits both alike:

- ``in process``: the server runs as root and starts bubblewrap as the role itself;
- ``through the launcher``: the server runs as a throwaway service user and each
  turn is a connection to ``paddock-target launcher`` (root), which starts it. The
  server runs in a cgroup v1 ``pids`` cgroup of its own, as a unit's ``Delegate=``
  would give it (where this machine has that hierarchy), so its turns get cgroups
  of their own as on a deployed target; without one, they get rlimits only.

A turn of ``true`` is timed from ``POST /v1/turns`` to its exit event, over one
kept HTTP connection; with ``--pause-ms``, each after an untimed pause, as an
agent's think time leaves a target idle (a process moved into a cgroup after the
kernel's cgroup locks were left alone a while waits out a grace period; moves a
few milliseconds apart do not). Everything is removed on the way out, the user included.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from target_side.config import load_settings  # noqa: E402

PYTHON = "/usr/bin/python3"
TOKEN = "bench-token"
CAPS = "-all,+setuid,+setgid,+kill,+chown,+dac_override"


def _env(home: str) -> dict[str, str]:
    site = sysconfig.get_paths()["purelib"]
    return {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'deploy'}:{site}",
        "HOME": home,
        "LANG": "C.UTF-8",
    }


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(path: Path, port: int, state: Path, workspace: Path, socket_path: Path | None) -> None:
    launcher = f'launcher = "{socket_path}"\n' if socket_path else ""
    path.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nstate_root = "{state}"\n[fence]\n{launcher}'
        f'[roles.builder]\ntoken_sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"\n'
        f'workspaces = ["{workspace}"]\n'
    )


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


@contextlib.contextmanager
def _targets(base: Path, user: str) -> Iterator[dict[str, str]]:
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
        check=True,
        capture_output=True,
    )
    uid, gid = pwd.getpwnam(user).pw_uid, grp.getgrnam(user).gr_gid
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("etc", "run", "state-root", "state-user"):
            (base / name).mkdir(mode=0o755)
        os.chown(base / "state-user", uid, gid)
        (base / "state-user").chmod(0o711)
        (base / "state-root").chmod(0o711)
        ports = {"in process": _port(), "through the launcher": _port()}
        sock = base / "run" / "launcher.sock"
        workspace = base / "work"
        workspace.mkdir()
        as_root = base / "etc" / "root.toml"
        as_user = base / "etc" / "user.toml"
        _config(as_root, ports["in process"], base / "state-root", workspace, None)
        _config(as_user, ports["through the launcher"], base / "state-user", workspace, sock)
        for config in (as_root, as_user):
            os.chown(config, 0, gid)
            config.chmod(0o640)
        role_uid, _ = load_settings(as_user).role_ids("builder")
        os.chown(workspace, role_uid, gid)
        workspace.chmod(0o2750)
        cli = [PYTHON, "-m", "target_side.tools.cli"]
        quiet: dict[str, Any] = {
            "stdout": subprocess.DEVNULL,
            "stderr": subprocess.DEVNULL,
            "cwd": "/",
        }
        launcher = ["setpriv", f"--bounding-set={CAPS}", "--inh-caps=-all", "--no-new-privs", "--"]
        procs.append(
            subprocess.Popen(
                [*launcher, *cli, "launcher", "--config", str(as_user)], env=_env("/"), **quiet
            )
        )
        drop = [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            "--no-new-privs",
            "--",
        ]
        delegated = _delegated_cgroup(base.name, uid, gid)
        join = ["sh", "-c", f'echo $$ > {delegated}/cgroup.procs && exec "$@"', "sh"]
        procs.append(
            subprocess.Popen(
                [*(join if delegated else []), *drop, *cli, "serve", "--config", str(as_user)],
                env=_env(str(base / "state-user")),
                **quiet,
            )
        )
        procs.append(
            subprocess.Popen([*cli, "serve", "--config", str(as_root)], env=_env("/"), **quiet)
        )
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for url in urls.values():
            _wait_up(url)
        yield urls
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        _remove_cgroup(base.name)
        subprocess.run(["userdel", user], check=False, capture_output=True)
        with contextlib.suppress(KeyError):
            grp.getgrnam(user)
            subprocess.run(["groupdel", user], check=False, capture_output=True)


PIDS = Path("/sys/fs/cgroup/pids")


def _delegated_cgroup(name: str, uid: int, gid: int) -> Path | None:
    """A cgroup v1 pids cgroup given to ``uid``, as a unit's ``Delegate=`` would; None
    where this machine has no such hierarchy."""
    cgroup = PIDS / name
    try:
        cgroup.mkdir()
    except OSError:
        return None
    for entry in ("", "cgroup.procs", "tasks", "cgroup.clone_children"):
        with contextlib.suppress(OSError):
            os.chown(cgroup / entry, uid, gid)
    return cgroup


def _remove_cgroup(name: str) -> None:
    cgroup = PIDS / name
    for _ in range(100):
        for leaf in sorted(cgroup.glob("**/"), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                leaf.rmdir()
        if not cgroup.exists():
            return
        time.sleep(0.05)


def _turn(client: httpx.Client) -> float:
    started = time.perf_counter()
    turn = client.post("/v1/turns", json={"role": "builder", "argv": ["true"]}).json()
    with client.stream("GET", f"/v1/turns/{turn['turn_id']}/events") as events:
        for line in events.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["kind"] in ("exit", "refused"):
                exit_code = json.loads(line[6:]).get("exit_code")
                if exit_code != 0:
                    raise SystemExit(f"a bench turn ended {exit_code}: {line}")
                break
    return (time.perf_counter() - started) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--pause-ms", type=float, default=0.0, help="untimed, before each turn")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run it as root: it starts a root launcher and a server as a throwaway user")
        return 2
    base = Path(tempfile.mkdtemp(prefix="pdk-bench-launcher-", dir="/tmp"))
    base.chmod(0o755)
    times: dict[str, list[float]] = {}
    try:
        with _targets(base, f"pdkb{secrets.token_hex(2)}") as urls:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            clients = {
                n: httpx.Client(base_url=u, headers=headers, timeout=60) for n, u in urls.items()
            }
            for client in clients.values():
                for _ in range(3):  # warm-up: first imports, first home, first connection
                    _turn(client)
            for _ in range(args.runs):
                for name, client in clients.items():
                    time.sleep(args.pause_ms / 1000)
                    times.setdefault(name, []).append(_turn(client))
            for client in clients.values():
                client.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    baseline = statistics.median(times["in process"])
    pause = f", {args.pause_ms:g} ms apart" if args.pause_ms else ""
    print(
        f"a turn of `true`, {args.runs} runs each, interleaved{pause}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'':24}{'p50 ms':>9}{'p95 ms':>9}{'mean ms':>9}{'x in process':>14}")
    for name, samples in times.items():
        p50 = statistics.median(samples)
        p95 = statistics.quantiles(samples, n=20)[-1]
        print(
            f"{name:24}{p50:9.1f}{p95:9.1f}{statistics.fmean(samples):9.1f}{p50 / baseline:14.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
