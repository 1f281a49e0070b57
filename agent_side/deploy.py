"""``paddock deploy USER@HOST``: install or upgrade a target over SSH, then remember it.

    one verified SSH connection (agent_side.ssh): host key and login checked first, so a
        wrong host or key fails in a second, before anything is built
    the wheel: --wheel, or built from this checkout (a copy of it; reproducibly: the same
        sources give the same wheel, and the target then has nothing to do)
    the deploy script: --script, or paddock_deploy built into one zipapp file
    mktemp -d on the target; SFTP the wheel, paddock-deploy.pyz (and a --wheelhouse)
    python3 DIR/paddock-deploy.pyz --json ...   without a pty, as root (else through sudo -n)
    each step shown as it starts and ends; on success the target is stored
        (agent_side.targets_file)
    rm -rf DIR on the target, whatever happened

Exit status: the script's own (``paddock_deploy.protocol.Exit``: 0 deployed or
already up to date, 1 failed and rolled back, 2 refused before changing
anything, 3 rollback incomplete), and 125 when paddock itself failed: the
build, SSH, SFTP, or the script's output. deploy/README.md describes the
script and its JSON lines.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import httpx
import paramiko

from agent_side import targets_file
from agent_side.errors import AgentError, SshFailure, SshUnreachable, UsageError
from agent_side.sha256 import sha256_hex
from agent_side.ssh import (
    Destination,
    Endpoint,
    PassphraseSource,
    SshConnection,
    SshOptions,
    resolve,
)
from agent_side.targets_file import StoredTarget
from agent_side.views import say, visible
from paddock_deploy.archive import build_archive
from paddock_deploy.protocol import (
    ARCHIVE_NAME,
    PASSED_OPTIONS,
    STEPS,
    WHEEL_NAME,
    Exit,
    describe,
    parse_event,
    wheel_problem,
)
from shared.exit_status import ExitStatus

REMOTE_TEMPLATE = "paddock-deploy.XXXXXXXXXX"
EXEC_TIMEOUT_S = 60.0
"""Bounds the short helper commands (mktemp, rm); the deploy itself is bounded by the script."""
STATUS_WAIT_S = 30.0
"""How long to wait for the script's exit status once its output has ended."""
BUILD_TIMEOUT_S = 600.0
BUILD_HEARTBEAT_S = 5.0
INTERRUPTED = 130
SOURCE_DATE_EPOCH = "315532800"
"""1980-01-01, the earliest a zip file can say. Every file of the wheel carries this time
(unless the caller sets SOURCE_DATE_EPOCH), so the same sources give the same wheel, byte
for byte, and a re-deploy finds its release already built."""


class DeployFailed(AgentError):
    """paddock could not carry the deploy out (build, upload, or the script's output)."""

    label = "deploy failed"


@dataclass(frozen=True)
class DeployRequest:
    """What ``paddock deploy`` was asked to do, checked as far as it can be without the host."""

    destination: str
    roles: tuple[str, ...] = ()
    identity_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    script_options: tuple[str, ...] = ()
    """Options handed to paddock-deploy as they are (--listen, --prefix, ...)."""
    name: str | None = None
    route: str = "ssh"
    url: str | None = None
    """With route "https": the listener as seen from here, when it cannot be worked out."""
    wheel: Path | None = None
    wheelhouse: Path | None = None
    script: Path | None = None
    python: str = "python3"
    """The target's interpreter for the script; the release's environment is made from it."""
    as_json: bool = False


# -- the wheel and the script ---------------------------------------------------------------


def source_root() -> Path | None:
    """The checkout this paddock runs from, when it runs from one (else None)."""
    import agent_side

    root = Path(agent_side.__file__).resolve().parent.parent
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return root if project.get("project", {}).get("name") == "paddock" else None


