"""What a hostile turn can do on the host side: each attack first, then the rule that stops it.

The fence itself (namespaces, seccomp, capabilities) has its own tests; these
are about what the target does on a turn's behalf outside it: the programs it
runs, the identity the turn acts as, the files it touches and protects.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from conftest import (
    OTHER_TOKEN,
    Target,
    events,
    finished,
    make_settings,
    output,
    owned_by_role,
    processes_with,
    run,
    submit,
    wait_until,
)
from process_support import (
    ABSTRACT_CONNECT,
    REPO,
    TargetProcess,
    abstract_listener,
    parent_pid,
    proc_status,
    signal_set,
    socket_opening,
    write_config,
)

from shared.walk import canonical_path
from shared.wire import Turn
from target_side.config import FenceConfig, RoleConfig, Settings, parse_settings
from target_side.errors import ConfigError, ThreadIdsError
from target_side.fence import thread_ids
from target_side.fence.audit import QUARANTINE_SUFFIX
from target_side.fence.launch import explain_setup_failure
from target_side.policy.forbidden import role_home
from target_side.service.server import ServerThread


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Target]:
    """A target whose two roles have workspaces of their own; ``other`` may use the network.

    The fence PATH has an operator's tool directory, and ``.tool-versions`` is protected
    on top of the built-in names.
    """
    root = Path(canonical_path(tmp_path_factory.mktemp("edges")))
    base = make_settings(root, ca)
    other_ws = root / "other-ws"
    other_ws.mkdir()
    tools = root / "opt-tools" / "bin"
    tools.mkdir(parents=True)
    (tools / "paddock-tool").write_text("#!/bin/sh\necho tool ran\n")
    (tools / "paddock-tool").chmod(0o755)
    roles = dict(base.roles)
    roles["other"] = RoleConfig(
        token_sha256=base.roles["other"].token_sha256,
        workspaces=(str(other_ws),),
        allow_network=True,
    )
    fence = FenceConfig(path=f"{tools}:/usr/local/bin:/usr/bin:/bin", protect=(".tool-versions",))
    settings = base.model_copy(update={"roles": roles, "fence": fence})
    owned_by_role(other_ws, settings, "other")
    ca_file = root / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with ServerThread(settings) as server:
        yield Target(server.url, str(ca_file), settings, root / "ws")


@pytest.fixture
def c(edges: Target) -> Iterator[httpx.Client]:
    with edges.client() as client:
        yield client


@pytest.fixture
def ws(edges: Target, tmp_path: Path) -> Path:
    """A fresh directory of the builder's own inside its workspace, for one test."""
    here = edges.workspace / tmp_path.name
    here.mkdir()
    return owned_by_role(here, edges.settings)


def _uid(settings: Settings, role: str = "builder") -> int:
    return settings.role_ids(role)[0]


def _refusal(turn: Turn) -> tuple[str, str]:
    assert turn.state == "refused" and turn.refusal is not None, turn
    return turn.refusal.rule, turn.refusal.detail


# --- 1. the request's env never reaches a program the target runs on the host ----------------


def test_env_loader_variables_reach_the_command_only(c: httpx.Client) -> None:
    # Under the turn's env, the loader would report on /usr/bin/bwrap and /usr/bin/env too.
    turn, evs = run(c, ["true"], env={"LD_DEBUG": "files", "LD_PRELOAD": "/nonexistent.so"})
    stderr = output(evs, "stderr")
    assert turn.exit_code == 0
    assert "/nonexistent.so" in stderr  # the command itself did see them
    assert "bwrap" not in stderr and "/usr/bin/env" not in stderr and "prlimit" not in stderr


def test_env_values_are_not_on_bwraps_command_line_nor_in_its_environment(
    c: httpx.Client, edges: Target
) -> None:
    marker = "281.5"
    turn = submit(c, argv=["sh", "-c", f"sleep {marker}"], env={"API_TOKEN": "value-never-in-ps"})
    try:
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
        # This turn's own: another test running beside this one may start bubblewrap itself.
        (command,) = processes_with("sleep", marker)
        bwraps = [pid for pid in _ancestors(command) if _exe(pid).endswith("/bwrap")]
        assert len(bwraps) == 2  # bubblewrap, and the sandbox's first process
        for pid in bwraps:
            assert b"value-never-in-ps" not in Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert [e for e in environ if e] == [b"PATH=/usr/bin:/bin:/usr/local/bin"]
    finally:
        c.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
        events(c, turn.turn_id)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _ancestors(pid: int) -> list[int]:
    """The processes above ``pid``, its parent first."""
    found = []
    while (pid := parent_pid(pid)) > 1:
        found.append(pid)
    return found


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


