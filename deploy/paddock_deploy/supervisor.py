#!/usr/bin/env python3
"""paddock-supervise: keep one paddock-target server running where systemd is not PID 1.

paddock-deploy installs this module's own source as ``PREFIX/bin/paddock-supervise``
and writes its settings beside it, ``PREFIX/bin/paddock-supervise.json`` (the
service user, the prefix, the config, the run directory, the interpreter). It
imports nothing of paddock, so it runs as a file of its own. As root:

    python3 PREFIX/bin/paddock-supervise start     start the supervisor, as the service user
    python3 PREFIX/bin/paddock-supervise stop      stop the supervisor and the server
    python3 PREFIX/bin/paddock-supervise restart   restart the server (new release or config)
    python3 PREFIX/bin/paddock-supervise status    what runs, as JSON

Nothing starts it at boot; without systemd, add the ``start`` line to root's
crontab with ``@reboot`` in front. The supervisor runs as the service user with
no capabilities and no_new_privs (as the systemd unit would), restarts the
server whenever it exits (backing off up to 30 s), and keeps its pid files and
logs in the run directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import select
import signal
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
SETTINGS_KEYS = ("user", "prefix", "config", "run_dir", "python")


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


class SettingsError(Exception):
    """The settings file beside the script is missing, untrusted or malformed."""


@dataclass(frozen=True)
class Settings:
    """What the deploy wrote beside the script; ``script`` is the script's own path."""

    user: str
    prefix: str
    config: str
    run_dir: str
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
    """The commands, run as root, and ``run``, the supervisor itself as the service user."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings

    def account(self) -> pwd.struct_passwd:
        return pwd.getpwnam(self.s.user)

    def path(self, name: str) -> str:
        return os.path.join(self.s.run_dir, name)

    # --- what runs, as root sees it

    def read_owned(self, name: str) -> str | None:
        """A file in the run directory, only if it is a regular file of the service user."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != self.account().pw_uid or not stat.S_ISREG(st.st_mode):
                return None
            return f.read(65536).decode(errors="replace")

    def ours(self, pid: int, *needles: str) -> bool:
        """Whether ``pid`` runs as the service user with every needle in its command line.

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
        uid = str(self.account().pw_uid)
        return all(u == uid for u in uids) and all(n.encode() in argv for n in needles)

    def supervisor_pid(self) -> int | None:
        text = self.read_owned("supervisor.pid")
        if text and text.strip().isdigit() and self.ours(int(text), self.s.script, "run"):
            return int(text)
        return None

    def server_info(self) -> dict[str, Any] | None:
        text = self.read_owned("server.json")
        try:
            info = json.loads(text) if text else None
        except ValueError:
            return None
        if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
            return None
        info["alive"] = self.ours(info["pid"], "serve")
        return info

    # --- the commands, as root

    def status(self) -> int:
        pid = self.supervisor_pid()
        info = self.server_info() if pid else None
        print(json.dumps({"supervisor_pid": pid, "server": info, "log": self.path("server.log")}))
        return 0

    def start(self) -> int:
        if os.geteuid() != 0:
            print(
                f"paddock-supervise: start it as root (it drops to {self.s.user})", file=sys.stderr
            )
            return 2
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

    def stop(self) -> int:
        pid = self.supervisor_pid()
        if pid is None:
            return self.status()
        server = self.server_info()
        fd = signal_pid(pid, signal.SIGTERM)
        if fd is not None and not wait_fd(fd, STOP_WAIT_S):
            signal_pid(pid, signal.SIGKILL)
            if server and server["alive"]:
                signal_pid(server["pid"], signal.SIGKILL)
        return self.status()

    def restart(self) -> int:
        pid = self.supervisor_pid()
        if pid is None:
            return self.start()
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

    # --- the supervisor itself, as the service user

    def write_atomic(self, name: str, text: str) -> None:
        path = self.path(name)
        temp = f"{path}.{os.getpid()}.tmp"
        with open(temp, "w") as f:
            f.write(text)
        os.replace(temp, path)

    def open_log(self, name: str) -> int:
        path = self.path(name)
        try:
            if os.lstat(path).st_size > LOG_LIMIT:
                os.replace(path, path + ".1")
        except FileNotFoundError:
            pass
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(path, flags, 0o600)

    def note(self, text: str) -> None:
        fd = self.open_log("supervisor.log")
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
        lock = os.open(
            self.path("supervisor.lock"),
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 1  # another supervisor holds it
        wanted = {"stop": False, "restart": False}

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            wanted["restart" if signum == signal.SIGHUP else "stop"] = True

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)
        self.stop_stale_server()
        self.write_atomic("supervisor.pid", str(os.getpid()))
        self.note(f"supervisor {os.getpid()} started")
        backoff = 1.0
        while not wanted["stop"]:
            started = time.monotonic()
            self.serve_once(pw, wanted)
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
        for name in ("server.json", "supervisor.pid"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(name))
        self.note(f"supervisor {os.getpid()} stopped")
        return 0

    def stop_stale_server(self) -> None:
        """A server left by a supervisor that was killed outright still holds the port."""
        stale = self.server_info()
        if stale and stale["alive"]:
            self.note(f"stopping server {stale['pid']}, left by a supervisor that died")
            fd = signal_pid(stale["pid"], signal.SIGTERM)
            if fd is not None and not wait_fd(fd, STOP_WAIT_S):
                signal_pid(stale["pid"], signal.SIGKILL)

    def serve_once(self, pw: pwd.struct_passwd, wanted: dict[str, bool]) -> None:
        """Start the current release's server and wait until it ends or is asked to."""
        release = os.path.realpath(os.path.join(self.s.prefix, "current"))
        log = self.open_log("server.log")
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
        self.write_atomic("server.json", json.dumps(started))
        self.note(f"server {child.pid} started from {release}")
        while child.poll() is None and not wanted["stop"] and not wanted["restart"]:
            time.sleep(0.2)
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=STOP_WAIT_S - 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.note(f"server {child.pid} ended with status {child.returncode}")


COMMANDS = ("start", "stop", "restart", "status", "run")


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
    command: Callable[[], int] = getattr(supervisor, args[0])
    return command()


if __name__ == "__main__":
    sys.exit(main())
