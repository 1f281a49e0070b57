#!/usr/bin/env python3
"""paddock-supervise: keep one paddock-target server and its launcher running where systemd
is not PID 1.

paddock-deploy installs this module's own source as ``PREFIX/bin/paddock-supervise``
and writes its settings beside it, ``PREFIX/bin/paddock-supervise.json`` (the
service user, the prefix, the config, the run directory, the launcher's
directory, the interpreter). It imports nothing of paddock, so it runs as a
file of its own. As root:

    python3 PREFIX/bin/paddock-supervise start     start the launcher, then the server
    python3 PREFIX/bin/paddock-supervise stop      stop the server, then the launcher
    python3 PREFIX/bin/paddock-supervise restart   restart both (new release or config)
    python3 PREFIX/bin/paddock-supervise status    what runs, as JSON

Nothing starts it at boot; without systemd, add the ``start`` line to root's
crontab with ``@reboot`` in front. Two keepers run, each restarting its process
whenever it exits (backing off up to 30 s):

- the server's, as the service user with no capabilities and no_new_privs (as
  the systemd unit would), its pid files and logs in the run directory;
- the launcher's, as root, running ``paddock-target launcher`` with only the
  capabilities the launcher's unit would give it, its pid files and log in the
  launcher directory (root's own). It tells the launcher where to say it is
  ready (``NOTIFY_SOCKET``, as systemd does), so ``start`` starts the server
  only once the launcher listens.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

LOG_LIMIT = 10 << 20
STOP_WAIT_S = 25.0
START_WAIT_S = 20.0
SERVER_PATH = "/usr/local/bin:/usr/bin:/bin"
SETTINGS_KEYS = ("user", "prefix", "config", "run_dir", "launcher_dir", "python")
LAUNCHER_CAPS = "-all,+setuid,+setgid,+kill,+chown,+dac_override"
"""What the launcher may do as root: switch uid and gid, signal the turns it started, give a
role its home, write the server's turn cgroups. The same set its systemd unit bounds it to."""


def drop_privileges(uid: int, gid: int) -> list[str]:
    """The prefix that runs a command as the service user, as the server itself runs."""
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--init-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


def server_env(user: str, home: str) -> dict[str, str]:
    """The whole environment of the server and of anything run as the service user."""
    return {"PATH": SERVER_PATH, "HOME": home, "USER": user, "LOGNAME": user, "LANG": "C.UTF-8"}


def launcher_caps() -> list[str]:
    """The prefix that runs the launcher as root with only its own capabilities."""
    return [
        "setpriv",
        f"--bounding-set={LAUNCHER_CAPS}",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ]


class SettingsError(Exception):
    """The settings file beside the script is missing, untrusted or malformed."""


@dataclass(frozen=True)
class Settings:
    """What the deploy wrote beside the script; ``script`` is the script's own path."""

    user: str
    prefix: str
    config: str
    run_dir: str
    launcher_dir: str
    python: str
    script: str

    @classmethod
    def beside(cls, script: str) -> Settings:
        path = script + ".json"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SettingsError(f"cannot read {path}: {exc.strerror}") from exc
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            # Root acts on what this file says: only root may have written it.
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                raise SettingsError(
                    f"{path} must be a regular file of root's, not writable by others"
                )
            try:
                data = json.loads(f.read(65536))
            except ValueError as exc:
                raise SettingsError(f"{path} is not JSON: {exc}") from exc
        if not isinstance(data, dict) or sorted(data) != sorted(SETTINGS_KEYS):
            raise SettingsError(f"{path} must hold exactly {', '.join(SETTINGS_KEYS)}")
        if not all(isinstance(data[k], str) for k in SETTINGS_KEYS):
            raise SettingsError(f"{path}: every value must be a string")
        return cls(script=script, **{k: data[k] for k in SETTINGS_KEYS})