# --- 2. a turn acts on the host as its role's own uid ---------------------------------------


@pytest.mark.parametrize("starter", ["thread", "setpriv"])
def test_identity_files_a_turn_makes_belong_to_its_role(
    c: httpx.Client, edges: Target, ws: Path, monkeypatch: pytest.MonkeyPatch, starter: str
) -> None:
    if starter == "setpriv":
        # A uid with an account, suid_dumpable 1, an unknown machine: setpriv, as before.
        monkeypatch.setattr(thread_ids, "usable_for", lambda uid: False)
    # The server holds a supplementary group, as a service user often does: it must not pass.
    groups = os.getgroups()
    os.setgroups([*groups, 4242])
    try:
        turn, evs = run(c, ["sh", "-c", "id -u; id -G; touch made"], cwd=str(ws))
    finally:
        os.setgroups(groups)
    uid = _uid(edges.settings)
    assert turn.exit_code == 0
    assert output(evs).split() == [str(uid), str(uid)]  # no supplementary groups either
    st = (ws / "made").stat()
    assert (st.st_uid, st.st_gid) == (uid, uid)
    assert st.st_mode & 0o777 == 0o644  # one umask, whatever the server's


def test_identity_bwrap_runs_as_the_role_and_the_server_stays_root(
    c: httpx.Client, edges: Target
) -> None:
    # The worker thread that starts bwrap takes the role's ids for that instant only.
    marker = "281.7"
    turn = submit(c, argv=["sh", "-c", f"sleep {marker}"])
    try:
        assert wait_until(lambda: bool(processes_with("sleep", marker)))
        uid = str(_uid(edges.settings))
        ours = [
            pid
            for pid in _pids()
            if _exe(pid).endswith("/bwrap") and parent_pid(pid) == os.getpid()
        ]
        assert ours
        for pid in ours:
            status = proc_status(f"/proc/{pid}/status")
            assert status["Uid"] == status["Gid"] == [uid] * 4
            assert status["CapPrm"] == status["CapEff"] == status["CapAmb"] == ["0" * 16]
        for task in os.listdir("/proc/self/task"):
            assert proc_status(f"/proc/self/task/{task}/status")["Uid"] == ["0"] * 4, task
    finally:
        c.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
        events(c, turn.turn_id)


