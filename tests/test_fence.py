"""The fence as a turn sees it, and the refusals that keep paths out of it."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from conftest import Target, events, output, owned_by_role, processes_with, run, submit, wait_until

from shared.walk import canonical_path


def _refused_without_launch(client: httpx.Client, target: Target, **request: object) -> str:
    """Submit a turn that would leave a marker if it ran; return its refusal rule."""
    marker = target.workspace / "launched-marker"
    marker.unlink(missing_ok=True)
    turn = submit(client, argv=["touch", str(marker)], **request)
    assert turn.state == "refused"
    assert turn.exit_code == 126
    assert turn.started_at is None
    assert [e.kind for e in events(client, turn.turn_id)] == ["refused"]
    assert not marker.exists()
    assert not (target.settings.state_root / "scratch" / turn.turn_id).exists()
    assert turn.refusal is not None
    return turn.refusal.rule


def test_fs_read_of_forbidden_path_exact_is_refused(client: httpx.Client, target: Target) -> None:
    assert _refused_without_launch(client, target, fs={"read": ["/etc/shadow"]}) == "forbidden-path"


def test_fs_read_inside_forbidden_path_is_refused(client: httpx.Client, target: Target) -> None:
    rule = _refused_without_launch(client, target, fs={"read": ["/etc/ssh/sshd_config"]})
    assert rule == "forbidden-path"


def test_fs_read_of_parent_of_forbidden_path_is_refused(
    client: httpx.Client, target: Target
) -> None:
    # /etc holds /etc/shadow: binding it would expose the secret inside.
    assert _refused_without_launch(client, target, fs={"read": ["/etc"]}) == "forbidden-path"


def test_fs_read_through_a_symlink_to_forbidden_path_is_refused(
    client: httpx.Client, target: Target
) -> None:
    link = target.workspace / "innocent-looking"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/shadow")
    response = client.post(
        "/v1/turns", json={"role": "builder", "argv": ["true"], "fs": {"read": [str(link)]}}
    )
    refusal = response.json()["refusal"]
    assert refusal["rule"] == "forbidden-path"
    assert refusal["path"] == str(link)
    assert refusal["resolved"] == "/etc/shadow"
    assert _refused_without_launch(client, target, fs={"read": [str(link)]}) == "forbidden-path"


def test_fs_read_of_state_root_is_refused(client: httpx.Client, target: Target) -> None:
    state = str(target.settings.state_root)
    assert _refused_without_launch(client, target, fs={"read": [state]}) == "forbidden-path"


def test_fs_read_of_sibling_role_state_is_refused(client: httpx.Client, target: Target) -> None:
    sibling = target.settings.state_root / "roles" / "other"
    sibling.mkdir(parents=True, exist_ok=True)
    rule = _refused_without_launch(client, target, fs={"read": [str(sibling)]})
    assert rule == "forbidden-path"


def test_fs_read_of_credential_dir_in_home_is_refused(client: httpx.Client, target: Target) -> None:
    ssh_dir = Path(os.environ["HOME"]) / ".ssh"
    rule = _refused_without_launch(client, target, fs={"read": [str(ssh_dir)]})
    assert rule in {"forbidden-path", "bad-mount"}
    if ssh_dir.exists():
        assert rule == "forbidden-path"


def test_cwd_outside_workspace_is_refused(client: httpx.Client, target: Target) -> None:
    assert _refused_without_launch(client, target, cwd="/usr") == "outside-workspace"


def test_fs_write_outside_workspace_is_refused(client: httpx.Client, target: Target) -> None:
    assert (
        _refused_without_launch(client, target, fs={"write": ["/var/tmp"]}) == "outside-workspace"
    )


def test_cwd_escaping_workspace_through_symlink_is_refused(
    client: httpx.Client, target: Target
) -> None:
    link = target.workspace / "escape"
    link.unlink(missing_ok=True)
    link.symlink_to("/usr/share")
    assert _refused_without_launch(client, target, cwd=str(link)) == "outside-workspace"


def test_network_for_role_without_it_is_refused(client: httpx.Client, target: Target) -> None:
    assert _refused_without_launch(client, target, network="host") == "network-not-allowed"


def test_limit_above_role_maximum_is_refused(client: httpx.Client, target: Target) -> None:
    assert (
        _refused_without_launch(client, target, limits={"wall_s": 10_000}) == "limit-exceeds-role"
    )


def test_reserved_env_name_is_refused(client: httpx.Client, target: Target) -> None:
    rule = _refused_without_launch(client, target, env={"PADDOCK_TURN_ID": "forged"})
    assert rule == "reserved-env"


def test_invalid_env_name_is_refused(client: httpx.Client, target: Target) -> None:
    assert _refused_without_launch(client, target, env={"1BAD": "x"}) == "invalid-env"


def test_fence_runs_as_non_root_without_capabilities(client: httpx.Client) -> None:
    # No capability, none to gain: with no_new_privs, a setuid-root program (sudo, su) that a
    # turn can see runs as the role, so what runs as a role is never root.
    probe = "id -u; grep -E '^(Cap(Eff|Prm|Bnd)|NoNewPrivs)' /proc/self/status"
    _, evs = run(client, ["sh", "-c", probe])
    lines = output(evs).splitlines()
    assert lines[0] != "0"
    caps = [line.split()[1] for line in lines[1:] if line.startswith("Cap")]
    assert caps == ["0000000000000000"] * 3, lines
    assert "NoNewPrivs:\t1" in lines, lines


def test_fence_system_dirs_are_read_only(client: httpx.Client) -> None:
    _, evs = run(client, ["sh", "-c", "touch /usr/paddock-probe 2>&1; echo rc=$?"])
    assert "rc=0" not in output(evs)
    assert not os.path.exists("/usr/paddock-probe")


def test_fence_remount_read_only_bind_writable_fails(client: httpx.Client, tmp_path: Path) -> None:
    shared_dir = Path(canonical_path(tmp_path)) / "ro"
    shared_dir.mkdir()
    script = (
        f"mount -o remount,bind,rw {shared_dir} 2>&1; echo rc=$?; echo x > {shared_dir}/planted"
    )
    _, evs = run(client, ["sh", "-c", script], fs={"read": [str(shared_dir)]})
    assert "rc=0" not in output(evs)
    assert not (shared_dir / "planted").exists()


def test_fence_cwd_is_writable_and_tmp_is_private(client: httpx.Client, target: Target) -> None:
    _, evs = run(
        client, ["sh", "-c", "pwd; echo hi > made-here; echo private > /tmp/only-in-fence; ls /tmp"]
    )
    lines = output(evs).splitlines()
    assert lines[0] == str(target.workspace)
    assert (target.workspace / "made-here").read_text() == "hi\n"
    assert "only-in-fence" in lines
    assert not os.path.exists("/tmp/only-in-fence")


def test_fence_hides_host_secrets_and_sockets(client: httpx.Client) -> None:
    _, evs = run(client, ["sh", "-c", "ls -a /etc /run /root 2>&1; cat /etc/shadow 2>&1"])
    text = output(evs)
    assert "shadow" not in text.replace("cat: /etc/shadow: No such file or directory", "")
    assert "No such file or directory" in text


def test_fence_has_no_network_but_loopback(client: httpx.Client) -> None:
    _, evs = run(client, ["cat", "/proc/net/dev"])
    interfaces = [line.split(":")[0].strip() for line in output(evs).splitlines()[2:]]
    assert interfaces == ["lo"]


def test_fence_env_is_the_allowlist(client: httpx.Client, target: Target) -> None:
    turn, evs = run(client, ["env"], env={"DECLARED": "yes"})
    names = {line.split("=", 1)[0] for line in output(evs).splitlines()}
    # Written by hand, not derived from the code: an allowlist no test names is one edit
    # away from being a denylist.
    permitted = {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TERM",
        "COLORTERM",
        "TMPDIR",
        "LANG",
        "LC_ALL",
        "PADDOCK_TURN_ID",
        "DECLARED",
        "PWD",
        "SHLVL",
        "_",
    }
    assert names <= permitted, names - permitted
    values = dict(line.split("=", 1) for line in output(evs).splitlines())
    assert values["PADDOCK_TURN_ID"] == turn.turn_id
    assert values["LANG"] == values["LC_ALL"] == "C.UTF-8"
    assert values["PATH"] == target.settings.fence.path


def test_fence_git_hooks_stay_read_only(client: httpx.Client, target: Target) -> None:
    hooks = target.workspace / ".git" / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    # The role's own, as in a workspace it owns: only the mount keeps it from writing there.
    for directory in (hooks.parent, hooks):
        owned_by_role(directory, target.settings)
    _, evs = run(client, ["sh", "-c", "echo evil > .git/hooks/pre-commit 2>&1; echo rc=$?"])
    assert "rc=0" not in output(evs)
    assert not (hooks / "pre-commit").exists()


def test_fence_fs_read_is_visible_read_only(
    client: httpx.Client, target: Target, tmp_path: Path
) -> None:
    shared_dir = Path(canonical_path(tmp_path)) / "shared"
    shared_dir.mkdir()
    (shared_dir / "data.txt").write_text("readable\n")
    _, evs = run(
        client,
        ["sh", "-c", f"cat {shared_dir}/data.txt; echo x > {shared_dir}/new 2>&1; echo rc=$?"],
        fs={"read": [str(shared_dir)]},
    )
    text = output(evs)
    assert text.startswith("readable\n")
    assert "rc=0" not in text
    assert not (shared_dir / "new").exists()


def test_fs_read_of_a_unix_socket_is_refused(
    client: httpx.Client, target: Target, tmp_path: Path
) -> None:
    import socket

    path = Path(canonical_path(tmp_path)) / "control.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        rule = _refused_without_launch(client, target, fs={"read": [str(path)]})
    assert rule == "forbidden-path"


def test_plan_reports_the_fence_without_launching(client: httpx.Client, target: Target) -> None:
    marker = target.workspace / "plan-marker"
    body = {
        "role": "builder",
        "argv": ["touch", str(marker)],
        "env": {"TOKEN": "value-not-shown"},
        "fs": {"read": ["/usr/share"]},
    }
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200
    plan = response.json()
    assert plan["exit_code"] == 0 and plan["refusal"] is None
    fence = plan["fence"]
    assert fence["executable"]["path"] == "/usr/bin/touch"
    assert {
        "kind": "ro",
        "source": "/usr/share",
        "dest": "/usr/share",
        "subject": "fs.read[0]",
    } in fence["mounts"]
    assert any(m["kind"] == "rw" and m["source"] == str(target.workspace) for m in fence["mounts"])
    assert "TOKEN" in fence["env_names"]
    assert "value-not-shown" not in response.text
    assert fence["limits"]["wall_s"] == 60
    assert not marker.exists()


def test_plan_reports_a_refusal(client: httpx.Client) -> None:
    plan = client.post(
        "/v1/plan", json={"role": "builder", "argv": ["cat"], "fs": {"read": ["/etc/shadow"]}}
    ).json()
    assert plan["fence"] is None
    assert plan["refusal"]["rule"] == "forbidden-path"
    assert plan["exit_code"] == 126


HOSTILE_ENV = {
    "BASH_ENV": "/tmp/evil.sh",
    "ENV": "/tmp/evil.sh",
    "LD_PRELOAD": "/tmp/evil.so",
    "LD_LIBRARY_PATH": "/tmp/evil",
    "LD_AUDIT": "/tmp/evil.so",
    "PYTHONPATH": "/tmp/evil",
    "PYTHONSTARTUP": "/tmp/evil.py",
    "PYTHONHOME": "/tmp/evil",
    "NODE_OPTIONS": "--require /tmp/evil.js",
    "NPM_CONFIG_PREFIX": "/tmp/evil",
    "PERL5OPT": "-Mevil",
    "PERL5LIB": "/tmp/evil",
    "RUBYOPT": "-revil",
    "GIT_CONFIG_GLOBAL": "/tmp/evil.gitconfig",
    "GIT_SSH_COMMAND": "evil",
    "AWS_SECRET_ACCESS_KEY": "hostile-aws",
    "GITHUB_TOKEN": "hostile-gh",
    "SSH_AUTH_SOCK": "/tmp/hostile-agent.sock",
    "PROMPT_COMMAND": "evil",
    "IFS": "x",
}


def test_fence_env_hostile_server_env_never_arrives(
    client: httpx.Client, target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in HOSTILE_ENV.items():
        monkeypatch.setenv(name, value)
    marker = "341.5"
    turn = submit(
        client,
        argv=["sh", "-c", f"env; echo ---; cat /proc/*/environ | tr '\\0' '\\n'; sleep {marker}"],
    )
    assert wait_until(lambda: bool(processes_with("sleep", marker)))
    bwrap_envs = [_environ(pid) for pid in _bwrap_pids_of(marker)]
    client.post(f"/v1/turns/{turn.turn_id}/signal", json={"signal": "KILL"})
    text = output(events(client, turn.turn_id))
    names = {line.split("=", 1)[0] for line in text.splitlines() if "=" in line}
    assert not names & set(HOSTILE_ENV), names & set(HOSTILE_ENV)
    assert not any(value in text for value in ("hostile-aws", "hostile-gh", "/tmp/evil"))
    # bubblewrap itself ran under the turn's environment, not the server's.
    assert bwrap_envs, "the turn's bwrap process was not found"
    for env in bwrap_envs:
        assert not set(env) & set(HOSTILE_ENV)


def _bwrap_pids_of(marker: str) -> list[int]:
    """The bwrap processes above the turn's ``sleep MARKER``: walk up its parents."""
    found = []
    pid = processes_with("sleep", marker)[0]
    while pid > 1:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmdline[0].endswith(b"bwrap"):
            found.append(pid)
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_fs_read_through_a_symlink_loop_is_refused_not_a_server_error(
    client: httpx.Client, target: Target
) -> None:
    loop_a, loop_b = target.workspace / "loop-a", target.workspace / "loop-b"
    for link, to in ((loop_a, loop_b), (loop_b, loop_a)):
        link.unlink(missing_ok=True)
        link.symlink_to(to)
    rule = _refused_without_launch(client, target, fs={"read": [str(loop_a / "x")]})
    assert rule == "bad-mount"