def checked_script(given: Path) -> Path:
    """``--script``: a paddock-deploy zipapp (``python3 -m paddock_deploy.archive`` makes one)."""
    if not given.is_file() or not zipfile.is_zipfile(given):
        raise UsageError(
            f"--script {given}: not a {ARCHIVE_NAME} file "
            "(build one with: PYTHONPATH=deploy python3 -m paddock_deploy.archive OUT)"
        )
    return given


def checked_wheel(path: Path) -> Path:
    problem = wheel_problem(path)
    if problem is not None:
        raise UsageError(problem)
    return path


def build_wheel(source: Path, out: Path, waiting: Callable[[float], None] | None = None) -> Path:
    """Build the paddock wheel of ``source`` into ``out``, from a copy of the tree.

    In place, setuptools would leave build/ and *.egg-info in the checkout, and
    could package stale files it finds in an old build/. The copy has
    normalised modes, and every file in the wheel the time SOURCE_DATE_EPOCH
    says, so the same sources make the same wheel. ``waiting`` is called every
    few seconds while pip runs, with the seconds so far.
    """
    env = dict(os.environ)
    env.setdefault("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH)
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
    with (
        tempfile.TemporaryDirectory(prefix="paddock-src-") as tree,
        tempfile.TemporaryFile() as log,
    ):
        copy_source(source, Path(tree))
        # umask too: files the build itself writes (metadata) get the same modes every time.
        proc = subprocess.Popen(
            [*argv, tree], stdout=log, stderr=subprocess.STDOUT, env=env, umask=0o022
        )
        status = _wait_for_build(proc, waiting)
        log.seek(0)
        said = log.read().decode(errors="replace").strip()[-2000:]
    if status != 0:
        raise DeployFailed(f"pip wheel {source} failed (status {status}): {said}")
    built = sorted(p for p in out.glob("paddock-*.whl") if WHEEL_NAME.fullmatch(p.name))
    if len(built) != 1:
        raise DeployFailed(f"pip wheel made {len(built)} paddock wheels in {out}, not one")
    return built[0]


def _wait_for_build(proc: subprocess.Popen[bytes], waiting: Callable[[float], None] | None) -> int:
    started = time.monotonic()
    try:
        while True:
            try:
                return proc.wait(timeout=BUILD_HEARTBEAT_S)
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                if elapsed > BUILD_TIMEOUT_S:
                    raise DeployFailed(
                        f"building the wheel took over {BUILD_TIMEOUT_S:g} s"
                    ) from None
                if waiting is not None:
                    waiting(elapsed)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def copy_source(source: Path, tree: Path) -> None:
    """What building the wheel reads: pyproject.toml, the readme and licence, the packages."""
    project = tomllib.loads((source / "pyproject.toml").read_text(encoding="utf-8"))
    names = {"pyproject.toml", *_readme(project)}
    names |= {p.name for p in source.iterdir() if p.name.startswith(("LICENSE", "COPYING"))}
    for name in names:
        if (source / name).is_file():
            shutil.copy(source / name, tree / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in _packages(source, project):
        shutil.copytree(source / package, tree / package, ignore=skip, copy_function=shutil.copy)
    _normalise_modes(tree)


def _normalise_modes(tree: Path) -> None:
    """Modes as a default umask makes them: a checkout made under another umask builds the
    same wheel (its files carry their modes)."""
    for path in tree.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
        else:
            path.chmod(0o755 if path.stat().st_mode & 0o100 else 0o644)


def _readme(project: Mapping[str, Any]) -> list[str]:
    readme = project.get("project", {}).get("readme")
    if isinstance(readme, dict):
        readme = readme.get("file")
    return [readme] if isinstance(readme, str) else []


def _packages(source: Path, project: Mapping[str, Any]) -> list[Path]:
    """Top-level package directories, chosen the way setuptools' ``packages.find`` does
    (``where`` lists the directories to look in)."""
    found = project.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    patterns = found.get("include") or ["*"]
    return sorted(
        Path(where) / p.name
        for where in found.get("where") or ["."]
        for p in (source / where).iterdir()
        if p.is_dir()
        and (p / "__init__.py").is_file()
        and any(fnmatch.fnmatchcase(p.name, pattern) for pattern in patterns)
    )


# -- the SSH side ---------------------------------------------------------------------------


def _exec(transport: paramiko.Transport, command: str) -> tuple[int, str, str]:
    """Run a short command (no pty); its status, stdout and stderr."""
    channel = transport.open_session(timeout=EXEC_TIMEOUT_S)
    try:
        channel.settimeout(EXEC_TIMEOUT_S)
        channel.exec_command(command)
        channel.shutdown_write()
        out = channel.makefile("rb").read()
        err = channel.makefile_stderr("rb").read()
        channel.status_event.wait(EXEC_TIMEOUT_S)
        return channel.exit_status, out.decode(errors="replace"), err.decode(errors="replace")
    finally:
        channel.close()


@dataclass(frozen=True)
class _RemoteDir:
    path: str
    sudo: tuple[str, ...]
    """``sudo -n`` when the login is not root: the script must run as root."""


def _make_remote_dir(transport: paramiko.Transport) -> _RemoteDir:
    template = shlex.quote(REMOTE_TEMPLATE)
    command = f'id -u && mktemp -d "${{TMPDIR:-/tmp}}"/{template}'
    status, out, err = _exec(transport, command)
    # The last two lines: a login shell's rc files may print before the command runs.
    lines = out.splitlines()[-2:]
    if status != 0 or len(lines) != 2 or not lines[0].isdigit() or not lines[1].startswith("/"):
        raise SshFailure(f"could not make a private directory on the target: {err.strip() or out}")
    return _RemoteDir(lines[1], () if lines[0] == "0" else ("sudo", "-n"))


def _upload(
    transport: paramiko.Transport,
    remote: _RemoteDir,
    files: Mapping[str, Path],
    wheelhouse: Path | None,
) -> None:
    """``files`` by the name each gets in the remote directory; the wheelhouse beside them."""
    try:
        sftp = paramiko.SFTPClient.from_transport(transport)
    except (paramiko.SSHException, EOFError) as exc:
        raise SshFailure(
            f"the SSH server offers no SFTP ({exc}); enable it in its sshd_config "
            "(Subsystem sftp internal-sftp)"
        ) from exc
    if sftp is None:
        raise SshFailure("the SSH server refused an SFTP session")
    try:
        with sftp:
            for name, path in files.items():
                sftp.put(str(path), f"{remote.path}/{name}")
            if wheelhouse is not None:
                sftp.mkdir(f"{remote.path}/wheelhouse", 0o700)
                for path in sorted(wheelhouse.iterdir()):
                    if path.is_file():
                        sftp.put(str(path), f"{remote.path}/wheelhouse/{path.name}")
    except (OSError, paramiko.SSHException, EOFError) as exc:
        raise SshFailure(f"uploading to {remote.path} on the target failed: {exc}") from exc


def _remove_remote_dir(connection: SshConnection, remote: _RemoteDir, progress: _Progress) -> None:
    """Remove the uploaded files; reconnects if the link dropped (only this is ever retried)."""
    try:
        status, _, err = _exec(connection.transport(), f"rm -rf -- {shlex.quote(remote.path)}")
    except (AgentError, OSError, paramiko.SSHException, EOFError) as exc:
        progress.warn(
            f"warning: could not remove {remote.path} on the target ({exc}); remove it by hand"
        )
        return
    if status != 0:
        progress.warn(f"warning: could not remove {remote.path} on the target: {err.strip()}")


# -- running the script ---------------------------------------------------------------------


@dataclass
class _Outcome:
    """What the script said: its exit status (None if the link dropped) and its result."""

    status: int | None = None
    result: dict[str, Any] | None = None
    garbled: list[str] = field(default_factory=list)


_OUTPUT = threading.Lock()
"""Hosts deployed side by side write whole lines, one at a time."""


class _Progress:
    """Shows what happens: paddock's own stages, then the script's JSON lines as they come
    (as steps for a person, or passed through with ``--json``). With ``host``, each line
    says which host it is about (a ``HOST: `` prefix, or ``"host"`` in a JSON line)."""

    def __init__(self, as_json: bool, out: IO[str], host: str | None = None) -> None:
        self._as_json = as_json
        self._out = out
        self._host = host
        self.outcome = _Outcome()

    def own(self, text: str) -> None:
        """A stage of paddock's own (connect, build, upload); on stderr with ``--json``, whose
        stdout holds nothing but JSON lines."""
        if self._as_json:
            self.warn(text)
        else:
            self._write(text)

    def warn(self, text: str) -> None:
        """A ``paddock: ...`` line on stderr (naming the host, in a fleet)."""
        prefix = f"{self._host}: " if self._host is not None else ""
        with _OUTPUT:
            say(prefix + text)

    def waiting(self, what: str) -> Callable[[float], None]:
        return lambda seconds: self.own(f"  {what}: still running after {seconds:.0f}s")

    def line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not text.strip():
            return
        event = parse_event(text)
        if event is None:
            self.outcome.garbled.append(text)
            self.warn(f"target: {text}")
            return
        if self._as_json:
            shown = event if self._host is None else {"host": self._host, **event}
            self._write(json.dumps(shown), prefixed=False)
        else:
            described = describe(event)
            if described is not None:
                self._write(described)
        if event["event"] == "result":
            self.outcome.result = event

    def show(self, text: str) -> None:
        """A line for a person on stdout (after ``visible``, as every line here)."""
        self._write(text)

    def emit(self, record: Mapping[str, Any]) -> None:
        """One JSON line of paddock's own on stdout (``--json``)."""
        shown = record if self._host is None else {"host": self._host, **record}
        self._write(json.dumps(shown), prefixed=False)

    def _write(self, text: str, *, prefixed: bool = True) -> None:
        # Everything shown came from the target: it must not be able to drive the terminal.
        prefix = f"{self._host}: " if prefixed and self._host is not None else ""
        with _OUTPUT:
            self._out.write(prefix + visible(text) + "\n")
            self._out.flush()


def _script_argv(remote: _RemoteDir, wheel: Path, request: DeployRequest) -> list[str]:
    argv = [
        *remote.sudo,
        request.python,
        f"{remote.path}/{ARCHIVE_NAME}",
        "--wheel",
        f"{remote.path}/{wheel.name}",
        "--json",
    ]
    argv += [arg for role in request.roles for arg in ("--role", role)]
    if request.wheelhouse is not None:
        argv += ["--find-links", f"{remote.path}/wheelhouse", "--no-index"]
    return argv + list(request.script_options)


def _run_script(transport: paramiko.Transport, argv: Sequence[str], progress: _Progress) -> None:
    """Run the script without a pty (a lost link shows up there as a failed write: it rolls
    back), relaying stderr as it comes and handing each stdout line to ``progress``."""
    channel = transport.open_session(timeout=EXEC_TIMEOUT_S)
    try:
        channel.exec_command(shlex.join(argv))
        channel.shutdown_write()
        relay = threading.Thread(target=_relay_stderr, args=(channel, progress), daemon=True)
        relay.start()
        for raw in channel.makefile("rb"):
            progress.line(raw)
        channel.status_event.wait(STATUS_WAIT_S)
        relay.join(STATUS_WAIT_S)
        status = channel.exit_status
        progress.outcome.status = status if status >= 0 else None
    finally:
        channel.close()


def _relay_stderr(channel: paramiko.Channel, progress: _Progress) -> None:
    with contextlib.suppress(OSError, paramiko.SSHException, EOFError, ValueError):
        for raw in channel.makefile_stderr("rb"):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if line.strip():
                progress.warn(f"target: {line}")


# -- the whole command ----------------------------------------------------------------------


@dataclass(frozen=True)
class HostPlan:
    """One host to deploy, checked as far as it can be without the network."""

    request: DeployRequest
    endpoint: Endpoint
    options: SshOptions
    name: str
    """The name the target is stored under."""


def plan_host(request: DeployRequest, passphrase: PassphraseSource | None) -> HostPlan:
    """Resolve the destination (``~/.ssh/config`` included) and the name it is stored under."""
    options = SshOptions(
        identity_files=request.identity_files,
        known_hosts=request.known_hosts,
        passphrase=passphrase,
    )
    destination = Destination.parse(request.destination)
    endpoint = resolve(destination, options)
    name = targets_file.checked_name(request.name or destination.host)
    if request.route == "https":
        request = _with_direct_name(request, endpoint)
    return HostPlan(request, endpoint, options, name)


def deploy(
    request: DeployRequest, environ: Mapping[str, str], passphrase: PassphraseSource | None
) -> int:
    """Carry out ``request``; returns the exit status of ``paddock deploy``.

    Everything that can be checked here is checked first, then the SSH
    connection (host key, login): only then is anything built.
    """
    plan = plan_host(request, passphrase)
    with tempfile.TemporaryDirectory(prefix="paddock-deploy-") as scratch:
        files = SharedFiles.checked(request, Path(scratch))
        run = HostRun(plan, _Progress(request.as_json, sys.stdout))
        try:
            return run.run(files, environ)
        except KeyboardInterrupt:
            # Closing the session makes the script's next progress line fail: it rolls back.
            run.progress.warn(
                "interrupted: the target rolls back this deploy when it next reports progress"
            )
            return INTERRUPTED
        finally:
            run.close()


class HostRun:
    """One host's deploy: connect, the shared files, upload and run the script, store it.

    ``phase`` says how far it got, so that a failure of paddock's own (125) can
    be told apart: connect, build, upload, script, store.
    """

    def __init__(self, plan: HostPlan, progress: _Progress) -> None:
        self.plan = plan
        self.progress = progress
        self.phase = "connect"
        self.connection = SshConnection(plan.endpoint, plan.options)

    def run(self, files: SharedFiles, environ: Mapping[str, str]) -> int:
        plan, progress = self.plan, self.progress
        progress.own(f"connecting to {plan.endpoint}")
        self.connection.connect()
        progress.own(f"connected to {plan.endpoint}: host key verified, logged in")
        self.phase = "build"
        upload = files.get(progress)
        self.phase = "upload"
        _deploy_over(self.connection, upload, plan.request, progress, self._script_started)
        self.phase = "store"
        return _finish(progress.outcome, plan.request, plan.endpoint, plan.name, environ, progress)

    def _script_started(self) -> None:
        self.phase = "script"

    def close(self) -> None:
        """Close the SSH connection (from any thread: a running script then rolls back)."""
        self.connection.close()


def _source_to_build() -> Path:
    root = source_root()
    if root is None:
        raise UsageError("this paddock is not run from a checkout: give --wheel PATH")
    return root


@dataclass(frozen=True)
class _Upload:
    wheel: Path
    script: Path

    def by_remote_name(self) -> dict[str, Path]:
        return {self.wheel.name: self.wheel, ARCHIVE_NAME: self.script}


class SharedFiles:
    """The wheel and the deploy script, made once (by the first host to need them) for all.

    The same sources build the same wheel byte for byte, so one build serves
    every host, and each host whose release is that wheel has nothing to do.
    A build that failed fails every host that asks, with the same error.
    """

    def __init__(
        self, scratch: Path, wheel: Path | None, source: Path | None, script: Path | None
    ) -> None:
        self._scratch = scratch
        self._wheel = wheel
        self._source = source
        self._script = script
        self._lock = threading.Lock()
        self._made: _Upload | None = None
        self._failed: BaseException | None = None
        self.builds = 0

    @classmethod
    def checked(cls, request: DeployRequest, scratch: Path) -> SharedFiles:
        """``--wheel``, ``--script`` and ``--wheelhouse`` checked; this checkout when no wheel."""
        script = checked_script(request.script) if request.script is not None else None
        wheel = checked_wheel(request.wheel) if request.wheel is not None else None
        source = None if wheel is not None else _source_to_build()
        if request.wheelhouse is not None and not request.wheelhouse.is_dir():
            raise UsageError(f"--wheelhouse {request.wheelhouse}: no such directory")
        return cls(scratch, wheel, source, script)

    def get(self, progress: _Progress) -> _Upload:
        with self._lock:
            if self._failed is not None:
                raise DeployFailed(f"the shared build failed: {self._failed}")
            if self._made is None:
                try:
                    self._made = self._make(progress)
                except (AgentError, OSError) as exc:
                    self._failed = exc
                    raise
            return self._made

    def _make(self, progress: _Progress) -> _Upload:
        wheel, source, script = self._wheel, self._source, self._script
        if wheel is None:
            if source is None:
                raise UsageError("give --wheel PATH, or run paddock from a checkout")
            progress.own(f"building the paddock wheel from {source}")
            started = time.monotonic()
            wheel = build_wheel(
                source, self._scratch / "dist", progress.waiting("building the wheel")
            )
            self.builds += 1
            digest = sha256_hex(wheel.read_bytes())
            progress.own(
                f"built {wheel.name} (sha256 {digest[:12]}) in {time.monotonic() - started:.1f}s"
            )
        if script is None:
            script = build_archive(self._scratch / ARCHIVE_NAME)
        return _Upload(wheel, script)


def _with_direct_name(request: DeployRequest, endpoint: Endpoint) -> DeployRequest:
    """A direct route reaches the server by a name its certificate must hold: ask for it.

    (The script puts it in a certificate it makes; one that exists is kept as it is.)
    """
    try:
        host = httpx.URL(request.url).host if request.url else endpoint.hostname
    except httpx.InvalidURL as exc:
        raise UsageError(f"--url {request.url!r} is not a URL: {exc}") from exc
    if not host:
        raise UsageError(f"--url {request.url!r} names no host")
    return replace(request, script_options=(*request.script_options, "--tls-host", host))


def _deploy_over(
    connection: SshConnection,
    files: _Upload,
    request: DeployRequest,
    progress: _Progress,
    script_started: Callable[[], None] = lambda: None,
) -> None:
    transport = connection.transport()
    try:
        remote = _make_remote_dir(transport)
    except (OSError, paramiko.SSHException, EOFError) as exc:
        raise SshUnreachable(f"running a command on {connection.endpoint} failed: {exc}") from exc
    try:
        progress.own(f"uploading {files.wheel.name} and {ARCHIVE_NAME} to {remote.path}")
        _upload(transport, remote, files.by_remote_name(), request.wheelhouse)
        script_started()
        try:
            _run_script(transport, _script_argv(remote, files.wheel, request), progress)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            # The result may have arrived before the session ended: _finish decides on it.
            progress.warn(f"the deploy session ended early: {exc}")
    finally:
        _remove_remote_dir(connection, remote, progress)


def _finish(
    outcome: _Outcome,
    request: DeployRequest,
    endpoint: Endpoint,
    name: str,
    environ: Mapping[str, str],
    progress: _Progress | None = None,
) -> int:
    shown = progress if progress is not None else _Progress(request.as_json, sys.stdout)
    result = outcome.result
    if result is None:
        return _no_result(outcome, shown)
    if not result.get("ok"):
        return _failed(result, outcome.status, shown)
    try:
        entry = stored_entry(request, result, endpoint, name)
        saved = targets_file.save(
            entry,
            tokens=_tokens(result),
            ca_pem=result.get("ca_pem"),
            environ=environ,
        )
    except (AgentError, OSError) as exc:
        return _not_saved(result, exc, request.as_json, shown)
    _report(result, saved, request.as_json, shown)
    return 0


def _no_result(outcome: _Outcome, progress: _Progress) -> int:
    if outcome.status is None:
        progress.warn(
            "the connection to the target dropped before the deploy's result arrived; "
            "the script rolls back when it cannot deliver it. Re-run paddock deploy"
        )
        return int(ExitStatus.PADDOCK_FAILED)
    progress.warn(
        f"paddock-deploy ended with status {outcome.status} and no result "
        "(anything it said on stderr is above, as 'target:')"
    )
    # 2 is argparse refusing its arguments: nothing was changed, as the script's own 2 says.
    return Exit.REFUSED if outcome.status == Exit.REFUSED else int(ExitStatus.PADDOCK_FAILED)


def _failed(result: Mapping[str, Any], status: int | None, progress: _Progress) -> int:
    step = result.get("failed_step")
    error = visible(str(result.get("error")))
    summary = visible(str(result.get("summary")))
    where = f"at step {step}" if step else "before any step"
    if result.get("rollback_problems"):
        progress.warn(f"DEPLOY FAILED {where} AND ITS ROLLBACK IS INCOMPLETE: {error}")
        progress.warn(f"the target host needs a look: {summary}")
    else:
        progress.warn(f"deploy failed {where}: {error}")
        progress.warn(summary)
    if status in (Exit.ROLLED_BACK, Exit.REFUSED, Exit.ROLLBACK_INCOMPLETE):
        return int(status)
    # No status (the link dropped after the result): the result says which one it was.
    if result.get("rollback_problems"):
        return Exit.ROLLBACK_INCOMPLETE
    return Exit.ROLLED_BACK if result.get("rolled_back") else Exit.REFUSED


def _tokens(result: Mapping[str, Any]) -> dict[str, str]:
    tokens = result.get("tokens") or {}
    if not isinstance(tokens, dict) or not all(isinstance(t, str) for t in tokens.values()):
        raise DeployFailed("the deploy result's tokens are not a map of role to token")
    return tokens


def stored_entry(
    request: DeployRequest, result: Mapping[str, Any], endpoint: Endpoint, name: str
) -> StoredTarget:
    """The entry a successful deploy leaves for ``paddock run -t NAME``."""
    listener = str(result.get("url") or "")
    if not listener.startswith(("https://", "http://")):
        raise DeployFailed(f"the deploy result names no usable URL ({listener!r})")
    route = request.route
    url = listener if route == "ssh" else request.url or direct_url(result, endpoint)
    return StoredTarget(
        name=name,
        route=route,
        url=url,
        ssh=request.destination,
        # Only what was given: ~/.ssh/config and the defaults are read again at each run.
        identity_files=_absolute(request.identity_files),
        known_hosts=_absolute(request.known_hosts),
        ca_sha256=result.get("ca_sha256") if result.get("ca_pem") else None,
        cert_sha256=result.get("cert_sha256"),
        default_role=request.roles[0] if request.roles else None,
        release=result.get("release"),
        deployed_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def _absolute(paths: Sequence[str]) -> tuple[str, ...]:
    """Paths made absolute, so the stored entry works from any directory."""
    return tuple(os.path.abspath(os.path.expanduser(p)) for p in paths)


def direct_url(result: Mapping[str, Any], endpoint: Endpoint) -> str:
    """The listener's URL as seen from here, for the "https" route.

    A wildcard listener is reached at the SSH host's address; a loopback one
    only when that address is loopback too (the target is this machine).
    """
    host, _, port = str(result.get("listen", "")).rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - a listen address, not one we bind
        host = endpoint.hostname
    elif _loopback(host) and not _loopback(endpoint.hostname):
        raise UsageError(
            f"the target listens on {host} only, which is not reachable from here; "
            "keep the SSH route (--route ssh), or deploy with --listen 0.0.0.0:PORT, "
            "or give --url"
        )
    shown = f"[{host}]" if ":" in host else host
    return f"https://{shown}:{port}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _report(
    result: Mapping[str, Any], saved: targets_file.Saved, as_json: bool, progress: _Progress
) -> None:
    entry = saved.entry
    if as_json:
        stored = {
            "event": "target",
            "name": entry.name,
            "file": str(saved.index),
            "route": entry.route,
            "url": entry.url,
            "ssh": entry.ssh,
            "token_files": {role: str(path) for role, path in saved.new_token_files.items()},
        }
        progress.emit(stored)
        return
    for line in summary_lines(result, saved):
        progress.show(line)


def summary_lines(result: Mapping[str, Any], saved: targets_file.Saved) -> list[str]:
    """The closing lines for a person; tokens appear only as the files that hold them."""
    entry = saved.entry
    health = result.get("health") or {}
    service = result.get("service") or {}
    previous = result.get("previous_release")
    was = f" (was {previous})" if previous and previous != result.get("release") else ""
    done = "deployed" if result.get("changed") else "unchanged (nothing to do)"
    lines = [
        f"paddock target {done}: release {result.get('release')}{was}",
        f"  url:      {result.get('url')} (on the target)",
        f"  health:   {health.get('status')}",
        f"  service:  {service.get('mode')}, server pid {service.get('pid')}",
    ]
    if entry.ca_sha256:
        lines.append(f"  CA:       SHA-256 {entry.ca_sha256}, pinned in {entry.ca_file}")
    else:
        lines.append(f"  certificate (operator's): SHA-256 {result.get('cert_sha256')}")
    for role, path in saved.new_token_files.items():
        lines.append(f"  token for role {role}: saved to {path} (0600; shown nowhere else)")
    for role in saved.dropped_roles:
        lines.append(f"  dropped the token stored for role {role}: it was for another install")
    if not saved.new_token_files and not entry.tokens:
        lines.append(
            "  no token stored: its roles existed before (their tokens were shown then); "
            "use --token-file F, or deploy a new --role"
        )
    via = f"via {entry.ssh}" if entry.route == "ssh" else "direct"
    lines.append(f"stored as target {entry.name} ({entry.route} {via}) in {saved.index}")
    lines.append(f"next: paddock run -t {entry.name} -- CMD")
    return lines


def _not_saved(
    result: Mapping[str, Any], exc: BaseException, as_json: bool, progress: _Progress
) -> int:
    progress.warn(f"the deploy succeeded, but the target could not be stored: {exc}")
    tokens = result.get("tokens") or {}
    if tokens and not as_json:  # with --json they were in the result line already
        # The target keeps only their hashes: shown now, or lost for good.
        progress.warn("the new tokens exist nowhere else; they are shown once, on stdout:")
        for role, token in tokens.items():
            progress.show(f"token for role {role}: {token}")
    return int(ExitStatus.PADDOCK_FAILED)


def script_options(pairs: Sequence[tuple[str, str | None]], fail_at: str | None) -> tuple[str, ...]:
    """The pass-through options, in the script's syntax; paths checked absolute here."""
    paths = {option.flag for option in PASSED_OPTIONS if option.path}
    options: list[str] = []
    for flag, value in pairs:
        if value is None:
            continue
        if flag in paths and not value.startswith("/"):
            raise UsageError(f"{flag} {value!r}: give an absolute path on the target")
        options += [flag, value]
    if fail_at is not None:
        if fail_at not in STEPS:
            raise UsageError(f"--fail-at {fail_at!r}: one of {', '.join(STEPS)}")
        options += ["--fail-at", fail_at]
    return tuple(options)


def passed_options(given: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """``(flag, value)`` for each pass-through option in ``given`` (argparse's dests)."""
    pairs: list[tuple[str, str | None]] = []
    for option in PASSED_OPTIONS:
        value = given.get(option.dest)
        if option.repeated:
            pairs += [(option.flag, v) for v in value or ()]
        else:
            pairs.append((option.flag, value))
    return pairs
