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
        "            resource.prlimit(pid, resource.RLIMIT_AS, (memory, memory))",
        "            pass",
        ("tests/test_limits.py::test_without_cgroups_memory_falls_back_to_a_per_process_rlimit",),
    ),
    Mutation(
        "state-root-not-locked",
        "target_side/service/state_lock.py",
        "            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "            pass",
        ("tests/test_state_lock.py",),
    ),
    Mutation(
        "torn-ledger-tail-left",
        "target_side/service/ledger.py",
        "        cut = cut_torn_tail(state_root)",
        "        cut = None",
        ("tests/test_ledger_recovery.py -k torn_last",),
    ),
    Mutation(
        "failed-ledger-append-not-cut-back",
        "target_side/service/ledger.py",
        "                    _cut_back(fd, before)",
        "                    pass",
        ("tests/test_ledger_recovery.py -k short_write",),
    ),
    Mutation(
        "failed-spool-append-not-cut-back",
        "target_side/service/spool.py",
        "                os.ftruncate(self._fd, self._size)",
        "                pass",
        ("tests/test_ledger_recovery.py -k short_write",),
    ),
    Mutation(
        "turns-admitted-on-a-full-disk",
        "target_side/service/turns.py",
        "        if self._disk_failure is not None:\n            raise self._disk_unavailable()",
        "        if False:\n            raise self._disk_unavailable()",
        ("tests/test_disk_full.py -k refuses_new_ones",),
    ),
    Mutation(
        "target-turn-cap-unchecked",
        "target_side/service/turns.py",
        "        if self._running >= cap:",
        "        if False:",
        ("tests/test_caps.py -k target_cap",),
    ),
    Mutation(
        "role-turn-cap-unchecked",
        "target_side/service/turns.py",
        "        if role_cap is not None and self._running_by_role[role] >= role_cap:",
        "        if False:",
        ("tests/test_caps.py -k role_cap",),
    ),
    Mutation(
        "turns-outside-the-bounded-parent",
        "target_side/fence/limits.py",
        "    return replace(hierarchy, turns=parent)",
        "    return hierarchy",
        ("tests/test_caps.py -k bounded_by",),
    ),
    Mutation(
        "connections-unbounded",
        "target_side/service/connections.py",
        "        self.limit = _within_descriptors(max_connections)",
        "        self.limit = 1 << 30",
        ("tests/test_connections.py -k flood",),
    ),
    Mutation(
        "no-request-deadline",
        "target_side/service/connections.py",
        "        entry.timer = loop.call_later(self.request_timeout_s, self._expire, fd, entry)",
        "        entry.timer = None",
        ("tests/test_connections.py -k not_finished_in_time or never_says_hello",),
    ),
    Mutation(
        "repeated-log-lines-not-collapsed",
        "target_side/service/log_repeats.py",
        "        if seen is not None and now - seen.since < self.interval_s:",
        "        if False:",
        ("tests/test_connections.py -k flood",),
    ),
    Mutation(
        "sigterm-without-grace",
        "target_side/service/server.py",
        "        await manager.stop(self._settings.server.stop_grace_s, hurry=lambda: self.force_exit)",
        "        pass",
        ("tests/test_graceful_stop.py",),
    ),
    Mutation(
        "turn-cgroups-left-behind",
        "target_side/fence/limits.py",
        "            if self._try_remove():",
        "            if True:",
        ("tests/test_limits.py::test_turn_cgroups_are_removed_when_turns_end",),
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