def signal_pid(pid: int, sig: int) -> int | None:
    """Signal ``pid`` through a pidfd (a pid recycled in between is never signalled)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        signal.pidfd_send_signal(fd, sig)
    except OSError:
        os.close(fd)
        return None
    return fd


def wait_fd(fd: int, timeout: float) -> bool:
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


class Supervisor:
    """The commands, run as root; ``run``, the server's keeper as the service user; and
    ``run-launcher``, the launcher's keeper as root."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings

    def account(self) -> pwd.struct_passwd:
        return pwd.getpwnam(self.s.user)

    def path(self, name: str) -> str:
        return os.path.join(self.s.run_dir, name)

    def root_path(self, name: str) -> str:
        return os.path.join(self.s.launcher_dir, name)

    # --- what runs, as root sees it

    def read_owned(self, path: str, uid: int) -> str | None:
        """A file, only if it is a regular file of ``uid``."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                return None
            return f.read(65536).decode(errors="replace")

    def ours(self, pid: int, uid: int, *needles: str) -> bool:
        """Whether ``pid`` runs as ``uid`` with every needle in its command line.

        Root signals only such a process: a pid file written by the service user
        cannot aim root at anyone else's process.
        """
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, StopIteration):
            return False
        return all(u == str(uid) for u in uids) and all(n.encode() in argv for n in needles)

    def keeper_pid(self, launcher: bool = False) -> int | None:
        if launcher:
            text = self.read_owned(self.root_path("keeper.pid"), 0)
            needles: tuple[str, ...] = (self.s.script, "run-launcher")
            uid = 0
        else:
            uid = self.account().pw_uid
            text = self.read_owned(self.path("supervisor.pid"), uid)
            needles = (self.s.script, "run")
        if text and text.strip().isdigit() and self.ours(int(text), uid, *needles):
            return int(text)
        return None

    def supervisor_pid(self) -> int | None:
        return self.keeper_pid()

    def child_info(self, launcher: bool = False) -> dict[str, Any] | None:
        uid = 0 if launcher else self.account().pw_uid
        where = self.root_path("launcher.json") if launcher else self.path("server.json")
        text = self.read_owned(where, uid)
        try:
            info = json.loads(text) if text else None
        except ValueError:
            return None
        if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
            return None
        info["alive"] = self.ours(info["pid"], uid, "launcher" if launcher else "serve")
        return info

    def server_info(self) -> dict[str, Any] | None:
        return self.child_info()

    # --- the commands, as root

    def status(self) -> int:
        pid = self.supervisor_pid()
        info = self.server_info() if pid else None
        keeper = self.keeper_pid(launcher=True)
        launcher = self.child_info(launcher=True) if keeper else None
        print(
            json.dumps(
                {
                    "supervisor_pid": pid,
                    "server": info,
                    "log": self.path("server.log"),
                    "launcher_keeper_pid": keeper,
                    "launcher": launcher,
                    "launcher_log": self.root_path("launcher.log"),
                }
            )
        )
        return 0

    def start(self) -> int:
        if os.geteuid() != 0:
            print(
                f"paddock-supervise: start it as root (it drops to {self.s.user})", file=sys.stderr
            )
            return 2
        if not self.start_launcher():
            log = self.root_path("launcher.log")
            print(f"paddock-supervise: the launcher did not start; see {log}", file=sys.stderr)
            return 1
        if self.supervisor_pid():
            return self.status()
        pw = self.account()
        subprocess.Popen(
            [*drop_privileges(pw.pw_uid, pw.pw_gid), self.s.python, self.s.script, "run"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=server_env(self.s.user, pw.pw_dir),
            start_new_session=True,
            close_fds=True,
        )
        if not wait_for(lambda: (self.server_info() or {}).get("alive"), START_WAIT_S):
            log = self.path("server.log")
            print(f"paddock-supervise: the server did not start; see {log}", file=sys.stderr)
            return 1
        return self.status()

    def launcher_ready(self, other_than: int | None = None) -> bool:
        info = self.child_info(launcher=True) or {}
        return bool(info.get("alive") and info.get("ready") and info.get("pid") != other_than)

    def start_launcher(self) -> bool:
        if self.keeper_pid(launcher=True):
            return wait_for(self.launcher_ready, START_WAIT_S)
        os.makedirs(self.s.launcher_dir, mode=0o700, exist_ok=True)
        subprocess.Popen(
            [self.s.python, self.s.script, "run-launcher"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env={"PATH": SERVER_PATH, "LANG": "C.UTF-8"},
            start_new_session=True,
            close_fds=True,
        )
        return wait_for(self.launcher_ready, START_WAIT_S)

    def stop(self) -> int:
        for launcher in (False, True):  # the server first: it ends its turns itself
            pid = self.keeper_pid(launcher)
            if pid is None:
                continue
            child = self.child_info(launcher)
            fd = signal_pid(pid, signal.SIGTERM)
            if fd is not None and not wait_fd(fd, STOP_WAIT_S):
                signal_pid(pid, signal.SIGKILL)
                if child and child["alive"]:
                    signal_pid(child["pid"], signal.SIGKILL)
        return self.status()

    def restart(self) -> int:
        pid = self.supervisor_pid()
        keeper = self.keeper_pid(launcher=True)
        if pid is None or keeper is None:
            self.stop()
            return self.start()
        launcher_before = (self.child_info(launcher=True) or {}).get("pid")
        signal_pid(keeper, signal.SIGHUP)
        if not wait_for(lambda: self.launcher_ready(launcher_before), STOP_WAIT_S + 20):
            log = self.root_path("launcher.log")
            print(f"paddock-supervise: the launcher did not come back; see {log}", file=sys.stderr)
            return 1
        before = (self.server_info() or {}).get("pid")
        signal_pid(pid, signal.SIGHUP)

        def fresh() -> bool:
            info = self.server_info()
            return bool(info and info["alive"] and info["pid"] != before)

        if not wait_for(fresh, STOP_WAIT_S + 20):
            log = self.path("server.log")
            print(f"paddock-supervise: the server did not come back; see {log}", file=sys.stderr)
            return 1
        return self.status()

    # --- the keepers

    def write_atomic(self, path: str, text: str) -> None:
        temp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temp, path)

    def open_log(self, path: str) -> int:
        try:
            if os.lstat(path).st_size > LOG_LIMIT:
                os.replace(path, path + ".1")
        except FileNotFoundError:
            pass
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(path, flags, 0o600)

    def note(self, text: str, where: str | None = None) -> None:
        fd = self.open_log(where or self.path("supervisor.log"))
        try:
            os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n".encode())
        finally:
            os.close(fd)

    def run(self) -> int:
        pw = self.account()
        if os.getuid() != pw.pw_uid:
            print("paddock-supervise: run is for the service user; use start", file=sys.stderr)
            return 2
        os.umask(0o077)
        os.makedirs(self.s.run_dir, mode=0o700, exist_ok=True)
        self.stop_stale(self.server_info(), lambda text: self.note(text))
        return self.keep(
            self.path("supervisor.lock"),
            self.path("supervisor.pid"),
            (self.path("server.json"),),
            lambda text: self.note(text),
            lambda wanted: self.serve_once(pw, wanted),
        )

    def run_launcher(self) -> int:
        if os.geteuid() != 0:
            print("paddock-supervise: run-launcher is for root; use start", file=sys.stderr)
            return 2
        os.umask(0o077)
        os.makedirs(self.s.launcher_dir, mode=0o700, exist_ok=True)

        def note(text: str) -> None:
            self.note(text, self.root_path("keeper.log"))

        self.stop_stale(self.child_info(launcher=True), note)
        return self.keep(
            self.root_path("keeper.lock"),
            self.root_path("keeper.pid"),
            (self.root_path("launcher.json"),),
            note,
            self.launch_once,
        )

    def keep(
        self,
        lock_path: str,
        pid_path: str,
        leftovers: tuple[str, ...],
        note: Callable[[str], None],
        once: Callable[[dict[str, bool]], None],
    ) -> int:
        """Run ``once`` again whenever it returns, until asked to stop; SIGHUP runs it afresh."""
        lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 1  # another keeper holds it
        wanted = {"stop": False, "restart": False}

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            wanted["restart" if signum == signal.SIGHUP else "stop"] = True

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)
        self.write_atomic(pid_path, str(os.getpid()))
        note(f"keeper {os.getpid()} started")
        backoff = 1.0
        while not wanted["stop"]:
            started = time.monotonic()
            once(wanted)
            if wanted["stop"]:
                break
            if wanted["restart"]:
                wanted["restart"], backoff = False, 1.0
                continue
            if time.monotonic() - started > 60:
                backoff = 1.0
            deadline = time.monotonic() + backoff
            while time.monotonic() < deadline and not wanted["stop"] and not wanted["restart"]:
                time.sleep(0.1)
            backoff = min(backoff * 2, 30.0)
        for path in (*leftovers, pid_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        note(f"keeper {os.getpid()} stopped")
        return 0

    def stop_stale(self, stale: dict[str, Any] | None, note: Callable[[str], None]) -> None:
        """A process left by a keeper that was killed outright still holds its port or socket."""
        if stale and stale["alive"]:
            note(f"stopping pid {stale['pid']}, left by a keeper that died")
            fd = signal_pid(stale["pid"], signal.SIGTERM)
            if fd is not None and not wait_fd(fd, STOP_WAIT_S):
                signal_pid(stale["pid"], signal.SIGKILL)

    def serve_once(self, pw: pwd.struct_passwd, wanted: dict[str, bool]) -> None:
        """Start the current release's server and wait until it ends or is asked to."""
        release = os.path.realpath(os.path.join(self.s.prefix, "current"))
        log = self.open_log(self.path("server.log"))
        try:
            child = subprocess.Popen(
                [
                    os.path.join(release, "bin", "paddock-target"),
                    "serve",
                    "--config",
                    self.s.config,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=pw.pw_dir,
                env=server_env(self.s.user, pw.pw_dir),
                close_fds=True,
            )
        except OSError as exc:
            self.note(f"cannot start the server from {release}: {exc}")
            return
        finally:
            os.close(log)
        started = {"pid": child.pid, "release": release, "started_at": time.time()}
        self.write_atomic(self.path("server.json"), json.dumps(started))
        self.note(f"server {child.pid} started from {release}")
        self.wait_child(child, wanted)
        self.note(f"server {child.pid} ended with status {child.returncode}")

    def launch_once(self, wanted: dict[str, bool]) -> None:
        """Start the current release's launcher as root, note when it listens, wait for its end."""
        release = os.path.realpath(os.path.join(self.s.prefix, "current"))
        log = self.open_log(self.root_path("launcher.log"))
        ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        address = f"paddock-launcher-{os.getpid()}-{time.monotonic_ns()}"
        try:
            ready.bind("\0" + address)
            child = subprocess.Popen(
                [
                    *launcher_caps(),
                    os.path.join(release, "bin", "paddock-target"),
                    "launcher",
                    "--config",
                    self.s.config,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd="/",
                env={"PATH": SERVER_PATH, "LANG": "C.UTF-8", "NOTIFY_SOCKET": "@" + address},
                close_fds=True,
            )
        except OSError as exc:
            ready.close()
            self.note(
                f"cannot start the launcher from {release}: {exc}", self.root_path("keeper.log")
            )
            return
        finally:
            os.close(log)
        info = {"pid": child.pid, "release": release, "started_at": time.time(), "ready": False}
        self.write_atomic(self.root_path("launcher.json"), json.dumps(info))
        if self.await_ready(ready, child, wanted):
            info["ready"] = True
            self.write_atomic(self.root_path("launcher.json"), json.dumps(info))
        ready.close()
        self.wait_child(child, wanted)
        self.note(
            f"launcher {child.pid} ended with status {child.returncode}",
            self.root_path("keeper.log"),
        )

    def await_ready(
        self, ready: socket.socket, child: subprocess.Popen[bytes], wanted: dict[str, bool]
    ) -> bool:
        """Whether the launcher said ``READY=1`` (it listens) before it ended or time ran out."""
        deadline = time.monotonic() + START_WAIT_S
        while child.poll() is None and not wanted["stop"] and not wanted["restart"]:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if select.select([ready], [], [], min(0.2, left))[0]:
                return b"READY=1" in ready.recv(4096).split(b"\n")
        return False

    def wait_child(self, child: subprocess.Popen[bytes], wanted: dict[str, bool]) -> None:
        while child.poll() is None and not wanted["stop"] and not wanted["restart"]:
            time.sleep(0.2)
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=STOP_WAIT_S - 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


COMMANDS = ("start", "stop", "restart", "status", "run", "run-launcher")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    script = os.path.abspath(sys.argv[0])
    if len(args) != 1 or args[0] not in COMMANDS:
        print(f"usage: {script} start|stop|restart|status", file=sys.stderr)
        return 2
    try:
        supervisor = Supervisor(Settings.beside(script))
    except SettingsError as exc:
        print(f"paddock-supervise: {exc}", file=sys.stderr)
        return 2
    command: Callable[[], int] = getattr(supervisor, args[0].replace("-", "_"))
    return command()


if __name__ == "__main__":
    sys.exit(main())