def test_identity_a_thread_that_cannot_take_the_roles_ids_refuses_the_turn(
    c: httpx.Client, edges: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot(uid: int, gid: int) -> None:
        raise ThreadIdsError("setresuid: Operation not permitted")

    monkeypatch.setattr(thread_ids, "acting_as", cannot)
    turn, _ = run(c, ["true"])
    assert _refusal(turn) == ("backend-unavailable", "setresuid: Operation not permitted")


def test_identity_a_unix_socket_sees_the_roles_uid(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    path = ws / "peer.sock"
    seen: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        path.chmod(0o666)
        server.listen(1)

        def accept() -> None:
            conn, _ = server.accept()
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                seen.append(int.from_bytes(creds[4:8], "little"))

        waiter = threading.Thread(target=accept, daemon=True)
        waiter.start()
        connect = f"import socket; socket.socket(socket.AF_UNIX).connect({str(path)!r})"
        turn, _ = run(c, ["python3", "-c", connect], cwd=str(ws))
        waiter.join(10)
    assert turn.exit_code == 0
    assert seen == [_uid(edges.settings)]


def test_identity_a_root_only_socket_refuses_the_turn(c: httpx.Client, ws: Path) -> None:
    path = ws / "root-only.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        path.chmod(0o600)
        server.listen(1)
        connect = f"import socket; socket.socket(socket.AF_UNIX).connect({str(path)!r})"
        turn, evs = run(c, ["python3", "-c", connect], cwd=str(ws))
    assert turn.exit_code == 1
    assert "PermissionError" in output(evs, "stderr")


def test_identity_git_on_the_host_does_not_trust_a_repository_a_turn_made(
    c: httpx.Client, ws: Path
) -> None:
    turn, _ = run(c, ["git", "init", "-q", "planted"], cwd=str(ws))
    assert turn.exit_code == 0
    host = subprocess.run(
        ["git", "-C", str(ws / "planted"), "status"], capture_output=True, text=True, check=False
    )
    assert host.returncode != 0
    assert "dubious ownership" in host.stderr


def test_identity_another_roles_workspace_stays_closed_even_if_a_rule_slips(
    edges: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel stands behind the mount allowlist: with the forbidden entry removed, the
    other role's 0700 workspace is mounted, and still cannot be read."""
    from target_side.policy import forbidden

    other_ws = edges.settings.roles["other"].workspaces[0]
    (Path(other_ws) / "private.txt").write_text("other's\n")
    monkeypatch.setattr(forbidden, "_other_workspaces", lambda settings, role: [])
    with edges.client() as c:
        turn, evs = run(c, ["cat", f"{other_ws}/private.txt"], fs={"read": [other_ws]})
    assert turn.exit_code == 1
    assert "Permission denied" in output(evs, "stderr")


# --- 3. git metadata and the other protected names -------------------------------------------


def _repo(where: Path, *extra: str) -> Path:
    subprocess.run(["git", "init", "-q", *extra, str(where)], check=True)
    return where


def _hand_over(path: Path, settings: Settings) -> None:
    """Give a tree to the builder's uid, as a deploy does for a workspace it makes."""
    uid, gid = settings.role_ids("builder")
    for directory, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(directory, name), uid, gid)
    os.chown(path, uid, gid)


def test_git_dir_cannot_be_renamed_away_and_replaced(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    _repo(ws)
    _hand_over(ws, edges.settings)
    attack = "mv .git .git.old && cp -a .git.old .git && echo '[core]fsmonitor=x' >> .git/config"
    turn, _ = run(c, ["sh", "-c", attack], cwd=str(ws))
    assert turn.exit_code != 0
    assert (ws / ".git" / "config").read_text().count("fsmonitor") == 0
    assert not (ws / ".git.old").exists()


def test_git_repository_below_the_mount_root_is_protected(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    _repo(ws / "proj")
    _hand_over(ws, edges.settings)
    attack = (
        "echo evil > proj/.git/hooks/pre-commit; "
        "git -C proj config core.fsmonitor 'touch /tmp/x'; "
        "mv proj/.git proj/.git.old; echo done"
    )
    _turn, evs = run(c, ["sh", "-c", attack], cwd=str(ws))
    assert output(evs) == "done\n"
    assert not (ws / "proj/.git/hooks/pre-commit").exists()
    assert "fsmonitor" not in (ws / "proj/.git/config").read_text()
    assert (ws / "proj/.git").is_dir() and not (ws / "proj/.git.old").exists()


@pytest.mark.parametrize("name", ["commondir", "config.worktree"])
def test_git_redirection_created_during_a_turn_is_moved_aside(
    c: httpx.Client, edges: Target, ws: Path, name: str
) -> None:
    _repo(ws)
    (ws / ".cx").mkdir()
    (ws / ".cx" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")
    _hand_over(ws, edges.settings)
    turn, evs = run(c, ["sh", "-c", f"echo ../.cx > .git/{name}"], cwd=str(ws))
    assert turn.exit_code == 0
    assert not (ws / ".git" / name).exists()
    assert (ws / ".git" / f"{name}{QUARANTINE_SUFFIX}{turn.turn_id}").exists()
    notices = [e.message for e in evs if e.kind == "notice"]
    assert any(f".git/{name} appeared during the turn" in n for n in notices)
    # The exit event comes after: whoever was told the turn ended sees the repository safe.
    assert evs[-1].kind == "exit"


def test_git_hooks_missing_from_a_repository_cannot_be_added(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    _repo(ws)
    subprocess.run(["rm", "-rf", str(ws / ".git" / "hooks")], check=True)
    _hand_over(ws, edges.settings)
    turn, _ = run(
        c, ["sh", "-c", "mkdir .git/hooks && echo evil > .git/hooks/post-checkout"], cwd=str(ws)
    )
    assert turn.exit_code == 0
    assert not (ws / ".git" / "hooks").exists()


def test_git_worktrees_submodules_bare_repos_and_gitfiles_are_protected(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    main = _repo(ws / "main")
    subprocess.run(
        [
            "git",
            "-C",
            str(main),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "x",
        ],
        check=True,
    )
    subprocess.run(["git", "-C", str(main), "worktree", "add", "-q", str(ws / "wt")], check=True)
    _repo(ws / "bare.git", "--bare")
    modules = main / ".git" / "modules" / "sub"
    modules.mkdir(parents=True)
    (modules / "config").write_text("[core]\n")
    _hand_over(ws, edges.settings)
    targets = [
        "main/.git/worktrees/wt/commondir",
        "main/.git/modules/sub/config",
        "bare.git/config",
        "wt/.git",
    ]
    attack = "; ".join(f"echo evil >> {t}" for t in targets) + "; echo done"
    _turn, evs = run(c, ["sh", "-c", attack], cwd=str(ws))
    assert output(evs) == "done\n"
    for name in targets:
        assert "evil" not in (ws / name).read_text(), name


def test_protected_names_stay_read_only_and_new_ones_at_the_top_are_moved_aside(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    (ws / ".bashrc").write_text("# mine\n")
    (ws / "deep" / ".vscode").mkdir(parents=True)
    (ws / "deep" / ".vscode" / "tasks.json").write_text("{}\n")
    (ws / ".tool-versions").write_text("python 3.11\n")  # the operator's own [fence] protect
    _hand_over(ws, edges.settings)
    attack = (
        "echo evil >> .bashrc; echo evil >> deep/.vscode/tasks.json; echo evil >> .tool-versions; "
        "echo 'eval evil' > .envrc; echo done"
    )
    turn, evs = run(c, ["sh", "-c", attack], cwd=str(ws))
    assert output(evs) == "done\n"
    assert (ws / ".bashrc").read_text() == "# mine\n"
    assert (ws / "deep/.vscode/tasks.json").read_text() == "{}\n"
    assert (ws / ".tool-versions").read_text() == "python 3.11\n"
    assert not (ws / ".envrc").exists()
    assert (ws / f".envrc{QUARANTINE_SUFFIX}{turn.turn_id}").exists()


def test_a_protected_name_made_in_a_turns_last_moment_is_moved_aside(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    # The audit runs once nothing of the turn runs: never before, or what it makes last escapes.
    _hand_over(ws, edges.settings)
    late = "echo started; sleep 0.5; echo 'eval evil' > .envrc"
    turn, evs = run(c, ["sh", "-c", late], cwd=str(ws))
    assert output(evs) == "started\n" and turn.exit_code == 0
    assert not (ws / ".envrc").exists()
    assert (ws / f".envrc{QUARANTINE_SUFFIX}{turn.turn_id}").exists()


def test_protected_symlink_repointed_during_a_turn_is_moved_aside(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    (ws / "dotfiles").mkdir()
    (ws / "dotfiles" / "bashrc").write_text("# mine\n")
    (ws / ".bashrc").symlink_to("dotfiles/bashrc")
    _hand_over(ws, edges.settings)
    turn, _ = run(c, ["sh", "-c", "ln -sfn /tmp/evil .bashrc"], cwd=str(ws))
    assert turn.exit_code == 0
    assert not (ws / ".bashrc").exists() and not (ws / ".bashrc").is_symlink()
    assert os.readlink(ws / f".bashrc{QUARANTINE_SUFFIX}{turn.turn_id}") == "/tmp/evil"
    # Made again the same as planned is no change: nothing is moved.
    (ws / ".bashrc").symlink_to("dotfiles/bashrc")
    again, _ = run(c, ["sh", "-c", "ln -sfn dotfiles/bashrc .bashrc"], cwd=str(ws))
    assert again.exit_code == 0
    assert os.readlink(ws / ".bashrc") == "dotfiles/bashrc"


def test_writable_mount_with_more_directories_than_the_scan_limit_is_refused(
    tmp_path: Path, ca: trustme.CA
) -> None:
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    settings = settings.model_copy(update={"fence": FenceConfig(scan_limit=5)})
    for i in range(6):
        (tmp_path / "ws" / f"d{i}").mkdir()
    with ServerThread(settings) as server:
        target = Target(server.url, str(tmp_path / "ca.pem"), settings, tmp_path / "ws")
        ca.cert_pem.write_to_path(target.cacert)
        with target.client() as c:
            turn = submit(c, argv=["true"])
    rule, detail = _refusal(turn)
    assert rule == "bad-mount" and "scan_limit" in detail


def _root_only(path: Path) -> Path:
    """``path``, made a directory of root's that no one else may enter (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 0, 0)
    path.chmod(0o700)
    return path


def test_a_repository_where_the_role_can_never_go_does_not_stop_its_turns(
    c: httpx.Client, ws: Path
) -> None:
    # bubblewrap, as the role, could not mount over anything in there, nor could the turn
    # reach it: it is left out of the scan, where it used to refuse every turn.
    _repo(_root_only(ws / "closed") / "repo")
    turn, evs = run(c, ["sh", "-c", "ls closed 2>&1; echo rc=$?"], cwd=str(ws))
    assert turn.refusal is None, turn.refusal
    assert "Permission denied" in output(evs)


def test_a_git_directory_the_role_can_never_enter_still_cannot_be_moved_away(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    _repo(ws / "proj")
    _hand_over(ws, edges.settings)
    _root_only(ws / "proj" / ".git")
    # Moved away, it would leave room for a .git of the turn's own, hooks and all.
    turn, evs = run(c, ["sh", "-c", "mv proj/.git proj/moved 2>&1; echo rc=$?"], cwd=str(ws))
    assert turn.refusal is None, turn.refusal
    assert "rc=0" not in output(evs)
    assert (ws / "proj" / ".git" / "hooks").is_dir()


@pytest.mark.parametrize(
    "shut", ["box", "box/proj/.git"], ids=["above_the_repository", "its_git_directory"]
)
def test_a_repository_the_role_could_open_but_may_not_search_is_refused(
    c: httpx.Client, edges: Target, ws: Path, shut: str
) -> None:
    _repo(ws / "box" / "proj")
    _hand_over(ws, edges.settings)
    closed = ws / shut
    closed.chmod(0o600)  # the role's own, closed to it: chmod opens it again, inside the turn
    hooks = ws / "box" / "proj" / ".git" / "hooks"
    try:
        attack = f"chmod 700 {shut} && echo evil > box/proj/.git/hooks/pre-commit; echo rc=$?"
        turn, evs = run(c, ["sh", "-c", attack], cwd=str(ws))
        rule, detail = _refusal(turn)
        assert rule == "bad-mount", output(evs)
        assert f"{closed} is closed to uid {_uid(edges.settings)}" in detail
        assert f"chmod u+x {closed}" in detail
    finally:
        closed.chmod(0o700)  # left shut, it would refuse the module's later turns
    assert not (hooks / "pre-commit").exists()


def test_a_repository_an_acl_opens_to_the_role_keeps_its_hooks_read_only(
    c: httpx.Client, edges: Target, ws: Path
) -> None:
    _repo(ws / "shared" / "proj")
    _hand_over(ws, edges.settings)
    _root_only(ws / "shared")
    # 0700 and root's: only the ACL lets the role in.
    acl = f"u:{_uid(edges.settings)}:rx"
    subprocess.run(["setfacl", "-m", acl, str(ws / "shared")], check=True)
    attack = "echo evil > shared/proj/.git/hooks/pre-commit 2>&1; echo rc=$?"
    turn, evs = run(c, ["sh", "-c", attack], cwd=str(ws))
    assert turn.refusal is None, turn.refusal
    assert "rc=0" not in output(evs)
    assert not (ws / "shared/proj/.git/hooks/pre-commit").exists()


def test_a_mount_source_out_of_bubblewraps_reach_is_said_as_such() -> None:
    said = b"bwrap: Can't find source path /proc/self/fd/18: Permission denied\n"
    refusal = explain_setup_failure(said, {18: "/w/closed/repo/.git"})
    assert (refusal.rule, refusal.path) == ("bad-mount", "/w/closed/repo/.git")
    assert "out of the turn's reach" in refusal.detail
    replaced = b"bwrap: Can't find source path /proc/self/fd/18: No such file or directory\n"
    assert explain_setup_failure(replaced, {18: "/etc/passwd"}).rule == "path-changed"


# --- 4. mount destinations must already be normal ------------------------------------------


@pytest.mark.parametrize(
    "dest", ["/../oldroot/etc/nologin", "/x/../../y", "/x//y", "/x/./y", "/x/"]
)
def test_secret_destination_that_is_not_normal_is_refused(
    c: httpx.Client, ws: Path, dest: str
) -> None:
    secret = ws / "s.txt"
    secret.write_text("s")
    turn = submit(c, argv=["true"], secrets=[f"{secret}:{dest}"])
    rule, detail = _refusal(turn)
    assert rule == "bad-mount" and "not a normal absolute path" in detail
    assert not Path("/etc/nologin").exists()


def test_secret_destination_on_a_forbidden_path_is_refused(c: httpx.Client, ws: Path) -> None:
    secret = ws / "s2.txt"
    secret.write_text("s")
    assert _refusal(submit(c, argv=["true"], secrets=[f"{secret}:/etc/shadow"]))[0] == (
        "forbidden-path"
    )


# --- 5. the server never follows what a turn planted in its home ------------------------------


def test_home_replaced_by_a_symlink_is_moved_aside_and_the_role_keeps_working(
    c: httpx.Client, edges: Target, tmp_path: Path
) -> None:
    home = role_home(edges.settings, "builder")
    run(c, ["true"])  # the home exists
    victim = tmp_path / "host-dir"
    victim.mkdir()
    aside = home.with_name("home.planted")
    home.rename(aside)
    home.symlink_to(victim)
    turn, evs = run(c, ["sh", "-c", "echo ok > $HOME/note; echo $HOME"])
    assert turn.exit_code == 0, turn.refusal
    assert any("was not a directory" in e.message for e in evs if e.kind == "notice")
    assert list(victim.iterdir()) == []  # nothing was made through the link
    assert home.is_dir() and not home.is_symlink()
    st = home.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (_uid(edges.settings), 0o700)


def test_home_owned_by_someone_else_is_moved_aside(c: httpx.Client, edges: Target) -> None:
    home = role_home(edges.settings, "builder")
    run(c, ["true"])
    os.chown(home, 0, 0)
    turn, evs = run(c, ["touch", f"{home}/mine"])
    assert turn.exit_code == 0
    assert any("belonged to uid 0" in e.message for e in evs if e.kind == "notice")
    assert home.stat().st_uid == _uid(edges.settings)


def test_a_home_the_server_cannot_make_refuses_the_turn_and_says_why(
    c: httpx.Client, edges: Target
) -> None:
    mine = role_home(edges.settings, "builder").parent  # STATE/roles/builder: the server's
    run(c, ["true"])
    st = mine.stat()
    os.chown(mine, 12345, 12345)
    try:
        turn, _ = run(c, ["true"])
    finally:
        os.chown(mine, st.st_uid, st.st_gid)
    assert turn.exit_code == 126 and turn.refusal is not None
    assert turn.refusal.rule == "backend-unavailable"
    assert "owned by uid 12345" in turn.refusal.detail
    assert run(c, ["true"])[0].exit_code == 0


# --- 6. /proc, /sys and /dev are never mounted --------------------------------------------


@pytest.mark.parametrize("path", ["/proc", "/proc/1", "/sys", "/dev", "/dev/shm", "/"])
def test_fs_read_of_proc_sys_dev_or_a_parent_is_refused(c: httpx.Client, path: str) -> None:
    assert _refusal(submit(c, argv=["true"], fs={"read": [path]}))[0] == "forbidden-path"


def test_secret_placed_into_proc_is_refused(c: httpx.Client, ws: Path) -> None:
    secret = ws / "s3.txt"
    secret.write_text("s")
    turn = submit(c, argv=["true"], secrets=[f"{secret}:/proc/self/fake"])
    assert _refusal(turn)[0] == "forbidden-path"


# --- 7. other roles' workspaces -------------------------------------------------------------


def test_another_roles_workspace_is_forbidden(c: httpx.Client, edges: Target) -> None:
    other_ws = edges.settings.roles["other"].workspaces[0]
    rule, detail = _refusal(submit(c, argv=["true"], fs={"read": [other_ws]}))
    assert rule == "forbidden-path" and "a workspace of role 'other'" in detail


def test_a_workspace_both_roles_list_is_shared(tmp_path: Path, ca: trustme.CA) -> None:
    settings = make_settings(Path(canonical_path(tmp_path)), ca)  # both list the same one
    shared = settings.roles["builder"].workspaces[0]
    assert settings.roles["other"].workspaces == (shared,)


def test_overlapping_workspaces_of_two_roles_are_a_config_error() -> None:
    digest = "0" * 64
    text = (
        f'[roles.a]\ntoken_sha256 = "{digest}"\nworkspaces = ["/srv/w"]\n'
        f'[roles.b]\ntoken_sha256 = "{digest}"\nworkspaces = ["/srv/w/b"]\n'
    )
    with pytest.raises(ConfigError, match="overlap"):
        parse_settings(text)


# --- 8. vsock ------------------------------------------------------------------------------


VSOCK = socket_opening("AF_VSOCK", "SOCK_STREAM")


def test_vsock_is_filtered_without_network(c: httpx.Client) -> None:
    _, evs = run(c, ["python3", "-c", VSOCK])
    assert output(evs) == "97\n"  # EAFNOSUPPORT


def test_vsock_stays_for_a_role_with_network(edges: Target) -> None:
    with edges.client(OTHER_TOKEN) as c:
        turn, evs = run(c, ["python3", "-c", VSOCK], role="other", network="host")
    assert turn.exit_code == 0
    assert output(evs) != "97\n"


def test_a_network_turn_keeps_to_the_fences_socket_families(edges: Target) -> None:
    """With the host's network the filter differs (vsock stays), but no other family does:
    unfiltered, the kernel looks AF_PACKET up and answers EPERM (no CAP_NET_RAW)."""
    with edges.client(OTHER_TOKEN) as c:
        packet = socket_opening("AF_PACKET", "SOCK_DGRAM")
        turn, evs = run(c, ["python3", "-c", packet], role="other", network="host")
    assert (turn.exit_code, output(evs)) == (0, "97\n")  # EAFNOSUPPORT


def test_network_turn_reaches_no_abstract_socket_of_the_host(edges: Target) -> None:
    """A turn with the host's network shares its network namespace, and with it every
    abstract unix socket listening there (a D-Bus bus, an X server, a container runtime's
    shim, whose peers are trusted for being on the machine). The fence's Landlock domain
    keeps them out of reach (EPERM) where the kernel has one (ABI 6, Linux 6.12)."""
    with abstract_listener() as name, edges.client(OTHER_TOKEN) as c:
        turn, evs = run(c, ["python3", "-c", ABSTRACT_CONNECT, name], role="other", network="host")
    assert turn.exit_code == 0, output(evs, "stderr")
    assert output(evs) == "1\n"  # EPERM


# --- 9. the fence's PATH ---------------------------------------------------------------------


def test_fence_path_directory_of_the_operator_is_bound_and_runs(c: httpx.Client) -> None:
    turn, evs = run(c, ["paddock-tool"])
    assert (turn.exit_code, output(evs)) == (0, "tool ran\n")


def test_fence_path_directory_others_can_write_is_refused(tmp_path: Path, ca: trustme.CA) -> None:
    settings = make_settings(Path(canonical_path(tmp_path)), ca)
    loose = tmp_path / "loose-bin"
    loose.mkdir()
    loose.chmod(0o777)
    fence = FenceConfig(path=f"{loose}:/usr/bin:/bin")
    settings = settings.model_copy(update={"fence": fence})
    with ServerThread(settings) as server:
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        target = Target(server.url, str(tmp_path / "ca.pem"), settings, tmp_path / "ws")
        with target.client() as c:
            turn = submit(c, argv=["true"])
    rule, detail = _refusal(turn)
    assert rule == "untrusted-executable" and str(loose) in detail


# --- 10. removed choices ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "says"),
    [('backend = "none"', "bubblewrap"), ('on_unavailable = "warn"', "refuses turns")],
)
def test_fence_without_isolation_cannot_be_configured(line: str, says: str) -> None:
    text = f'[fence]\n{line}\n[roles.a]\ntoken_sha256 = "{"0" * 64}"\nworkspaces = ["/w"]\n'
    with pytest.raises(ConfigError, match=says):
        parse_settings(text)


# --- 11. the environment a turn gets ----------------------------------------------------------


def test_env_declared_lang_alone_sets_the_locale(c: httpx.Client) -> None:
    _, evs = run(c, ["env"], env={"LANG": "en_US.UTF-8"})
    values = dict(line.split("=", 1) for line in output(evs).splitlines())
    assert values["LANG"] == "en_US.UTF-8"
    assert "LC_ALL" not in values


def test_env_home_is_the_roles_own_not_the_servers(c: httpx.Client, edges: Target) -> None:
    _, evs = run(c, ["sh", "-c", "echo $HOME"])
    assert output(evs) == f"{role_home(edges.settings, 'builder')}\n"
    assert output(evs) != f"{os.environ.get('HOME')}\n"


def test_env_turn_id_is_minted_even_when_the_server_has_one(
    c: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PADDOCK_TURN_ID", "t-" + "f" * 32)
    turn, evs = run(c, ["sh", "-c", "echo $PADDOCK_TURN_ID"])
    assert output(evs) == f"{turn.turn_id}\n"


# --- 12. the kernel's keyrings ----------------------------------------------------------------

KEYCTL, ADD_KEY = 250, 248
JOIN_SESSION_KEYRING, SESSION_KEYRING = 1, -3


def _holding_a_key() -> None:
    """A session keyring of the server's own, as systemd gives every service, holding a secret
    (what a login's keyring or a service's credentials would hold)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(KEYCTL, JOIN_SESSION_KEYRING, None) >= 0
    secret = b"server-secret-0417"
    added = libc.syscall(ADD_KEY, b"user", b"paddock-test", secret, len(secret), SESSION_KEYRING)
    assert added >= 0


KEY_PROBE = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(*args):
    ctypes.set_errno(0)
    result = libc.syscall(*args)
    return result if result >= 0 else errno.errorcode[ctypes.get_errno()]
session = call(250, 0, -3, 0)
key = call(250, 10, session, b"user", b"paddock-test", 0) if isinstance(session, int) else None
read = ctypes.create_string_buffer(64)
size = call(250, 11, key, read, 64) if isinstance(key, int) else None
upcall = call(249, b"user", b"paddock-test-upcall", b"callout", 0)
print(session, key, read.raw[: size if isinstance(size, int) else 0], upcall)
"""


def test_keyrings_a_turn_reaches_none_of_the_servers_keys(tmp_path: Path) -> None:
    """Keyrings belong to no namespace, and a session keyring is inherited through exec and a
    change of uid: a turn would possess the server's (systemd's per-service one, or a login's,
    linked to root's own) and read every key in it. ``request_key`` would start the host's
    ``request-key`` program as root. The fence answers all three calls with ENOSYS."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    target = TargetProcess.start(config, url, root / "target.log", preexec=_holding_a_key)
    try:
        with target.client() as client:
            turn, evs = run(client, ["python3", "-c", KEY_PROBE])
    finally:
        target.kill()
    assert turn.exit_code == 0, output(evs, "stderr")
    assert "server-secret" not in output(evs)
    assert output(evs).split() == ["ENOSYS", "None", "b''", "ENOSYS"]


# --- 13. the signals a turn starts with --------------------------------------------------------


def _ignoring_quit_and_hangup() -> None:
    for signum in (signal.SIGQUIT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def test_signals_a_server_inherited_ignored_it_keeps_ignoring_and_hands_to_no_turn(
    tmp_path: Path,
) -> None:
    """Started as ``nohup`` and a shell's background job would start it (SIGHUP and SIGQUIT
    ignored): it lives through both, its turns get every signal at its default, and no extra
    program resets them for each turn (the server ignores none of them itself any more)."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    target = TargetProcess.start(
        config, url, root / "target.log", preexec=_ignoring_quit_and_hangup
    )
    try:
        server = Path(f"/proc/{target.proc.pid}/status").read_text()
        assert signal_set(server) & {signal.SIGQUIT, signal.SIGHUP} == set()
        assert {signal.SIGQUIT, signal.SIGHUP} <= signal_set(server, "SigCgt")
        for signum in (signal.SIGQUIT, signal.SIGHUP):
            target.proc.send_signal(signum)
        with target.client() as client:
            turn, evs = run(client, ["cat", "/proc/self/status"])
        assert turn.exit_code == 0, evs
        assert signal_set(output(evs)) == set()
        assert target.up()
    finally:
        target.kill()


def _blocking_int_and_usr1() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR1})


def test_signals_a_server_inherited_blocked_reach_its_turns(tmp_path: Path) -> None:
    """A signal mask survives exec too: started with SIGINT and SIGUSR1 blocked, the server
    handed that mask to every turn, and a turn sent INT (the API's Ctrl-C) never got it. The
    server still shrugs SIGUSR1 off, as it did while it was blocked."""
    root = Path(canonical_path(tmp_path))
    config, url = write_config(root)
    log = root / "target.log"
    target = TargetProcess.start(config, url, log, preexec=_blocking_int_and_usr1)
    try:
        server = Path(f"/proc/{target.proc.pid}/status").read_text()
        assert signal_set(server, "SigBlk") == set()
        assert signal.SIGUSR1 in signal_set(server, "SigCgt")
        target.proc.send_signal(signal.SIGUSR1)
        with target.client() as client:
            _, evs = run(client, ["cat", "/proc/self/status"])
            assert signal_set(output(evs), "SigBlk") == set()
            marker = "318.75"
            turn = submit(client, argv=["sh", "-c", f"sleep {marker}"])
            assert wait_until(lambda: bool(processes_with("sleep", marker)))
            client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "INT"})
            assert finished(client, turn.turn_id).exit_code == 128 + signal.SIGINT
        assert target.up()
    finally:
        target.kill()


def test_signals_ignored_once_changed_need_no_program_before_bubblewrap() -> None:
    """What the server does at its start leaves ``env --default-signal`` nothing to do."""
    # Every other signal at its default first: a test run started under nohup, or as a
    # shell's background job, hands its children SIGHUP, SIGINT and SIGQUIT ignored.
    script = (
        "import signal; signal.pthread_sigmask(signal.SIG_SETMASK, ())\n"
        "from target_side.fence import launch, signals\n"
        "for number in signals.CATCHABLE:\n"
        "    signal.signal(number, signal.SIG_DFL)\n"
        "signal.signal(signal.SIGQUIT, signal.SIG_IGN)\n"
        "assert launch.signal_reset_prefix()\n"
        "print(signals.stop_passing_on_inherited(), launch.signal_reset_prefix())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout == f"[{int(signal.SIGQUIT)}] ()\n"
