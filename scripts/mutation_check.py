#!/usr/bin/env python3
"""Show that each security test can fail: invert the rule it defends, expect red.

Each mutation is applied to a private copy of the tree (never the working
tree), the tests that defend the rule are run there, and the mutation passes
only if they FAIL. Run: ``.venv/bin/python scripts/mutation_check.py [NAME ...]``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    also: tuple[tuple[str, str], ...] = ()


MUTATIONS = (
    Mutation(
        "forbidden-list-ignored",
        "target_side/policy/forbidden.py",
        "        if any(is_within(canonical, mine) for mine in self.own):\n            return None",
        "        return None",
        ("tests/test_fence.py -k forbidden_path or parent or symlink or state_root or sibling",),
    ),
    Mutation(
        "parent-conflict-dropped",
        "shared/walk.py",
        "    if is_within(forbidden, mount):\n        return Conflict.PARENT",
        "    if False:\n        return Conflict.PARENT",
        ("tests/test_fence.py::test_fs_read_of_parent_of_forbidden_path_is_refused",),
    ),
    Mutation(
        "own-state-exemption-widened-to-parent",
        "target_side/policy/forbidden.py",
        "if any(is_within(canonical, mine) for mine in self.own):",
        "if any(is_within(canonical, mine.rsplit('/', 2)[0]) for mine in self.own):",
        ("tests/test_fence.py::test_fs_read_of_sibling_role_state_is_refused",),
    ),
    Mutation(
        "symlinks-not-followed",
        "target_side/policy/plan.py",
        "        resolved = resolve(subject, path)\n        self._check_forbidden(subject, path, resolved)",
        "        resolved = posixpath.normpath(path)\n        self._check_forbidden(subject, path, resolved)",
        ("tests/test_fence.py::test_fs_read_through_a_symlink_to_forbidden_path_is_refused",),
    ),
    Mutation(
        "workspace-unchecked",
        "target_side/policy/plan.py",
        "        if not any(is_within(resolved, w) for w in self.workspaces):",
        "        if False:",
        ("tests/test_fence.py -k outside_workspace or escaping",),
    ),
    Mutation(
        "capabilities-kept-as-root",
        "target_side/fence/launch.py",
        '        "--uid",\n        str(plan.uid),\n        "--gid",\n        str(plan.gid),\n        "--cap-drop",\n        "ALL",\n',
        '        "--uid",\n        "0",\n        "--gid",\n        "0",\n        "--cap-add",\n        "ALL",\n',
        ("tests/test_fence.py::test_fence_runs_as_non_root_without_capabilities",),
    ),
    Mutation(
        # --disable-userns alone also locks the mounts (a nested user namespace), so the
        # remount test only goes red once both layers are gone.
        "capabilities-kept-as-root-remount",
        "target_side/fence/launch.py",
        '        "--uid",\n        str(plan.uid),\n        "--gid",\n        str(plan.gid),\n        "--cap-drop",\n        "ALL",\n',
        '        "--uid",\n        "0",\n        "--gid",\n        "0",\n        "--cap-add",\n        "ALL",\n',
        ("tests/test_fence.py::test_fence_remount_read_only_bind_writable_fails",),
        also=(('"--unshare-user", "--disable-userns"]', '"--unshare-user"]'),),
    ),
    Mutation(
        "root-inside",
        "target_side/policy/plan.py",
        "return (NOBODY, NOBODY) if uid == 0 else (uid, gid)",
        "return (0, 0)",
        ("tests/test_fence.py::test_fence_runs_as_non_root_without_capabilities",),
    ),
    Mutation(
        "network-shared",
        "target_side/fence/launch.py",
        '    if plan.network:\n        flags.append("--share-net")',
        '    flags.append("--share-net")',
        ("tests/test_fence.py::test_fence_has_no_network_but_loopback",),
    ),
    Mutation(
        "server-env-inherited",
        "target_side/policy/plan.py",
        "    env |= {name: server_env[name] for name in INHERITED_ENV if name in server_env}",
        "    env |= server_env",
        ("tests/test_fence.py::test_fence_env_is_the_allowlist",),
    ),
    Mutation(
        "bwrap-under-server-env",
        "target_side/fence/runner.py",
        "            env=env,\n",
        "            env={**os.environ, **env},\n",
        ("tests/test_fence.py::test_fence_env_hostile_server_env_never_arrives",),
    ),
    Mutation(
        "reserved-env-accepted",
        "target_side/policy/plan.py",
        '        if name.startswith("PADDOCK_"):',
        "        if False:",
        ("tests/test_fence.py::test_reserved_env_name_is_refused",),
    ),
    Mutation(
        "git-hooks-writable",
        "target_side/policy/plan.py",
        "    planner.protect_git()\n",
        "",
        ("tests/test_fence.py::test_fence_git_hooks_stay_read_only",),
    ),
    Mutation(
        "auth-accepts-any-token",
        "target_side/service/auth.py",
        "        if not held:\n",
        "        if not held:\n            return frozenset(n for n, _ in self._hashes)\n",
        ("tests/test_api.py -k 401",),
    ),
    Mutation(
        "role-not-checked",
        "target_side/service/auth.py",
        "    if role not in held:",
        "    if False:",
        ("tests/test_api.py::test_turn_for_role_the_token_does_not_hold_is_403",),
    ),
    Mutation(
        "body-limit-off",
        "target_side/service/app.py",
        "    app.add_middleware(BodyLimit, max_bytes=MAX_BODY)\n",
        "",
        ("tests/test_api.py::test_body_over_one_mib_is_413_and_server_keeps_serving",),
    ),
    Mutation(
        "orphans-survive",
        "target_side/fence/launch.py",
        '    flags = ["--unshare-all", "--unshare-user", "--disable-userns"]',
        '    flags = ["--unshare-user", "--unshare-net", "--unshare-ipc", "--disable-userns"]',
        ("tests/test_turns.py::test_turn_leaves_no_background_process_behind",),
    ),
    Mutation(
        "resume-skips-an-event",
        "target_side/service/app.py",
        "        start = max(after, last_event_id or 0)\n",
        "        start = max(after, last_event_id or 0) + (1 if after else 0)\n",
        ("tests/test_resume.py", "tests/test_turns.py -k resume"),
    ),
    Mutation(
        "ignored-signals-inherited",
        "target_side/fence/launch.py",
        "        *signal_reset_prefix(),\n",
        "",
        ("tests/test_turns.py::test_turn_signal_works_even_if_the_server_ignores_it",),
    ),
    Mutation(
        "unlinked-source-reported-as-backend-failure",
        "target_side/fence/runner.py",
        """ or "Can't find source path /proc/self/fd/" in last""",
        "",
        ("tests/test_held_paths.py -k unlinked",),
    ),
    Mutation(
        "setup-failure-as-exit-1",
        "target_side/fence/runner.py",
        "        if self._status.exit_code is None:\n            # bwrap itself failed",
        "        if False:\n            # bwrap itself failed",
        ("tests/test_turns.py::test_turn_bwrap_setup_failure_is_126_not_1",),
    ),
    Mutation(
        "socket-mounts-allowed",
        "target_side/policy/plan.py",
        "        if stat.S_ISSOCK(st.st_mode):",
        "        if False:",
        ("tests/test_fence.py -k socket",),
    ),
    Mutation(
        "mount-bound-by-path",
        "target_side/fence/launch.py",
        "            argv += [flags[mount.kind], str(fd), mount.dest]",
        '            argv += [flags[mount.kind].removesuffix("-fd"), mount.source, mount.dest]',
        ("tests/test_held_paths.py::test_mount_swapped_after_open_mounts_the_checked_inode",),
    ),
    Mutation(
        "executable-not-bound-by-fd",
        "target_side/fence/launch.py",
        '        "--ro-bind-fd",\n        str(fds.held.exe),\n        plan.executable.path,\n',
        "",
        ("tests/test_held_paths.py::test_executable_replaced_after_open_runs_the_checked_inode",),
    ),
    Mutation(
        "held-identity-unchecked",
        "target_side/fence/held.py",
        "    if identity is not None and (st.st_dev, st.st_ino) != identity:",
        "    if False:",
        ("tests/test_held_paths.py -k another_directory_before or executable_replaced_before",),
    ),
    Mutation(
        "held-walk-follows-symlinks",
        "target_side/fence/held.py",
        "                fd = os.open(name, HOLD_FLAGS, dir_fd=parent)",
        "                fd = os.open(name, HOLD_FLAGS & ~os.O_NOFOLLOW, dir_fd=parent)",
        (
            "tests/test_held_paths.py::test_mount_parent_swapped_for_symlink_before_open_is_path_changed",
        ),
    ),
    Mutation(
        "executable-trust-unchecked",
        "target_side/policy/plan.py",
        "    _check_trusted(given, resolved, st)\n",
        "",
        ("tests/test_held_paths.py -k shim_in_world_writable or someone_else or group_writable",),
        also=(
            (
                '    _check_directories(given, resolved, resolve("argv[0]", posixpath.dirname(candidate)))'
                "\n",
                "",
            ),
        ),
    ),
    Mutation(
        "seccomp-filter-skipped",
        "target_side/fence/launch.py",
        "            seccomp=_opened(opened, syscall_filter.filter_fd()),",
        "            seccomp=None,",
        ("tests/test_seccomp.py -k eperm or enosys",),
    ),
    Mutation(
        "seccomp-ioctl-compared-on-64-bits",
        "target_side/fence/syscall_filter.py",
        "sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request)",
        "sc.Arg(1, sc.EQ, request)",
        ("tests/test_seccomp.py::test_filter_answers_terminal_injection_with_eperm",),
    ),
    Mutation(
        "clone3-answered-eperm",
        "target_side/fence/syscall_filter.py",
        "        rules.add_rule(sc.ERRNO(errno.ENOSYS), name)",
        "        rules.add_rule(sc.ERRNO(errno.EPERM), name)",
        ("tests/test_seccomp.py -k enosys or threads",),
    ),
    Mutation(
        "turn-not-placed-in-its-cgroups",
        "target_side/fence/runner.py",
        "                self._gate.limits.place(sandbox_pid)",
        "                pass",
        ("tests/test_limits.py -k pids_limit_caps or memory_hog or cpu_limit",),
    ),
    Mutation(
        # The fork-bomb test refuses to launch its bomb unless the pids limit is seen to hold.
        "pids-limit-dropped",
        "target_side/fence/limits.py",
        '\n        *([("pids.max", str(limits.pids))] if "pids" in has else []),',
        "",
        ("tests/test_limits.py -k pids_limit_caps or fork_bomb",),
    ),
    Mutation(
        "memory-limit-dropped",
        "target_side/fence/limits.py",
        '("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)',
        "",
        ("tests/test_limits.py::test_memory_hog_is_oom_killed_with_137",),
    ),
    Mutation(
        "cpu-quota-dropped",
        "target_side/fence/limits.py",
        '("cpu.cfs_quota_us", quota)',
        '("cpu.cfs_quota_us", "-1")',
        ("tests/test_limits.py::test_cpu_limit_bounds_cpu_time_and_usage_is_reported",),
    ),
    Mutation(
        "rlimit-fallback-dropped",
        "target_side/fence/limits.py",
        '            flags.append(f"--as={memory}:{memory}")',
        "            pass",
        ("tests/test_limits.py::test_without_cgroups_memory_falls_back_to_a_per_process_rlimit",),
    ),
    Mutation(
        "roles-route-unauthenticated",
        "target_side/service/app.py",
        "    async def held_roles(roles: Roles) -> RoleList:",
        "    async def held_roles() -> RoleList:",
        ("tests/test_api.py -k roles",),
        also=(("RoleList(roles=sorted(roles))", "RoleList(roles=sorted(settings.roles))"),),
    ),
    Mutation(
        "token-file-open-to-others-accepted",
        "agent_side/connection.py",
        "            if mode & 0o077:",
        "            if False:",
        ("tests/test_connection.py -k token_file",),
    ),
    Mutation(
        "ssh-remote-ca-not-verified",
        "agent_side/client.py",
        "        return ssl.create_default_context(cadata=ca_pem)",
        "        context = ssl.create_default_context(cadata=ca_pem)\n"
        "        context.check_hostname = False\n"
        "        context.verify_mode = ssl.CERT_NONE\n"
        "        return context",
        ("tests/test_ssh.py -k ca_read_from_the_host",),
    ),
    Mutation(
        "ssh-given-cacert-loses-to-the-hosts",
        "agent_side/api.py",
        "    if cacert is not None or remote_cacert is None:",
        "    if remote_cacert is None:",
        ("tests/test_ssh.py -k ca_read_from_the_host",),
    ),
    Mutation(
        "turn-cgroups-left-behind",
        "target_side/fence/limits.py",
        "            if self._try_remove():",
        "            if True:",
        ("tests/test_limits.py::test_turn_cgroups_are_removed_when_turns_end",),
    ),
    Mutation(
        "deploy-command-link-not-undone",
        "deploy/paddock_deploy/steps/switch.py",
        '    ctx.tx.on_failure(f"{link} as it was", lambda: point_link(link, before))\n',
        "",
        ("tests/test_deploy_steps.py -k switch_replaces_a_foreign_link",),
    ),
    Mutation(
        "deploy-command-link-overwrites-a-file",
        "deploy/paddock_deploy/steps/switch.py",
        "    if st is not None and not stat.S_ISLNK(st.st_mode):",
        "    if False:",
        ("tests/test_deploy_steps.py::test_switch_leaves_a_command_that_is_not_a_link_alone",),
    ),
    Mutation(
        "supervisor-trusts-settings-anyone-wrote",
        "deploy/paddock_deploy/supervisor.py",
        "            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:",
        "            if False:",
        (
            "tests/test_deploy_supervisor.py::test_supervisor_refuses_settings_others_could_have_written",
        ),
    ),
    Mutation(
        "mux-socket-of-another-user-trusted",
        "agent_side/mux/paths.py",
        '    if info.st_uid != uid:\n        raise MuxUnsafe(\n            f"{shown} belongs',
        '    if False:\n        raise MuxUnsafe(\n            f"{shown} belongs',
        ("tests/test_mux.py::test_mux_refuses_a_socket_owned_by_another_user",),
    ),
    Mutation(
        "mux-socket-open-to-others-trusted",
        "agent_side/mux/paths.py",
        '    if info.st_mode & 0o077:\n        raise MuxUnsafe(\n            f"{shown} is open',
        '    if False:\n        raise MuxUnsafe(\n            f"{shown} is open',
        ("tests/test_mux.py::test_mux_refuses_a_socket_open_to_others",),
    ),
    Mutation(
        "mux-server-of-another-uid-trusted",
        "agent_side/mux/paths.py",
        "    if theirs != uid:",
        "    if False:",
        ("tests/test_mux.py::test_mux_refuses_a_socket_served_by_another_user",),
    ),
    Mutation(
        "mux-directory-others-can-write-trusted",
        "agent_side/mux/paths.py",
        '    if info.st_mode & 0o077:\n        raise MuxUnsafe(\n            f"{path} is open',
        '    if False:\n        raise MuxUnsafe(\n            f"{path} is open',
        ("tests/test_mux.py -k test_mux_refuses_a_directory_others_could_write and mode",),
    ),
    Mutation(
        "mux-directory-of-another-user-trusted",
        "agent_side/mux/paths.py",
        '    if info.st_uid != uid:\n        raise MuxUnsafe(\n            f"{path} belongs',
        '    if False:\n        raise MuxUnsafe(\n            f"{path} belongs',
        ("tests/test_mux.py -k test_mux_refuses_a_directory_others_could_write and owner",),
    ),
    Mutation(
        "mux-daemon-serves-any-uid",
        "agent_side/mux/daemon.py",
        "            if peer_uid(sock) != os.getuid():",
        "            if False:",
        ("tests/test_mux.py::test_mux_daemon_serves_no_other_user",),
    ),
    Mutation(
        "mux-daemon-inherits-the-token",
        "agent_side/mux/client.py",
        '    env = {k: v for k, v in environ.items() if not k.startswith("PADDOCK_")}',
        "    env = dict(environ)",
        (
            "tests/test_mux.py::test_mux_keeps_the_token_out_of_its_command_line_environment_and_log",
        ),
    ),
)


def run(mutation: Mutation) -> bool:
    """True if the mutation turned its tests red (as it must)."""
    with tempfile.TemporaryDirectory(prefix=f"paddock-mut-{mutation.name}-") as tmp:
        copy = Path(tmp) / "tree"
        shutil.copytree(
            ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".*cache")
        )
        target = copy / mutation.file
        text = target.read_text()
        for old, new in ((mutation.old, mutation.new), *mutation.also):
            if old not in text:
                print(f"{mutation.name}: STALE (the code it mutates has changed)")
                return False
            text = text.replace(old, new, 1)
        target.write_text(text)
        failed = all(_red(copy, spec) for spec in mutation.tests)
    print(
        f"{mutation.name}: {'red as it must be' if failed else 'STILL GREEN - the test cannot fail'}"
    )
    return failed


def _red(tree: Path, spec: str) -> bool:
    path, _, expr = spec.partition(" -k ")
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path]
    if expr:
        argv += ["-k", expr]
    result = subprocess.run(argv, cwd=tree, capture_output=True, text=True, timeout=600)
    return result.returncode == 1


def main() -> int:
    chosen = [m for m in MUTATIONS if len(sys.argv) < 2 or m.name in sys.argv[1:]]
    results = [run(m) for m in chosen]
    print(f"{sum(results)}/{len(results)} mutations caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
