#!/usr/bin/env python3
"""Show that each security test can fail: invert the rule it defends, expect red.

Each mutation is applied to a private copy of the tree (never the working
tree), the tests that defend the rule are run there, and the mutation passes
only if they FAIL. Run: ``.venv/bin/python scripts/mutation_check.py all`` (or NAME ...).

A mutation that lets a sandbox escape leaves it running after its tests, and
the tests of the next run (this one's or the suite's) would find it by its
marker and fail for it. So the checker takes in its descendants' orphans (a
child subreaper) and ends whatever is left after each test run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from target_side.fence import orphans

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    also: tuple[tuple[str, ...], ...] = ()
    """More replacements: ``(old, new)`` in the same file, or ``(file, old, new)`` in another
    (a rule held in two places is inverted in both)."""


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "forbidden-list-ignored",
        "target_side/policy/forbidden.py",
        "        if any(is_within(canonical, mine) for mine in self.own):\n            return None",
        "        return None",
        ("tests/test_fence.py -k forbidden_path or parent or symlink or state_root or sibling",),
    ),
    Mutation(
        "host-pid-namespace-signalled",
        "target_side/fence/pidns.py",
        "if pid_ns is None or pid_ns == pid_namespace(os.getpid()):",
        "if pid_ns is None:",
        ("tests/test_pidns.py::test_the_servers_own_pid_namespace_is_never_signalled_as_a_fence",),
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
        "target_side/policy/mounts.py",
        '        resolved = path if subject == "roles.home" else resolve(subject, path, self.walk)',
        '        resolved = path if subject == "roles.home" else posixpath.normpath(path)',
        ("tests/test_fence.py::test_fs_read_through_a_symlink_to_forbidden_path_is_refused",),
    ),
    Mutation(
        "workspace-unchecked",
        "target_side/policy/mounts.py",
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
        "target_side/fence/launch.py",
        '        "--uid",\n        str(plan.uid),\n',
        '        "--uid",\n        "0",\n',
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
        "target_side/policy/environment.py",
        "    env |= {name: server_env[name] for name in INHERITED_ENV if name in server_env}",
        "    env |= dict(server_env)",
        ("tests/test_fence.py::test_fence_env_is_the_allowlist",),
    ),
    Mutation(
        "bwrap-under-server-env",
        "target_side/fence/identity.py",
        "                env=BWRAP_ENV,\n",
        "                env={**os.environ, **BWRAP_ENV},\n",
        ("tests/test_fence.py::test_fence_env_hostile_server_env_never_arrives",),
    ),
    Mutation(
        "reserved-env-accepted",
        "target_side/policy/environment.py",
        '        if name.startswith("PADDOCK_"):',
        "        if False:",
        ("tests/test_fence.py::test_reserved_env_name_is_refused",),
    ),
    Mutation(
        "git-hooks-writable",
        "target_side/policy/plan.py",
        "    audit = protect_writable(planner, settings)\n",
        "    audit: dict[str, str | None] = {}\n",
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
        "ignored-signal-looked-for-backwards",
        "target_side/fence/signals.py",
        "    return _signal.SIG_IGN in map(_signal.getsignal, CATCHABLE)\n",
        "    return _signal.SIG_IGN not in map(_signal.getsignal, CATCHABLE)\n",
        ("tests/test_turns.py::test_turn_signal_works_even_if_the_server_ignores_it",),
    ),
    Mutation(
        "server-keeps-inherited-ignores",
        "target_side/service/server.py",
        "    kept = signals.stop_passing_on_inherited()\n",
        "    kept: list[int] = []\n",
        ("tests/test_host_edges.py -k signals_a_server_inherited",),
    ),
    Mutation(
        "launcher-keeps-inherited-ignores",
        "target_side/fence/launcher.py",
        "        signals.stop_passing_on_inherited()  # the turns it starts inherit none of them\n",
        "",
        ("tests/test_launcher.py -k ignoring_a_signal",),
    ),
    Mutation(
        "inherited-mask-handed-on",
        "target_side/fence/signals.py",
        "    signal.pthread_sigmask(signal.SIG_SETMASK, ())\n    return changed\n",
        "    return changed\n",
        ("tests/test_host_edges.py -k inherited_blocked",),
    ),
    Mutation(
        "inherited-blocked-signal-let-through",
        "target_side/fence/signals.py",
        "    if blocked and action == _signal.SIG_DFL and signum not in HARMLESS:\n        return _ignore\n",
        "",
        ("tests/test_host_edges.py -k inherited_blocked",),
    ),
    Mutation(
        "keyrings-reachable-from-a-fence",
        "target_side/fence/syscall_filter.py",
        "    *KEYRINGS,\n    *IO_URING,\n",
        "    *IO_URING,\n",
        ("tests/test_host_edges.py -k keyrings",),
    ),
    Mutation(
        "fence-reaches-the-hosts-abstract-sockets",
        "target_side/fence/nursery.py",
        "        self._settle()\n        _confine()\n",
        "        self._settle()\n",
        ("tests/test_host_edges.py -k abstract",),
    ),
    Mutation(
        "launcher-fence-reaches-the-hosts-abstract-sockets",
        "target_side/fence/launcher.py",
        "            landlock.confine_thread(program)  # the host's abstract sockets out of reach\n",
        "            pass\n",
        ("tests/test_launcher.py -k abstract",),
    ),
    Mutation(
        "landlock-domain-scopes-nothing",
        "target_side/fence/landlock.py",
        "    ruleset = _Ruleset(0, 0, SCOPE_ABSTRACT_UNIX_SOCKET)\n",
        "    ruleset = _Ruleset(0, 0, 0)\n",
        ("tests/test_host_edges.py -k abstract", "tests/test_launcher.py -k abstract"),
    ),
    Mutation(
        "io-uring-open-in-a-fence",
        "target_side/fence/syscall_filter.py",
        "    *IO_URING,\n    *KERNEL_ATTACK_SURFACE,\n",
        "    *KERNEL_ATTACK_SURFACE,\n",
        ("tests/test_seccomp.py -k io_uring",),
    ),
    Mutation(
        "every-socket-family-reaches-the-kernel",
        "target_side/fence/syscall_filter.py",
        '    _refuse_all_but(sc, rules, "socket", errno.EAFNOSUPPORT, 0, families)\n',
        "",
        ("tests/test_seccomp.py -k socket_families", "tests/test_host_edges.py -k families"),
    ),
    Mutation(
        "socket-pairs-of-every-family-reach-the-kernel",
        "target_side/fence/syscall_filter.py",
        '    _refuse_all_but(sc, rules, "socketpair", errno.EAFNOSUPPORT, 0, (socket.AF_UNIX,))\n',
        "",
        ("tests/test_seccomp.py -k socket_families",),
    ),
    Mutation(
        "socket-families-above-the-kept-reach-the-kernel",
        "target_side/fence/syscall_filter.py",
        "    rules.add_rule(action, call, *given, sc.Arg(arg, sc.GE, max(kept) + 1))\n",
        "",
        ("tests/test_seccomp.py -k socket_families",),
    ),
    Mutation(
        "every-inet-protocol-reaches-the-kernel",
        "target_side/fence/syscall_filter.py",
        "    (FAMILY_IS_INET, KEPT_INET_PROTOCOLS),\n",
        "",
        ("tests/test_seccomp.py -k protocols",),
    ),
    Mutation(
        "ipv6-protocols-reach-the-kernel",
        "target_side/fence/syscall_filter.py",
        "FAMILY_IS_INET = (ARGUMENT_BITS & ~(socket.AF_INET ^ socket.AF_INET6), socket.AF_INET)\n",
        "FAMILY_IS_INET = (ARGUMENT_BITS, socket.AF_INET)\n",
        ("tests/test_seccomp.py -k protocols",),
    ),
    Mutation(
        "every-netlink-protocol-reaches-the-kernel",
        "target_side/fence/syscall_filter.py",
        "    ((ARGUMENT_BITS, socket.AF_NETLINK), KEPT_NETLINK_PROTOCOLS),\n",
        "",
        ("tests/test_seccomp.py -k protocols",),
    ),
    Mutation(
        "generic-netlink-loads-modules-by-name",
        "target_side/fence/syscall_filter.py",
        "KEPT_NETLINK_PROTOCOLS = (0, 4, 9, 15)\n",
        "KEPT_NETLINK_PROTOCOLS = (0, 4, 9, 15, 16)\n",
        ("tests/test_seccomp.py -k protocols",),
    ),
    Mutation(
        "line-discipline-changeable-in-a-fence",
        "target_side/fence/syscall_filter.py",
        "REFUSED_IOCTLS = (TIOCSTI, TIOCLINUX, TIOCSETD)\n",
        "REFUSED_IOCTLS = (TIOCSTI, TIOCLINUX)\n",
        ("tests/test_seccomp.py -k discipline",),
    ),
    Mutation(
        "32-bit-calls-pass-the-filter",
        "target_side/fence/syscall_filter.py",
        "    rules.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)\n",
        "    rules.set_attr(sc.Attr.ACT_BADARCH, sc.ALLOW)\n",
        ("tests/test_seccomp.py -k 32_bit",),
    ),
    Mutation(
        "32-bit-call-ends-only-its-thread",
        "target_side/fence/syscall_filter.py",
        "    rules.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)\n",
        "    rules.set_attr(sc.Attr.ACT_BADARCH, sc.KILL)\n",
        ("tests/test_seccomp.py -k 32_bit",),
    ),
    Mutation(
        "sigsys-left-unexplained",
        "target_side/fence/runner.py",
        '            self._emit("notice", message=FOREIGN_ABI_NOTICE)\n',
        "            pass\n",
        ("tests/test_seccomp.py -k 32_bit",),
    ),
    Mutation(
        "aligned-run-grows-over-a-kept-value",
        "target_side/fence/syscall_filter.py",
        "            if any(value in kept for value in range(first + size, first + 2 * size)):\n                break\n",
        "",
        ("tests/test_seccomp.py -k aligned",),
    ),
    Mutation(
        "bpf-perf-and-userfaultfd-open-in-a-fence",
        "target_side/fence/syscall_filter.py",
        "    *KERNEL_ATTACK_SURFACE,\n    *KERNEL_LOG,\n",
        "    *KERNEL_LOG,\n",
        ("tests/test_seccomp.py -k bpf",),
    ),
    Mutation(
        "kernel-log-readable-from-a-fence",
        "target_side/fence/syscall_filter.py",
        "    *KERNEL_LOG,\n)\n",
        ")\n",
        ("tests/test_seccomp.py -k kernels_log",),
    ),
    Mutation(
        "launched-turns-unfiltered",
        "target_side/fence/launch.py",
        "            seccomp = syscall_filter.filter_fd(network=plan.network)\n",
        "            seccomp = None\n",
        ("tests/test_launcher.py -k system_call_filter",),
    ),
    Mutation(
        "embedded-target-hands-on-its-hosts-mask",
        "target_side/service/server.py",
        "        signal.pthread_sigmask(signal.SIG_SETMASK, ())\n        self._server.run(",
        "        self._server.run(",
        ("tests/test_cli_e2e.py -k blocked",),
    ),
    Mutation(
        "abstract-sockets-passed-as-ok-without-scopes",
        "target_side/tools/doctor.py",
        "    if abi >= landlock.SCOPED_ABI and not setuid:\n",
        "    if True:\n",
        ("tests/test_deploy.py -k abstract_sockets",),
    ),
    Mutation(
        "piped-core-pattern-passed-as-ok",
        "target_side/tools/doctor.py",
        '    if not pattern.startswith("|"):\n',
        "    if True:\n",
        ("tests/test_deploy.py -k crash_in_a_fence",),
    ),
    Mutation(
        "inherited-ignores-ignored-again",
        "target_side/fence/signals.py",
        "    if action == _signal.SIG_IGN:\n        return _ignore\n",
        "    if action == _signal.SIG_IGN:\n        return signal.SIG_IGN\n",
        ("tests/test_host_edges.py -k signals", "tests/test_launcher.py -k ignoring_a_signal"),
    ),
    Mutation(
        "unlinked-source-reported-as-backend-failure",
        "target_side/fence/launch.py",
        ' or "Can\'t find source path /proc/self/fd/" in last',
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
        "target_side/policy/mounts.py",
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
        "target_side/fence/nofollow.py",
        "                fd = os.open(name, HOLD_FLAGS, dir_fd=parent)",
        "                fd = os.open(name, HOLD_FLAGS & ~os.O_NOFOLLOW, dir_fd=parent)",
        (
            "tests/test_held_paths.py::test_mount_parent_swapped_for_symlink_before_open_is_path_changed",
        ),
    ),
    Mutation(
        "executable-trust-unchecked",
        "target_side/policy/executables.py",
        "    problem = trust.file_problem(st, uid)\n",
        "    problem = None\n",
        ("tests/test_held_paths.py -k shim_in_world_writable or someone_else or group_writable",),
        also=(
            ("    _check_directories(given, resolved, posixpath.dirname(resolved), uid)\n", ""),
            (
                '    _check_directories(given, resolved, resolve("argv[0]", posixpath.dirname(candidate)), uid)\n',
                "",
            ),
        ),
    ),
    Mutation(
        "seccomp-filter-skipped",
        "target_side/fence/launch.py",
        "        seccomp = syscall_filter.filter_fd(network=plan.network)\n",
        "        seccomp = None\n",
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
        "target_side/fence/gate.py",
        "                self._limits.place(pid)",
        "                pass",
        ("tests/test_nursery.py -k without_a_worker_is_placed or placed_after_it_started",),
    ),
    Mutation(
        # The fork-bomb test refuses to launch its bomb unless the pids limit is seen to hold.
        "pids-limit-dropped",
        "target_side/fence/limits.py",
        '\n        *([("pids.max", str(limits.pids + seats))] if "pids" in has else []),',
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
        "spool-output-left-to-the-closing-sync",
        "target_side/service/spool.py",
        "        if self._size - self._written_back >= WRITEBACK_BYTES:",
        "        if False:",
        ("tests/test_spool_writeback.py -k as_it_passes",),
    ),
    Mutation(
        "spool-early-writeback-failure-escapes",
        "target_side/service/spool.py",
        "        with contextlib.suppress(OSError, AttributeError):  # a head start: ``sync`` answers",
        "        with contextlib.suppress(AttributeError):",
        ("tests/test_spool_writeback.py -k still_syncs",),
    ),
    Mutation(
        "spool-output-kept-in-the-page-cache",
        "target_side/service/spool.py",
        "            start_writeback(self._fd, start, self._size - start)\n        self._uncache(self._uncached, start)",
        "            start_writeback(self._fd, start, self._size - start)",
        ("tests/test_spool_writeback.py -k leaves_the_page_cache_as_more_comes",),
    ),
    Mutation(
        "synced-spool-kept-in-the-page-cache",
        "target_side/service/spool.py",
        "        if self._size > CACHED_AFTER_SYNC:",
        "        if False:",
        ("tests/test_spool_writeback.py -k leaves_the_page_cache_whole",),
    ),
    Mutation(
        "turns-admitted-on-a-full-disk",
        "target_side/service/turns.py",
        "        if self._disk_failure is not None or self._disk_low is not None:",
        "        if False:",
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
        "        entry.timer = loop.call_later(self.request_timeout_s, self._expire, entry)",
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
        "            if await asyncio.to_thread(self._removed_after, slot):",
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
        "cursor-recorded-before-delivery",
        "agent_side/streaming.py",
        "        self.show(event)\n        if self.cursor is not None and not self.pipe_broken:\n            self.cursor.delivered(event.seq)",
        "        if self.cursor is not None:\n            self.cursor.delivered(event.seq)\n        self.show(event)",
        (
            "tests/test_cursors.py::test_logs_follow_into_a_closed_pipe_records_nothing_it_could_not_write",
        ),
    ),
    Mutation(
        "cursor-not-resumed",
        "agent_side/commands.py",
        "    after = 0 if args.from_start else store.last_delivered(turn_id)",
        "    after = 0",
        ("tests/test_cursors.py -k killed_logs_follow",),
    ),
    Mutation(
        "user-files-not-private",
        "agent_side/user_files.py",
        "    path.mkdir(mode=0o700, parents=True, exist_ok=True)\n    if path.stat().st_mode & 0o077:",
        "    path.mkdir(mode=0o755, parents=True, exist_ok=True)\n    if False:",
        ("tests/test_cursors.py::test_cursor_store_is_private_and_written_whole",),
    ),
    Mutation(
        "status-health-poll-clears-auth",
        "agent_side/status.py",
        "        if cleared not in seen.failures:\n            causes.pop(cleared, None)",
        '        if cleared not in seen.failures:\n            causes.pop(cleared, None)\n            causes.pop("auth", None)',
        ("tests/test_status.py -k never_clears_auth or wrong_token",),
    ),
    Mutation(
        "status-cause-start-rewritten",
        "agent_side/status.py",
        "        since = causes[cause].since if cause in causes else at",
        "        since = at",
        ("tests/test_status.py -k keeps_the_time or wrong_token",),
    ),
    Mutation(
        "k8s-privilege-escalation",
        "deploy/kubernetes/daemonset.yaml",
        "            allowPrivilegeEscalation: false # no_new_privs",
        "            allowPrivilegeEscalation: true # no_new_privs",
        ("tests/test_kubernetes.py -k privileged",),
    ),
    Mutation(
        "k8s-init-adds-sys-admin",
        "deploy/kubernetes/deployment.yaml",
        '              add: ["CHOWN", "FOWNER", "DAC_OVERRIDE"]',
        '              add: ["CHOWN", "FOWNER", "DAC_OVERRIDE", "SYS_ADMIN"]',
        ("tests/test_kubernetes.py -k init_adds_back",),
    ),
    Mutation(
        "k8s-server-as-root",
        "deploy/kubernetes/deployment.yaml",
        "            runAsUser: 10001\n            runAsGroup: 10001\n            runAsNonRoot: true\n            allowPrivilegeEscalation: false # no_new_privs",
        "            runAsUser: 0\n            runAsGroup: 10001\n            runAsNonRoot: false\n            allowPrivilegeEscalation: false # no_new_privs",
        ("tests/test_kubernetes.py -k images_own_user",),
    ),
    Mutation(
        "k8s-config-misspelt-key",
        "deploy/kubernetes/configmap.yaml",
        '    identity = "server"',
        '    identity_mode = "server"',
        ("tests/test_kubernetes.py -k config_loads",),
    ),
    Mutation(
        "token-as-optional-header",
        "target_side/service/app.py",
        "        request: Request, _scheme: Annotated[object, Security(BEARER)]\n",
        "        request: Request, authorization: Annotated[str | None, Header()] = None\n",
        ("tests/test_openapi.py -k bearer or header_parameter",),
    ),
    Mutation(
        "submit-for-any-role",
        "target_side/service/app.py",
        "        require_role(roles, request.role)\n        if request.session is not None:\n",
        "        if request.session is not None:\n",
        ("tests/test_api.py -k 403",),
    ),
    Mutation(
        "turn-body-any-content-type",
        "target_side/service/app.py",
        '    if not media_type.startswith("application/") or not media_type.endswith(("/json", "+json")):\n',
        "    if False:\n",
        ("tests/test_api.py -k content_type",),
    ),
    Mutation(
        "submit-security-unsaid",
        "target_side/service/app.py",
        '"requestBody": TURN_REQUEST_BODY, "security": BEARER_ONLY}',
        '"requestBody": TURN_REQUEST_BODY}',
        ("tests/test_openapi.py",),
    ),
    Mutation(
        "submit-body-unsaid",
        "target_side/service/app.py",
        '"requestBody": TURN_REQUEST_BODY, "security": BEARER_ONLY}',
        '"security": BEARER_ONLY}',
        ("tests/test_openapi.py -k turn_body",),
    ),
    Mutation(
        "405-without-allow",
        "target_side/service/app.py",
        '            response.headers["Allow"] = _allowed_methods(request)\n',
        "            pass\n",
        ("tests/test_openapi.py -k 405",),
    ),
    Mutation(
        "errors-as-plain-json",
        "target_side/service/openapi.py",
        '                        content[PROBLEM_JSON] = content.pop("application/json")',
        "                        pass",
        ("tests/test_openapi.py -k problem",),
    ),
    Mutation(
        "one-program-rule-unstated",
        "shared/wire.py",
        "    model_config = ConfigDict(json_schema_extra=_ONE_PROGRAM | _SESSION_TURN)\n",
        "    model_config = ConfigDict(json_schema_extra=_SESSION_TURN)\n",
        ("tests/test_openapi.py -k decides_as_the_model or one_program",),
    ),
    Mutation(
        "docs-from-a-cdn",
        "target_side/service/app.py",
        "    app = FastAPIOffline(\n",
        "    app = FastAPI(\n",
        ("tests/test_openapi.py -k docs_page",),
    ),
    Mutation(
        "nagle-on-accepted-connections",
        "target_side/service/connections.py",
        "        super().__init__(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)",
        "        super().__init__(family, socket.SOCK_STREAM)",
        ("tests/test_connections.py -k without_delay",),
    ),
    Mutation(
        "ledger-head-replaced-per-record",
        "target_side/service/ledger.py",
        "                self._head.write(count, last)",
        "                write_atomic(self.head_path, _head_bytes(count, last))",
        ("tests/test_ledger_recovery.py -k in_place",),
    ),
    Mutation(
        "ledger-head-read-after-the-chain",
        "target_side/service/ledger.py",
        "    head_count, head_hash = _read_head(head_path)\n    torn = _torn_start(path)",
        "    torn = _torn_start(path)",
        ("tests/test_ledger_recovery.py -k appended_while_verify",),
        also=(
            (
                "    torn_bytes = 0 if torn is None else path.stat().st_size - torn\n",
                "    torn_bytes = 0 if torn is None else path.stat().st_size - torn\n"
                "    head_count, head_hash = _read_head(head_path)\n",
            ),
        ),
    ),
)

# --- issue 12: a turn's first process born inside its cgroups ----------------------------------
MUTATIONS += (
    Mutation(
        "server-killed-as-a-turns-straggler",
        "target_side/fence/limits.py",
        "    return [pid for pid in listed if pid != os.getpid()]",
        "    return listed",
        ("tests/test_nursery.py::test_killing_a_turns_cgroup_never_kills_the_server_listed_in_it",),
    ),
    Mutation(
        "turn-born-outside-its-cgroups",
        "target_side/fence/nursery.py",
        '                write_control(slot / "tasks", "0\\n")',
        "                pass",
        ("tests/test_limits.py::test_pids_limit_is_exactly_the_turns_own",),
    ),
    Mutation(
        "fence-born-inside-still-waits-at-a-gate",
        "target_side/fence/launch.py",
        "        block_read, block_write = (-1, -1) if limits.born_inside else _pipe(opened)",
        "        block_read, block_write = _pipe(opened)",
        ("tests/test_nursery.py -k without_waiting_to_be_held",),
    ),
    Mutation(
        "ungated-sandbox-held-by-its-pid-alone",
        "target_side/fence/gate.py",
        "        if self._block < 0 and parent_of(pid) != process.pid:",
        "        if False:",
        ("tests/test_nursery.py -k only_bubblewraps_own_child",),
    ),
    Mutation(
        "gate-opened-before-the-turn-is-placed",
        "target_side/fence/gate.py",
        "            if self._limits is not None:\n                self._limits.place(pid)",
        '            os.write(self._block, b"\\0")\n'
        "            if self._limits is not None:\n                self._limits.place(pid)",
        ("tests/test_nursery.py -k placed_after_it_started",),
    ),
    Mutation(
        "gate-opened-when-the-limits-failed",
        "target_side/fence/gate.py",
        "            with contextlib.suppress(OSError):\n"
        "                signal.pidfd_send_signal(reaper, signal.SIGKILL)\n"
        "            with contextlib.suppress(OSError):\n"
        "                process.send_signal(signal.SIGKILL)\n",
        '            os.write(self._block, b"\\0")\n',
        ("tests/test_nursery.py -k cannot_be_applied or limits_fail",),
    ),
    Mutation(
        "wall-time-counted-from-when-the-loop-got-there",
        "target_side/fence/runner.py",
        "            left = self._started_at + self._wall_s - time.monotonic()",
        "            left = self._wall_s",
        ("tests/test_nursery.py -k wall_time_limit_counts",),
    ),
    Mutation(
        "started-at-when-the-loop-got-there",
        "target_side/service/turns.py",
        "started_at=_on_the_clock(running.started_at)",
        "started_at=now()",
        ("tests/test_durability.py -k started_at_is_bubblewraps",),
    ),
    Mutation(
        "streamed-turn-resumed-from-its-start",
        "agent_side/client.py",
        "        yield from self.follow(turn_id, after=cursor)",
        "        yield from self.follow(turn_id, after=0)",
        ("tests/test_resume.py -k one_request",),
    ),
    Mutation(
        "streamed-submission-retried-without-its-key",
        "agent_side/client.py",
        '            "Idempotency-Key": idempotency_key,\n',
        "",
        ("tests/test_client.py -k streamed_submission_is_retried",),
    ),
    Mutation(
        "turn-answered-alone-read-outside-the-retry",
        "agent_side/client.py",
        "            if not response.is_success or _media_type(response) != FRAMES_MEDIA_TYPE:\n",
        "            if not response.is_success:\n",
        ("tests/test_client.py -k cut_short",),
    ),
    Mutation(
        "httpx-command-line-loaded",
        "agent_side/cli.py",
        '    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]\n',
        "    pass\n",
        ("tests/test_cli_imports.py -k executable",),
    ),
    Mutation(
        "nursery-shrinks-on-a-failed-launch",
        "target_side/fence/nursery.py",
        "                self._loop.call_soon_threadsafe(self.spawned.cancel)\n",
        "                pass\n",
        ("tests/test_nursery.py -k leaves_the_nursery",),
    ),
    Mutation(
        "planned-cgroups-left-when-the-launch-never-comes",
        "target_side/service/turns.py",
        "        except BaseException:\n            planned.drop()\n            raise\n",
        "        except BaseException:\n            raise\n",
        ("tests/test_nursery.py -k leave_none_behind",),
        # The same rule where the planning thread starts the turn itself.
        also=(
            (
                "        except RefusedError:\n            planned.drop()\n            raise\n",
                "        except RefusedError:\n            raise\n",
            ),
        ),
    ),
    Mutation(
        "log-queue-unbounded",
        "target_side/service/log_writer.py",
        "        self.queue: queue.Queue[Line | None] = queue.Queue(HELD_RECORDS)\n",
        "        self.queue: queue.Queue[Line | None] = queue.Queue()\n",
        ("tests/test_log_writer.py -k stops_reading",),
    ),
    Mutation(
        "corked-close-drops-what-is-held",
        "target_side/service/corked.py",
        "    def close(self) -> None:\n        self.flush()\n",
        "    def close(self) -> None:\n        self._held, self._size = [], 0\n",
        ("tests/test_corked.py",),
    ),
    Mutation(
        "cli-parser-for-one-command-without-its-options",
        "agent_side/cli.py",
        "        if command is None or chosen:\n",
        "        if command is None:\n",
        ("tests/test_cli.py -k knows_every",),
    ),
    Mutation(
        "server-on-whatever-loop-is-installed",
        "target_side/service/server.py",
        '        loop="asyncio",\n',
        "",
        ("tests/test_connections.py -k uvloop",),
    ),
    Mutation(
        "home-failure-on-the-planning-thread-as-a-crash",
        "target_side/service/turns.py",
        "        except TargetError as exc:\n"
        "            raise RefusedError(refusals.backend_unavailable(str(exc))) from exc\n"
        "\n"
        "    async def _launch(",
        "        except TargetError:\n            raise\n\n    async def _launch(",
        (
            "tests/test_host_edges.py::test_a_home_the_server_cannot_make_refuses_the_turn_and_says_why",
        ),
    ),
    Mutation(
        # The audit first, the turn after it: what the turn then makes is never looked at.
        "audit-while-the-turn-still-runs",
        "target_side/service/turns.py",
        "        try:\n            outcome = await running.wait()\n",
        "        here = self.identity.audit_here(\n"
        "            plan.role, (plan.uid, plan.gid), plan.audit, plan.turn_id\n"
        "        )\n"
        "        early = await asyncio.to_thread(here) if here is not None else []\n"
        "        try:\n"
        "            outcome = await running.wait()\n",
        (
            "tests/test_host_edges.py::"
            "test_a_protected_name_made_in_a_turns_last_moment_is_moved_aside",
        ),
        (("        moved = _audited(audit, record.turn.turn_id)\n", "        moved = []\n"),),
    ),
    Mutation(
        "worker-takes-a-turns-pid",
        "target_side/fence/limits.py",
        "        seats = self.slot.seats if self.slot is not None else 0",
        "        seats = 0",
        ("tests/test_limits.py::test_pids_limit_is_exactly_the_turns_own",),
    ),
)

# --- issue 12: the ledger line as a turn's commit point -----------------------------------------
MUTATIONS += (
    Mutation(
        "record-believed-over-the-ledgers-end",
        "target_side/service/turns.py",
        '            if known is not None and known.kind == "end" and not item.turn.finished:',
        "            if False:",
        ("tests/test_ledger_recovery.py -k missed_its_end",),
    ),
    Mutation(
        "retry-key-kept-only-in-the-record",
        "target_side/service/turns.py",
        '    return {"idempotency": key} if key else {}',
        "    return {}",
        (
            "tests/test_ledger_recovery.py -k ended_turn_leaves",
            "tests/test_sessions.py -k killed_is_lost",
        ),
    ),
    Mutation(
        "ended-turn-taken-back-as-a-recovery",
        "target_side/service/turns.py",
        '        if isinstance(item, Unrecorded) and known is not None and known.kind == "end":',
        "        if False:",
        ("tests/test_ledger_recovery.py -k ended_turn_leaves",),
    ),
    Mutation(
        "turn-cut-from-the-ledger-not-rebuilt-from-its-spool",
        "target_side/service/turns.py",
        "        elif (ended := _turn_of(await spool.terminal())) is not None:",
        "        elif False:",
        ("tests/test_ledger_recovery.py -k mismatch_in_the_middle",),
    ),
    Mutation(
        "interrupted-turn-ended-without-what-its-last-event-says",
        "target_side/service/turns.py",
        "        ended = _turn_of(terminal)\n        if ended is not None:",
        "        ended = _turn_of(terminal)\n        if False:",
        ("tests/test_ledger_recovery.py -k mismatch_in_the_middle",),
    ),
    Mutation(
        "end-recorded-before-the-output-is-on-disk",
        "target_side/service/turns.py",
        '        await self._ledger_append("end", turn=end.turn, before=record.spool.sync, **end.facts)',
        '        await self._ledger_append("end", turn=end.turn, **end.facts)',
        ("tests/test_durability.py -k output_is_on_disk",),
    ),
    Mutation(
        "forbidden-quick-check-misses-what-lies-below-an-entry",
        "target_side/policy/forbidden.py",
        "        return any(above in self._paths for above in _ancestors(canonical))",
        "        return False",
        ("tests/test_walk_cache.py -k each_entry_asked_in_turn",),
    ),
    Mutation(
        "forbidden-quick-check-misses-what-holds-an-entry",
        "target_side/policy/forbidden.py",
        " or canonical in self._above:",
        ":",
        ("tests/test_walk_cache.py -k each_entry_asked_in_turn",),
    ),
    Mutation(
        "request-writes-sent-one-by-one",
        "agent_side/pool_transport.py",
        "        if self._size >= HELD_BYTES:\n            self._send()",
        "        self._send()",
        ("tests/test_pool_transport.py -k head_and_body",),
    ),
    Mutation(
        "request-writes-held-unbounded",
        "agent_side/pool_transport.py",
        "        if self._size >= HELD_BYTES:",
        "        if False:",
        ("tests/test_pool_transport.py -k bigger_than",),
    ),
    Mutation(
        "tls-records-read-one-a-trip",
        "agent_side/pool_transport.py",
        "        if self._records is None or not data or len(data) >= max_bytes:",
        "        if True:",
        ("tests/test_pool_transport.py -k read_together",),
    ),
    Mutation(
        "tls-read-waits-for-records-not-sent",
        "agent_side/pool_transport.py",
        "        while size < max_bytes and self._records.ready():",
        "        while size < max_bytes:",
        ("tests/test_pool_transport.py -k never_waits",),
    ),
    Mutation(
        "frame-decoder-keeps-the-last-payload",
        "shared/frames.py",
        "            self._frame, self._parts, self._got = None, [], 0",
        "            self._frame, self._got = None, 0",
        ("tests/test_frames.py -k decoder",),
    ),
    Mutation(
        "frame-decoder-drops-a-split-header",
        "shared/frames.py",
        "        if not self._head and len(view) - position >= HEADER.size:",
        "        if len(view) - position >= HEADER.size:",
        ("tests/test_frames.py -k decoder",),
    ),
    Mutation(
        "frame-decoder-forgets-a-torn-header",
        "shared/frames.py",
        "        return len(self._head) + (HEADER.size",
        "        return (HEADER.size",
        ("tests/test_frames.py -k decoder",),
    ),
    Mutation(
        "turns-planned-on-the-blocking-pool",
        "target_side/service/turns.py",
        "                self._planning, self._make_and_plan, record",
        "                None, self._make_and_plan, record",
        ("tests/test_planning.py",),
    ),
    Mutation(
        "direct-client-pool-unbounded",
        "agent_side/pool_transport.py",
        "        self.limits = limits or DEFAULT_LIMITS",
        "        self.limits = limits or httpx.Limits()",
        ("tests/test_pool_transport.py -k connection_limits",),
    ),
    Mutation(
        "held-request-write-failure-hides-the-answer",
        "agent_side/pool_transport.py",
        "            with contextlib.suppress(httpcore.WriteError):\n                self._send()",
        "            self._send()",
        ("tests/test_pool_transport.py -k would_not_take",),
    ),
    Mutation(
        "log-lines-to-every-loggers-handlers",
        "target_side/service/log_writer.py",
        "            handoff = _Handoff(lines, handlers)\n",
        "            handoff = _Handoff(lines, [*handlers, *(h for _, o in self._moved for h in o.handlers)])\n",
        ("tests/test_log_writer.py -k one_thread",),
    ),
    Mutation(
        "log-writer-woken-at-once",
        "target_side/service/log_writer.py",
        "        if self._idle:\n            time.sleep(SETTLE_S)\n",
        "",
        ("tests/test_log_writer.py -k moment_that_woke_it",),
    ),
    Mutation(
        "ledger-appends-from-threads-not-grouped",
        "target_side/service/ledger.py",
        "                batch = self._take_queued()\n",
        "                batch = [entry]\n"
        "                with self._queue_lock:\n"
        "                    self._queued.remove(entry)\n",
        ("tests/test_ledger_recovery.py -k many_threads",),
    ),
    Mutation(
        "end-recorded-on-the-audits-thread-before-the-output-is-on-disk",
        "target_side/service/turns.py",
        '            "end", turn=end.turn, before=record.spool.sync, **end.facts',
        '            "end", turn=end.turn, **end.facts',
        ("tests/test_durability.py -k output_is_on_disk",),
    ),
)

# --- issue 9: the host side of a turn ---------------------------------------------------------
HOST_EDGES = "tests/test_host_edges.py"
MUTATIONS += (
    Mutation(
        "bwrap-under-the-turns-env",
        "target_side/fence/launch.py",
        "        *prefix,\n",
        '        *prefix,\n        "/usr/bin/env",\n        *(f"{k}={v}" for k, v in plan.env.items()),\n',
        (f"{HOST_EDGES} -k env_loader_variables or bwraps_command_line",),
    ),
    Mutation(
        "options-on-bwraps-command-line",
        "target_side/fence/launch.py",
        '        "--args",\n        str(fds.args),\n',
        "        *bwrap_options(plan, fds),\n",
        (f"{HOST_EDGES}::test_env_values_are_not_on_bwraps_command_line_nor_in_its_environment",),
    ),
    Mutation(
        "turns-run-as-the-server",
        "target_side/policy/plan.py",
        "    return uid, gid\n",
        "    return os.getuid(), os.getgid()\n",
        (f"{HOST_EDGES} -k identity",),
    ),
    Mutation(
        "supplementary-groups-kept",
        "target_side/fence/identity.py",
        '        "--clear-groups",\n',
        '        "--keep-groups",\n',
        (f"{HOST_EDGES} -k belong_to_its_role and setpriv",),
        also=(("extra_groups=[] if switch else None", "extra_groups=None"),),
    ),
    Mutation(
        "git-dir-not-a-mount-point",
        "target_side/policy/plan.py",
        '        planner.mounts.append(Mount("rw", git_dir, git_dir, "fence.git", *identity(git_dir)))',
        "        pass",
        (f"{HOST_EDGES}::test_git_dir_cannot_be_renamed_away_and_replaced",),
    ),
    Mutation(
        "git-members-writable",
        "target_side/policy/protect.py",
        "            found.read_only.append(inner)",
        "            pass",
        (f"{HOST_EDGES} -k below_the_mount_root or worktrees_submodules",),
    ),
    Mutation(
        # A prepared launch's connection is not the one its turn is launched on: the fence,
        # without a gate, would run outside its cgroups; refused instead, so the test sees it.
        "prepared-launch-left-unused",
        "target_side/fence/launcher_client.py",
        "            if isinstance(prepared, PreparedLaunch):\n",
        "            if False:\n",
        ("tests/test_launcher.py -k places_the_fence",),
    ),
    Mutation(
        # A launcher that cannot prepare: the slots made for it stay behind, and the server
        # keeps offering launches that were never prepared.
        "refused-preparation-taken-for-ready",
        "target_side/fence/launcher_client.py",
        "        launch.ready.set_result(False)\n",
        "        launch.ready.set_result(True)\n",
        ("tests/test_launcher.py -k prepares_launches_as_before",),
    ),
    Mutation(
        # The launcher vouches for every turn's protected names as it reaps it.
        "launcher-reaps-and-calls-everything-clean",
        "target_side/fence/launcher.py",
        '            ended["clean"] = not audit.deviations(child.expected)\n',
        '            ended["clean"] = True\n',
        ("tests/test_launcher.py -k plants_a_protected_name",),
    ),
    Mutation(
        # A prepared child that dies while it waits goes unnoticed: the server takes it.
        "prepared-child-death-unnoticed",
        "target_side/fence/launcher.py",
        "        asyncio.get_running_loop().add_reader(self.prepared.pidfd, self._prepared_ended)\n",
        "        pass\n",
        ("tests/test_launcher.py -k lost_while_idle",),
    ),
    Mutation(
        # A connection whose prepared child died launches unprepared: a fence without a gate,
        # outside the cgroups it was planned in.
        "lost-preparation-launched-unprepared",
        "target_side/fence/launcher.py",
        "        elif self.was_prepared:\n",
        "        elif False:\n",
        ("tests/test_launcher.py -k prepared_child_died",),
    ),
    Mutation(
        # The launcher forks a prepared process into any cgroup it is named.
        "launcher-prepares-in-any-cgroup",
        "target_side/fence/launcher.py",
        '        checked = self._turn_cgroups(message.get("cgroups"))\n',
        '        checked = [os.open(c, os.O_PATH) for c in message.get("cgroups", [])]\n',
        ("tests/test_launcher.py -k prepared_process",),
    ),
    Mutation(
        # A prepared process the server no longer wants is left waiting, as root.
        "prepared-process-outlives-its-connection",
        "target_side/fence/launcher.py",
        "            self.prepared.discard()\n",
        "            pass\n",
        ("tests/test_launcher.py -k prepared_process",),
    ),
    Mutation(
        # bubblewrap's outer process, born in the turn's cgroup, counted as one of the turn's.
        "prepared-launch-takes-a-pid-of-the-turns",
        "target_side/fence/launcher_client.py",
        "        return 1 if self.dirs else 0",
        "        return 0",
        ("tests/test_launcher.py -k exactly_its_pids",),
    ),
    Mutation(
        # The server's look at a role's home opens it to read: a 0700 home is never seen ready.
        "home-look-needs-read-permission",
        "target_side/fence/home.py",
        "LOOK_FLAGS = os.O_PATH | os.O_DIRECTORY",
        "LOOK_FLAGS = os.O_RDONLY | os.O_DIRECTORY",
        ("tests/test_launcher.py -k home_as_it_should_be",),
    ),
    Mutation(
        # The server takes any home for ready: one a turn left with a wrong mode stays so.
        "server-takes-any-home-for-ready",
        "target_side/fence/home.py",
        "    owner = owner if owner is not None else (os.getuid(), os.getgid())\n",
        "    return True\n",
        ("tests/test_launcher.py -k roles_home_as_root_would",),
    ),
    Mutation(
        # The launcher's look as root finds nothing: it answers clean without the role's child.
        "launcher-audit-looks-and-sees-nothing",
        "target_side/fence/audit.py",
        "        found += _in_directory(parent_path, entries, _named)",
        "        found += []",
        (
            "tests/test_audit.py",
            "tests/test_launcher.py -k audit",
        ),
    ),
    Mutation(
        "protected-names-audit-skipped",
        "target_side/service/turns.py",
        "fence.role, (fence.uid, fence.gid), fence.audit, fence.turn_id",
        "fence.role, (fence.uid, fence.gid), {}, fence.turn_id",
        (
            f"{HOST_EDGES} -k redirection_created or hooks_missing or new_ones_at_the_top or symlink_repointed",
        ),
        also=(
            (
                "fence.role, (fence.uid, fence.gid), fence.audit, fence.turn_id",
                "fence.role, (fence.uid, fence.gid), {}, fence.turn_id",
            ),
        ),
    ),
    Mutation(
        "protect-scan-stays-at-the-top",
        "target_side/policy/protect.py",
        "        pending.extend(\n",
        "        (\n",
        (f"{HOST_EDGES} -k below_the_mount_root or new_ones_at_the_top",),
    ),
    Mutation(
        # Closed to the role for good, yet scanned: bubblewrap, as the role, cannot mount over
        # what is in there, and every turn of the workspace is refused.
        "closed-directory-scanned",
        "target_side/policy/reach.py",
        "        return Door.SHUT if st.st_uid == self.uid else Door.CLOSED",
        "        return Door.OPEN",
        (f"{HOST_EDGES} -k where_the_role_can_never_go",),
    ),
    Mutation(
        # The role's own directory, closed by its mode alone, taken for closed for good: the
        # turn opens it and writes a hook nothing protected.
        "shut-directory-taken-for-closed",
        "target_side/policy/reach.py",
        "        return Door.SHUT if st.st_uid == self.uid else Door.CLOSED",
        "        return Door.CLOSED",
        (f"{HOST_EDGES} -k could_open_but_may_not_search and above_the_repository",),
    ),
    Mutation(
        # A .git of the role's own, closed by its mode: its members left out of the scan, as
        # if the turn could never reach them; it opens it and writes a hook.
        "shut-git-dir-members-left-out",
        "target_side/policy/protect.py",
        "doors.of(git.path) is Door.CLOSED",
        "doors.of(git.path) is not Door.OPEN",
        (f"{HOST_EDGES} -k could_open_but_may_not_search and its_git_directory",),
    ),
    Mutation(
        # A server running as the turn cannot list what is closed to it: that is no reason to
        # refuse (the turn cannot go there either).
        "closed-directory-refused-when-unlistable",
        "target_side/policy/protect.py",
        "            if doors.closed_at_or_above(directory):\n",
        "            if False:\n",
        ("tests/test_local.py",),
    ),
    Mutation(
        "acl-ignored-by-the-scan",
        "target_side/policy/reach.py",
        "        if self.may_search(st) or _has_acl(path):",
        "        if self.may_search(st):",
        (f"{HOST_EDGES} -k an_acl_opens",),
    ),
    Mutation(
        "closed-git-dir-left-movable",
        "target_side/policy/protect.py",
        "    found.git_dirs.append(path)\n    if not reachable:\n        return\n",
        "    if not reachable:\n        return\n    found.git_dirs.append(path)\n",
        (f"{HOST_EDGES} -k can_never_enter_still_cannot_be_moved",),
    ),
    Mutation(
        # A key listed plainly and marked @revoked: trusted anyway.
        "revoked-host-key-trusted",
        "agent_side/known_hosts.py",
        "            if self.revoked_by(entry.key) is not None:\n                continue\n",
        "            if False:\n                continue\n",
        (
            "tests/test_ssh.py -k revoked_host_key and its_own_key",
            "tests/test_ssh_units.py -k revoked",
        ),
    ),
    Mutation(
        # "*.example.org,!bad.example.org": bad.example.org trusted all the same.
        "known-hosts-negation-ignored",
        "agent_side/known_hosts.py",
        "            if negated:\n                return False\n",
        "            if False:\n                return False\n",
        ("tests/test_ssh_units.py -k patterns_match",),
    ),
    Mutation(
        # An @revoked line read as one more key to trust.
        "revoked-line-taken-for-a-known-key",
        "agent_side/known_hosts.py",
        "        if marker == REVOKED:\n",
        "        if False:\n",
        (
            "tests/test_ssh.py -k revoked_host_key and its_own_key",
            "tests/test_ssh_units.py -k revoked",
        ),
    ),
    Mutation(
        # cgroup v1 kills one process at the memory limit; the turn's shell carries on.
        "oom-ends-one-process-under-v1",
        "target_side/fence/runner.py",
        "        if limits is not None and limits.oom_alarm is not None:\n            # An OOM",
        "        if False:\n            # An OOM",
        ("tests/test_limits.py -k oom_kill_ends_the_whole_turn",),
    ),
    Mutation(
        # A caller cancelled mid-start left the fence running unwatched and the turn unended.
        "cancelled-submit-abandons-its-turn",
        "target_side/service/turns.py",
        "        return await asyncio.shield(task)",
        "        return await task",
        ("tests/test_cancelled_start.py -k cancelled_is_followed",),
    ),
    Mutation(
        "stopping-target-leaves-starting-turns-behind",
        "target_side/service/turns.py",
        "            await asyncio.wait(set(self._starting), timeout=KILL_WAIT_S)",
        "            pass",
        ("tests/test_cancelled_start.py -k target_stops",),
    ),
    Mutation(
        "cancelled-session-create-abandons-its-session",
        "target_side/service/sessions.py",
        "        return await self.turns.started_whoever_waits(self._start(record, request))",
        "        return await self._start(record, request)",
        ("tests/test_cancelled_start.py -k session_whose_create_was_cancelled",),
    ),
    Mutation(
        # bubblewrap's child, killed before it asked for its parent-death signal, ran on.
        "kill-before-the-fence-is-held-spares-its-cgroups",
        "target_side/fence/runner.py",
        "        if self._gate.limits is not None:\n            self._gate.limits.kill()",
        "        if False:\n            self._gate.limits.kill()",
        ("tests/test_cancelled_start.py -k killed_as_it_starts",),
    ),
    Mutation(
        # A sandbox at its gate, its bubblewrap killed before it was held, ran on unseen.
        "kill-at-the-gate-kills-bubblewrap-alone",
        "target_side/fence/gate.py",
        "            if self._decided:\n                return False",
        "            if True:\n                return False",
        (
            "tests/test_orphans.py -k killed_at_its_gate",
            "tests/test_cancelled_start.py -k killed_as_it_starts",
        ),
    ),
    Mutation(
        # The cursor closed before the client confirmed the last event: logs --follow repeats it.
        "relay-closes-the-cursor-before-the-last-confirmation",
        "agent_side/mux/relay.py",
        "            sink.cursor.wait_for(output.last_seq, CONFIRM_WAIT_S)",
        "            pass",
        ("tests/test_mux.py -k however_late_the_client_confirms",),
    ),
    Mutation(
        # The watch shuts the gate as soon as it read no line: the orphan goes on to its command.
        "unnamed-sandbox-let-through-its-gate",
        "target_side/fence/gate.py",
        "            if self._named:\n                _close(self._block)",
        "            if True:\n                _close(self._block)",
        ("tests/test_orphans.py -k never_saw_its_sandbox",),
    ),
    Mutation(
        "orphaned-sandbox-left-alive",
        "target_side/fence/gate.py",
        "                orphans.end_orphaned_sandboxes()",
        "                pass",
        ("tests/test_orphans.py -k never_saw_its_sandbox",),
        also=(
            (
                "target_side/fence/launcher.py",
                "            orphans.end_orphaned_sandboxes()",
                "            pass",
            ),
        ),
    ),
    Mutation(
        "launcher-leaves-its-orphaned-sandbox",
        "target_side/fence/launcher.py",
        "            orphans.end_orphaned_sandboxes()",
        "            pass",
        ("tests/test_launcher.py -k killed_before_it_was_held",),
    ),
    Mutation(
        # Every child killed, bubblewrap and helpers too, not only sandboxes in a namespace below.
        "orphan-hunt-kills-bystanders",
        "target_side/fence/orphans.py",
        "    return [pid for pid in children() if _namespace_depth(pid) > _own_depth()]",
        "    return list(children())",
        ("tests/test_orphans.py -k only_sandboxes",),
    ),
    Mutation(
        "turns-sandboxes-left-as-zombies",
        "target_side/fence/nursery.py",
        "        orphans.reap_orphaned_sandboxes()\n",
        "",
        ("tests/test_orphans.py -k bubblewrap_leaves_it",),
    ),
    Mutation(
        "launcher-leaves-its-sandboxes-as-zombies",
        "target_side/fence/launcher.py",
        "            orphans.reap_orphaned_sandboxes()",
        "            pass",
        ("tests/test_launcher.py -k bubblewrap_leaves_it",),
    ),
    Mutation(
        # The thread that sweeps, not the main thread, to which the kernel gives orphans.
        "orphan-sweep-looks-at-the-wrong-thread",
        "target_side/fence/orphans.py",
        'open(f"/proc/self/task/{os.getpid()}/children", "rb")',
        'open(f"/proc/self/task/{threading.get_native_id()}/children", "rb")',
        ("tests/test_orphans.py -k bubblewrap_leaves_it",),
    ),
    Mutation(
        "unfollowed-spawn-left-running",
        "target_side/fence/identity.py",
        "            self.worker.spawned.add_done_callback(self._unfollowed)",
        "            pass",
        ("tests/test_cancelled_start.py -k before_it_is_handed_over",),
    ),
    Mutation(
        "spawn-failing-to-connect-left-running",
        "target_side/fence/identity.py",
        "        except BaseException:\n            self._end(process)",
        "        except BaseException:\n            pass",
        ("tests/test_cancelled_start.py -k while_its_pipes_connect",),
    ),
    Mutation(
        "scan-limit-ignored",
        "target_side/policy/protect.py",
        "        if visited > limit:",
        "        if False:",
        (
            f"{HOST_EDGES}::test_writable_mount_with_more_directories_than_the_scan_limit_is_refused",
        ),
    ),
    Mutation(
        "destination-not-normal-accepted",
        "target_side/policy/mounts.py",
        "        if not is_normal(target):",
        "        if False:",
        (f"{HOST_EDGES} -k not_normal",),
    ),
    Mutation(
        "forbidden-check-on-destinations-dropped",
        "target_side/policy/mounts.py",
        "        self.check_forbidden(subject, target, target)",
        "        pass",
        (f"{HOST_EDGES} -k secret_destination_on_a_forbidden_path or secret_placed_into_proc",),
    ),
    Mutation(
        "home-repaired-through-a-symlink",
        "target_side/fence/home.py",
        "DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC",
        "DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC",
        (
            f"{HOST_EDGES}::test_home_replaced_by_a_symlink_is_moved_aside_and_the_role_keeps_working",
        ),
        also=(
            (
                '            repaired = _move_aside(parent, where, f"belonged to uid {st.st_uid}, not {uid}")\n            fd = _make(parent, uid, gid)',
                "            fd = os.open(HOME, DIR_FLAGS, dir_fd=parent)\n            os.fchown(fd, uid, gid)",
            ),
        ),
    ),
    Mutation(
        "proc-sys-dev-mountable",
        "target_side/policy/forbidden.py",
        'NEVER_MOUNTED = ("/proc", "/sys", "/dev")',
        "NEVER_MOUNTED = ()",
        (f"{HOST_EDGES} -k proc_sys_dev or secret_placed_into_proc",),
    ),
    Mutation(
        "other-roles-workspaces-open",
        "target_side/policy/forbidden.py",
        "        *_other_workspaces(settings, role),\n",
        "",
        (f"{HOST_EDGES}::test_another_roles_workspace_is_forbidden",),
    ),
    Mutation(
        "vsock-unfiltered",
        "target_side/fence/syscall_filter.py",
        "(*KEPT_FAMILIES, AF_VSOCK) if network else KEPT_FAMILIES",
        "(*KEPT_FAMILIES, AF_VSOCK)",
        (f"{HOST_EDGES}::test_vsock_is_filtered_without_network",),
    ),
    Mutation(
        "fence-path-dirs-untrusted",
        "target_side/policy/mounts.py",
        "            found = trust.untrusted_ancestor(resolved)",
        "            found = None",
        (f"{HOST_EDGES}::test_fence_path_directory_others_can_write_is_refused",),
    ),
    Mutation(
        "fence-path-dirs-not-bound",
        "target_side/policy/mounts.py",
        '            self.add("ro", directory, "fence.path")',
        "            pass",
        (f"{HOST_EDGES}::test_fence_path_directory_of_the_operator_is_bound_and_runs",),
    ),
    Mutation(
        "home-is-the-servers",
        "target_side/policy/environment.py",
        '        "HOME": home,',
        '        "HOME": server_env.get("HOME", home),',
        (f"{HOST_EDGES}::test_env_home_is_the_roles_own_not_the_servers",),
    ),
    Mutation(
        "ambient-turn-id-reused",
        "target_side/policy/environment.py",
        '    env["PADDOCK_TURN_ID"] = turn_id',
        '    env["PADDOCK_TURN_ID"] = server_env.get("PADDOCK_TURN_ID", turn_id)',
        (f"{HOST_EDGES}::test_env_turn_id_is_minted_even_when_the_server_has_one",),
    ),
    Mutation(
        "lc-all-always-pinned",
        "target_side/policy/environment.py",
        "    if not any(LOCALE_NAMES.fullmatch(name) for name in declared):",
        "    if True:",
        (f"{HOST_EDGES}::test_env_declared_lang_alone_sets_the_locale",),
    ),
    Mutation(
        "curated-etc-copies-private-files",
        "target_side/fence/etc.py",
        "    elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o005 == 0o005:",
        "    elif stat.S_ISDIR(st.st_mode):",
        ("tests/test_curated_etc.py::test_curated_etc_leaves_out_what_others_cannot_read",),
        also=(
            (
                "    elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:",
                "    elif stat.S_ISREG(st.st_mode):",
            ),
        ),
    ),
    Mutation(
        "managed-entries-not-mounted",
        "target_side/policy/plan.py",
        "    for entry in managed.entries(role.home, settings.fence):",
        "    for entry in managed.entries(role.home, settings.fence)[:0]:",
        ("tests/test_managed_home.py::test_each_class_appears_read_only_over_the_writable_home",),
    ),
    Mutation(
        "managed-parent-normalised",
        "target_side/policy/managed.py",
        '        elif entry.rpartition("/")[0] not in roots:',
        "        elif posixpath.dirname(posixpath.normpath(entry)) not in roots:",
        ("tests/test_managed_home.py -k alias_forms",),
    ),
    Mutation(
        "managed-symlink-accepted",
        "target_side/policy/managed.py",
        "    if stat.S_ISLNK(st.st_mode):",
        "    if False:",
        ("tests/test_managed_home.py -k symlink",),
    ),
    Mutation(
        "managed-duplicates-accepted",
        "target_side/policy/managed.py",
        "        if place in seen:",
        "        if False:",
        ("tests/test_managed_home.py -k landing_on_one_name",),
    ),
    Mutation(
        "scratch-unsized",
        "target_side/fence/launch.py",
        '        "--size",\n        str(plan.limits.scratch_mb << 20),\n',
        "",
        ("tests/test_turns.py::test_scratch_is_sized_memory_that_goes_with_the_turn",),
    ),
    Mutation(
        "executable-of-any-owner-trusted",
        "target_side/trust.py",
        '    if st.st_uid not in trusted_owners(also):\n        return f"is owned by uid {st.st_uid}"\n    if st.st_mode & 0o022:',
        '    if False:\n        return f"is owned by uid {st.st_uid}"\n    if st.st_mode & 0o022:',
        ("tests/test_held_paths.py::test_executable_owned_by_someone_else_is_refused",),
    ),
)


LAUNCHER_TESTS = "tests/test_launcher.py::"
"""The launcher's own tests: a root launcher and an unprivileged server, real processes."""

MUTATIONS += (
    Mutation(
        "launcher-peer-uid-unchecked",
        "target_side/fence/launcher.py",
        "        if uid != grants.server[0]:",
        "        if False:",
        (LAUNCHER_TESTS + "test_launcher_refuses_a_connection_from_any_uid_but_the_servers",),
    ),
    Mutation(
        "launcher-role-uid-from-request",
        "target_side/fence/launcher.py",
        "        uid, gid = self.role_ids(role)\n",
        '        uid, gid = message["uid"], message["gid"]\n',
        (LAUNCHER_TESTS + "test_launcher_refuses_a_role_not_in_the_config_and_root",),
    ),
    Mutation(
        "launcher-audit-path-unchecked",
        "target_side/fence/launcher.py",
        "            if not normal or not any(is_within(path, w) and path != w for w in workspaces):",
        "            if False:",
        (LAUNCHER_TESTS + "test_launcher_audit_never_touches_a_path_outside_the_roles_workspaces",),
    ),
    Mutation(
        "launcher-supplementary-groups-kept",
        "target_side/fence/launcher.py",
        "    os.setgroups([])\n",
        "",
        (LAUNCHER_TESTS + "test_launcher_turn_runs_as_the_roles_uid_with_no_other_group",),
        also=(("or os.getgroups():", ":"),),
    ),
    Mutation(
        "launcher-close-does-not-kill-the-turn",
        "target_side/fence/launcher.py",
        "        if self.child is not None and not self.child.done:\n            self.kill(bwrap=True)",
        "        if self.child is not None and not self.child.done:\n            pass",
        (LAUNCHER_TESTS + "test_launcher_closing_the_server_kills_the_turn",),
    ),
    Mutation(
        "launcher-program-owner-unchecked",
        "target_side/fence/launcher.py",
        "    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:",
        "    if False:",
        (LAUNCHER_TESTS + "test_launcher_refuses_a_program_root_does_not_own",),
        also=(("        if st.st_uid != 0 or st.st_mode & 0o022:", "        if False:"),),
    ),
    Mutation(
        "server-trusts-a-launcher-that-is-not-root",
        "target_side/fence/launcher_client.py",
        "        if uid != 0:",
        "        if False:",
        (LAUNCHER_TESTS + "test_server_sends_nothing_to_a_launcher_that_is_not_root",),
    ),
    Mutation(
        "mux-socket-of-another-user-trusted",
        "agent_side/mux/paths.py",
        '    if info.st_uid != uid:\n        raise MuxUnsafe(\n            f"{shown} belongs',
        '    if False:\n        raise MuxUnsafe(\n            f"{shown} belongs',
        ("tests/test_mux.py::test_mux_refuses_a_socket_owned_by_another_user",),
    ),
    Mutation(
        "files-protected-names-written",
        "target_side/policy/files.py",
        '        if _holds_sequence(below, name.split("/")):',
        "        if False:",
        ("tests/test_files.py -k protected_name or hooks_named or bare_repository",),
        also=(("    git_dir = git_dir_above(resolved)", "    git_dir = None"),),
    ),
    Mutation(
        "files-outside-workspace-written",
        "target_side/policy/files.py",
        "    workspace = _workspace_of(resolved, workspaces)",
        "    workspace = _workspace_of(resolved, workspaces) or posixpath.dirname(resolved)",
        ("tests/test_files.py::test_files_put_outside_the_workspaces_is_refused",),
        also=(
            (
                '    planner.workspace_dir(directory, "path")',
                '    planner.existing("rw", directory, "path")',
            ),
        ),
    ),
    Mutation(
        "files-forbidden-list-ignored",
        "target_side/policy/forbidden.py",
        "        if any(is_within(canonical, mine) for mine in self.own):\n            return None",
        "        return None",
        ("tests/test_files.py -k forbidden",),
    ),
    Mutation(
        "files-written-as-root",
        "target_side/policy/files.py",
        "    uid, gid = host_ids(settings, role)",
        "    uid, gid = 0, 0",
        ("tests/test_files.py -k belong_to_the_role_uid or round_trips",),
    ),
    Mutation(
        "files-commit-without-the-whole-body",
        "target_side/fence/file_helper.py",
        "            if not _committed():\n                return\n            os.fchmod(temporary.fd, mode)",
        "            os.fchmod(temporary.fd, mode)",
        ("tests/test_files.py::test_files_put_cut_off_midway_leaves_the_old_file",),
    ),
    Mutation(
        "files-upload-unbounded",
        "target_side/service/files.py",
        "            if declared is not None and declared > plan.limit_bytes:",
        "            if False:",
        ("tests/test_files.py -k over_the_role_limit",),
        also=(
            (
                "if size > limit:\n                        raise self.service",
                "if False:\n                        raise self.service",
            ),
            ("target_side/fence/file_helper.py", "        if size > limit:", "        if False:"),
        ),
    ),
    Mutation(
        "git-hooks-writable-as-a-mount-of-their-own",
        "target_side/policy/plan.py",
        '        if member is not None and subject != "roles.home":',
        "        if False:",
        ("tests/test_files.py::test_turn_writable_mount_inside_git_hooks_is_refused",),
    ),
    Mutation(
        "archive-dot-dot-accepted",
        "target_side/fence/file_helper.py",
        '    if ".." in parts:',
        "    if False:",
        ("tests/test_file_helper.py -k dot", "tests/test_files.py -k attack and dot"),
    ),
    Mutation(
        "archive-absolute-names-accepted",
        "target_side/fence/file_helper.py",
        '    if name.startswith("/"):',
        "    if False:",
        (
            "tests/test_file_helper.py -k absolute",
            "tests/test_files.py -k attack and absolute",
        ),
    ),
    Mutation(
        "archive-symlinks-unchecked",
        "target_side/fence/file_helper.py",
        "        if member.issym():\n            tree.check_link",
        "        if False:\n            tree.check_link",
        ("tests/test_file_helper.py -k symlink", "tests/test_files.py -k attack and symlink"),
    ),
    Mutation(
        "archive-hard-links-unchecked",
        "target_side/fence/file_helper.py",
        "        elif member.islnk():\n            _check_hard_link",
        "        elif False:\n            _check_hard_link",
        ("tests/test_file_helper.py -k hard", "tests/test_files.py -k attack and hard"),
    ),
    Mutation(
        "archive-devices-extracted",
        "target_side/fence/file_helper.py",
        "    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):",
        "    if False:",
        (
            "tests/test_file_helper.py -k device or fifo",
            "tests/test_files.py -k attack and (device or fifo)",
        ),
    ),
    Mutation(
        "archive-setuid-kept",
        "target_side/fence/file_helper.py",
        "    if member.mode & (stat.S_ISUID | stat.S_ISGID):",
        "    if False:",
        (
            "tests/test_file_helper.py -k setuid or setgid",
            "tests/test_files.py -k attack and setuid",
        ),
    ),
    Mutation(
        "archive-through-an-existing-symlink",
        "target_side/fence/file_helper.py",
        "            if there is not None and not stat.S_ISDIR(there.st_mode):",
        "            if False:",
        (
            "tests/test_file_helper.py -k existing_symlink",
            "tests/test_files.py::test_archive_member_under_an_existing_symlink_out_is_refused",
        ),
    ),
    Mutation(
        "archive-protected-members-accepted",
        "target_side/fence/file_helper.py",
        "    _check_protected(parts, request, name)",
        "    pass",
        (
            "tests/test_file_helper.py -k protected or git",
            "tests/test_files.py -k attack and (git or bashrc)",
        ),
    ),
    Mutation(
        "archive-unpacked-size-unbounded",
        "target_side/fence/file_helper.py",
        '    if plan.size > request["limit"]:',
        "    if False:",
        (
            "tests/test_file_helper.py -k over",
            "tests/test_files.py::test_archive_unpacking_over_the_role_limit_is_refused",
        ),
    ),
    Mutation(
        "body-limit-exempts-every-route",
        "target_side/service/body_limit.py",
        '(scope["method"], scope["path"]) in STREAMED:',
        "True:",
        ("tests/test_api.py::test_body_over_one_mib_is_413_and_server_keeps_serving",),
    ),
    Mutation(
        "request-clock-stops-for-every-body",
        "target_side/service/connections.py",
        "            streaming = self._in_body and bool(",
        "            streaming = self._in_body or bool(",
        ("tests/test_files.py::test_a_turn_body_not_finished_in_time_is_still_closed",),
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
    Mutation(
        "lease-generation-not-checked",
        "target_side/service/leases.py",
        "        if not lease.generation == grant.generation == seat.generation:",
        "        if False:",
        (
            "tests/test_leases.py -k superseded_generation_is_refused",
            "tests/test_leases.py -k zombie",
        ),
    ),
    Mutation(
        "lease-of-another-role-accepted",
        "target_side/service/leases.py",
        "        if seat is None or grant is None or seat.role != role:",
        "        if seat is None or grant is None:",
        (
            "tests/test_leases.py -k another_role_or_seat",
            "tests/test_leases.py -k leases_own_role",
        ),
    ),
    Mutation(
        "superseded-lease-renewable",
        "target_side/service/leases.py",
        "            if grant.generation != seat.generation:\n                raise LeaseEnded(",
        "            if False:\n                raise LeaseEnded(",
        (
            "tests/test_leases.py -k superseded_is_never_renewed",
            "tests/test_leases.py -k zombie",
        ),
    ),
    Mutation(
        "session-turn-lease-unchecked",
        "target_side/service/sessions.py",
        "        self.turns.leases.admit(request.role, request.lease or record.lease)",
        "        pass",
        ("tests/test_leases.py -k zombies_session_turns",),
    ),
    Mutation(
        "session-lease-unchecked-at-start",
        "target_side/service/sessions.py",
        "            leases.admit(request.role, request.lease)\n            record.lease",
        "            record.lease",
        ("tests/test_leases.py -k refuses_a_session_without_one",),
        also=(("            leases.admit(request.role, request.lease)\n", ""),),
    ),
    Mutation(
        "request-clock-left-stopped-after-a-response",
        "target_side/service/connections.py",
        "            self._answered += 1",
        "            pass",
        ("tests/test_connections.py -k kept_alive",),
    ),
    Mutation(
        "request-clock-runs-while-a-response-is-sent",
        "target_side/service/connections.py",
        "            waiting = self._whole > self._answered",
        "            waiting = False",
        ("tests/test_connections.py -k stream_longer",),
    ),
    Mutation(
        "request-head-unbounded",
        "target_side/service/connections.py",
        "                if not self._in_body and self._head_bytes >= MAX_HEAD_BYTES:",
        "                if False:",
        ("tests/test_connections.py -k head_past",),
    ),
    Mutation(
        "request-head-fed-a-read-at-a-time",
        "target_side/service/connections.py",
        "                    end = min(end, start + MAX_HEAD_BYTES - self._head_bytes)",
        "                    pass",
        ("tests/test_connections.py -k head_past",),
    ),
    Mutation(
        "event-stream-cut-after-its-end",
        "target_side/service/event_stream.py",
        "            if not ended:",
        "            if True:",
        ("tests/test_event_stream.py",),
    ),
    Mutation(
        "event-stream-client-leaving-left-pending",
        "target_side/service/event_stream.py",
        "            if not left or streamer.uncancel() > 0:",
        "            if not left:",
        ("tests/test_event_stream.py",),
    ),
    Mutation(
        "event-stream-client-leaving-fails-the-request",
        "target_side/service/event_stream.py",
        "            if not left or streamer.uncancel() > 0:",
        "            if True:",
        ("tests/test_event_stream.py",),
    ),
    Mutation(
        "late-close-report-drops-successor",
        "target_side/service/connections.py",
        "        if self._open.get(entry.fd) is entry:\n            del self._open[entry.fd]",
        "        if entry.fd in self._open:\n            _cancel(self._open.pop(entry.fd))",
        ("tests/test_connections.py -k late_report",),
    ),
    Mutation(
        "file-operation-lease-unchecked",
        "target_side/service/files.py",
        "            self.manager.leases.admit(role, who.lease)\n            plan",
        "            plan",
        (
            "tests/test_leases.py -k file_operation_without_one",
            "tests/test_leases.py -k zombies_file_writes",
        ),
        also=(("            self.manager.leases.admit(role, who.lease)\n", ""),),
    ),
    Mutation(
        "python-file-operations-drop-the-held-lease",
        "agent_side/api.py",
        "        return Acting(role, self.lease_for(role))",
        "        return Acting(role, None)",
        ("tests/test_agent_leases.py -k file_operations_and_sessions",),
    ),
    Mutation(
        "nearly-full-disk-admits-turns",
        "target_side/service/turns.py",
        "        if self._disk_failure is not None or self._disk_low is not None:",
        "        if self._disk_failure is not None:",
        ("tests/test_disk_full.py -k nearly",),
    ),
    Mutation(
        "lease-not-required",
        "target_side/service/leases.py",
        "            if config is not None and config.require_lease:",
        "            if False:",
        ("tests/test_leases.py -k required",),
    ),
    Mutation(
        "lease-not-checked-at-launch",
        "target_side/service/turns.py",
        "            self.leases.admit(request.role, request.lease)\n        except RefusedError as exc:",
        "            pass\n        except RefusedError as exc:",
        ("tests/test_leases.py -k zombie",),
        also=(
            (
                "            # Again at launch: a seat taken over while the turn was planned "
                "refuses it.\n            self.leases.admit(request.role, request.lease)\n",
                "",
            ),
        ),
    ),
)


# A role's home is seen as it should be without its lock; anything else is mended under it.
MUTATIONS += (
    Mutation(
        "home-seen-right-whatever-its-mode",
        "target_side/fence/home.py",
        "        return (st.st_uid, st.st_gid) == (uid, gid) and stat.S_IMODE(st.st_mode) == HOME_MODE",
        "        return (st.st_uid, st.st_gid) == (uid, gid)",
        ("tests/test_home.py -k mode",),
    ),
    Mutation(
        "home-seen-right-whoever-owns-its-parents",
        "target_side/fence/home.py",
        "            if st.st_uid != owner[0] or stat.S_IMODE(st.st_mode) != SEARCHABLE:",
        "            if stat.S_IMODE(st.st_mode) != SEARCHABLE:",
        ("tests/test_host_edges.py -k cannot_make",),
    ),
    Mutation(
        "home-seen-right-through-a-symlink",
        "target_side/fence/home.py",
        "        opened.append(os.open(HOME, LOOK_FLAGS, dir_fd=opened[-1]))",
        "        opened.append(os.open(HOME, os.O_PATH, dir_fd=opened[-1]))",
        ("tests/test_home.py -k symlink",),
    ),
    Mutation(
        "home-always-made-under-the-lock",
        "target_side/fence/home.py",
        "    if looks_ready(state_root, role, uid, gid, owner):",
        "    if False:",
        ("tests/test_home.py -k without_the_roles_lock",),
    ),
)

# A turn's bubblewrap is started by the thread that planned it; its bookkeeping on the loop
# waits for the turns being planned, a second at most.
MUTATIONS += (
    Mutation(
        "turn-started-only-when-the-loop-gets-to-it",
        "target_side/service/turns.py",
        "        self._start_here(record, planned, request, loop)\n",
        "",
        ("tests/test_start_here.py",),
    ),
    Mutation(
        "started-turns-bookkeeping-never-waits",
        "target_side/service/turns.py",
        "            await self._after_planning()\n",
        "",
        ("tests/test_start_here.py -k bookkeeping_waits",),
    ),
    Mutation(
        "planning-threads-failure-leaves-the-turn-without-an-end",
        "target_side/service/turns.py",
        '            await self._failed_launch(record, request, "plan or start")\n            return record.turn',
        "            raise",
        ("tests/test_start_here.py -k targets_own",),
    ),
    Mutation(
        "started-turns-bookkeeping-waits-for-ever",
        "target_side/service/turns.py",
        "                async with asyncio.timeout(BOOKKEEPING_WAIT_S):",
        "                async with asyncio.timeout(None):",
        ("tests/test_start_here.py -k a_second_at_most",),
    ),
)

SESSION_TESTS = "tests/test_sessions.py"
"""Sessions and terminals over real bubblewrap and a real target."""

MUTATIONS += (
    Mutation(
        "session-turn-widens-its-fence",
        "shared/wire.py",
        "        if self.session is None:\n            return self",
        "        if True:\n            return self",
        (SESSION_TESTS + " -k may_not_set_fence_fields",),
    ),
    Mutation(
        "session-shell-root-inside",
        "target_side/policy/sessions.py",
        "        stdin_open=True,\n    )",
        "        stdin_open=True,\n        uid=0,\n        gid=0,\n    )",
        (SESSION_TESTS + "::test_session_shell_runs_as_the_roles_uid",),
    ),
    Mutation(
        "session-turn-asks-past-its-session",
        "target_side/service/sessions.py",
        "    if asked is not None and asked > most:\n        raise RefusedError(refusals.limit_exceeds_session",
        "    if False:\n        raise RefusedError(refusals.limit_exceeds_session",
        (SESSION_TESTS + "::test_session_turn_cannot_ask_for_more_than_its_session",),
    ),
    Mutation(
        "session-limits-not-its-own",
        "target_side/policy/sessions.py",
        'limits=plan.limits.model_copy(update={"wall_s": session_s}),',
        'limits=plan.limits.model_copy(update={"wall_s": session_s, "pids": maxima.pids}),',
        (SESSION_TESTS + "::test_session_cgroup_bounds_all_its_turns_together",),
    ),
    Mutation(
        "session-turn-not-audited",
        "target_side/service/sessions.py",
        "        audit_plan = replace(plan.fence, turn_id=turn_id)",
        "        audit_plan = replace(plan.fence, turn_id=turn_id, audit={})",
        (SESSION_TESTS + "::test_session_audits_protected_names_after_each_turn",),
    ),
    Mutation(
        "session-end-not-audited",
        "target_side/service/sessions.py",
        "fence_plan.role, (fence_plan.uid, fence_plan.gid), fence_plan.audit, _id(record)",
        "fence_plan.role, (fence_plan.uid, fence_plan.gid), {}, _id(record)",
        (SESSION_TESTS + "::test_session_audits_protected_names_when_it_ends",),
    ),
    Mutation(
        "session-of-another-role-visible",
        "target_side/service/sessions.py",
        "        if record is None or record.session.role not in roles:",
        "        if record is None:",
        (SESSION_TESTS + " -k other_roles_session",),
    ),
    Mutation(
        "terminal-turn-unfiltered",
        "target_side/fence/launch.py",
        "        seccomp = syscall_filter.filter_fd(network=plan.network)",
        "        seccomp = None if plan.tty else syscall_filter.filter_fd(network=plan.network)",
        ("tests/test_terminals.py -k tiocsti",),
    ),
    Mutation(
        "terminal-not-the-commands-own",
        "target_side/fence/launch.py",
        '    return [plan.terminal_helper, "--ctty", "--"]',
        "    return []",
        ("tests/test_terminals.py -k controlling_terminal or ctrl_c",),
    ),
)


MCP_TESTS = "tests/test_mcp.py"
"""``paddock mcp`` as a harness runs it, against a real target."""

MUTATIONS += (
    Mutation(
        # A model told only "126" cannot correct its request: the rule must reach it.
        "mcp-run-refusal-unreported",
        "agent_side/mcp_server.py",
        "        refusal=None if result.refusal is None else refusal_report(result.refusal),\n",
        "        refusal=None,\n",
        (f"{MCP_TESTS} -k refused_run",),
    ),
    Mutation(
        "mcp-file-refusal-unreported",
        "agent_side/mcp_server.py",
        "                refusal = refusal_report(exc.refusal)\n",
        "                refusal = None\n",
        (f"{MCP_TESTS} -k files_round_trip",),
    ),
    Mutation(
        "mcp-output-not-truncated",
        "agent_side/mcp_server.py",
        "    if len(data) <= limit:\n",
        "    if True:\n",
        (f"{MCP_TESTS} -k long_output",),
    ),
    Mutation(
        "mcp-sessions-left-open-at-exit",
        "agent_side/mcp_server.py",
        "                        tasks.start_soon(self._end_quietly, session_id)\n",
        "                        pass\n",
        (f"{MCP_TESTS} -k end_when_the_server or term_ends",),
    ),
    Mutation(
        "mcp-turn-left-running-at-exit",
        "agent_side/mcp_server.py",
        "                await anyio.to_thread.run_sync(submission.kill, target)\n",
        "                pass\n",
        (f"{MCP_TESTS} -k in_flight",),
    ),
    Mutation(
        "mcp-lease-not-carried",
        "agent_side/mcp_server.py",
        "        target.act_under(self._lease)",
        "        target.act_under(None)",
        (f"{MCP_TESTS} -k lease",),
    ),
    Mutation(
        "mcp-session-started-without-the-lease",
        "agent_side/mcp_server.py",
        "            session = open_session(target, target.with_lease(request))",
        "            session = open_session(target, request)",
        (f"{MCP_TESTS} -k lease",),
    ),
)

# --- issue 12: a held path opened by one openat2 that follows no symlink ------------------------
MUTATIONS += (
    Mutation(
        "kernel-open-follows-symlinks",
        "target_side/fence/nofollow.py",
        "    how = _OpenHow(HOLD_FLAGS, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)",
        "    how = _OpenHow(HOLD_FLAGS, 0, 0)",
        ("tests/test_nofollow.py -k kernel_refuses or rule_allows",),
    ),
    Mutation(
        "kernel-opened-symlink-kept",
        "target_side/fence/nofollow.py",
        "        if stat.S_ISLNK(os.fstat(fd).st_mode):",
        "        if False:",
        ("tests/test_nofollow.py -k named or rule_allows",),
    ),
)

# --- issue 12: remembered canonical paths, re-checked before they are believed ----------------
MUTATIONS += (
    Mutation(
        "remembered-path-believed-unchecked",
        "target_side/policy/walk_cache.py",
        "        if known is not None and _unchanged(known[1], looked):",
        "        if known is not None:",
        ("tests/test_walk_cache.py -k swapped_in or stays_forbidden or always_answers",),
    ),
    Mutation(
        "remembered-while-still-racy",
        "target_side/policy/walk_cache.py",
        "        if not stat.S_ISDIR(seen[2]) or now - max(seen[3], seen[4]) < RACY_NS:",
        "        if not stat.S_ISDIR(seen[2]):",
        ("tests/test_walk_cache.py -k fresh",),
    ),
)

# --- issue 12: a worker thread starts a turn as the role's ids, then takes root back -----------
MUTATIONS += (
    Mutation(
        "role-ids-kept-by-the-thread",
        "target_side/fence/thread_ids.py",
        '            finally:\n                _call("setresuid", 0, 0, 0)',
        "            finally:\n                pass",
        (
            "tests/test_thread_ids.py -k root_back",
            "tests/test_host_edges.py -k bwrap_runs_as_the_role",
        ),
    ),
    Mutation(
        "thread-switches-where-the-server-stays-traceable",
        "target_side/fence/thread_ids.py",
        "_suid_dumpable() != SUID_DUMP_USER",
        "_suid_dumpable() >= 0",
        ("tests/test_thread_ids.py -k traceable",),
    ),
    Mutation(
        "thread-switches-for-a-uid-with-an-account",
        "target_side/fence/thread_ids.py",
        "    return not _has_account(uid) and",
        "    return",
        ("tests/test_thread_ids.py -k host_account",),
    ),
    Mutation(
        "capabilities-handed-on-to-the-fence",
        "target_side/fence/thread_ids.py",
        "    groups, gids = os.getgroups(), os.getresgid()\n    _drop_inherited_capabilities()",
        "    groups, gids = os.getgroups(), os.getresgid()",
        ("tests/test_thread_ids.py -k nothing_more",),
    ),
    Mutation(
        "server-groups-handed-on-to-the-fence",
        "target_side/fence/thread_ids.py",
        '    _call("setgroups", 0, None)\n',
        "",
        ("tests/test_thread_ids.py -k nothing_more",),
    ),
)


def run(mutation: Mutation) -> bool:
    """True if the mutation turned its tests red (as it must)."""
    with tempfile.TemporaryDirectory(prefix=f"paddock-mut-{mutation.name}-") as tmp:
        copy = Path(tmp) / "tree"
        shutil.copytree(
            ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".*cache")
        )
        for file, old, new in _replacements(mutation):
            target = copy / file
            text = target.read_text()
            if old not in text:
                print(f"{mutation.name}: STALE (the code it mutates has changed)")
                return False
            target.write_text(text.replace(old, new, 1))
        failed = all(_red(copy, spec) for spec in mutation.tests)
    print(
        f"{mutation.name}: {'red as it must be' if failed else 'STILL GREEN - the test cannot fail'}"
    )
    return failed


def _replacements(mutation: Mutation) -> list[tuple[str, str, str]]:
    found = [(mutation.file, mutation.old, mutation.new)]
    for extra in mutation.also:
        if len(extra) == 2:
            found.append((mutation.file, extra[0], extra[1]))
        else:
            found.append((extra[0], extra[1], extra[2]))
    return found


def _red(tree: Path, spec: str) -> bool:
    path, _, expr = spec.partition(" -k ")
    # A base temp of its own: pytest's shared one is swept (and made 0700) by every session,
    # so a suite running beside this one would turn its tests red for the wrong reason.
    basetemp = f"--basetemp={tree.parent / 'pytest'}"
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider"]
    argv += [basetemp, path]
    if expr:
        argv += ["-k", expr]
    try:
        result = subprocess.run(argv, cwd=tree, capture_output=True, text=True, timeout=600)
    finally:
        _end_leftovers()
    return result.returncode == 1


def _end_leftovers() -> None:
    """Kill and reap every process a test run left behind, now this one's children. Killing
    an escaped bubblewrap hands its sandbox over in turn, hence the rounds."""
    for _ in range(20):
        left = orphans.children()
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


USAGE = (
    "usage: scripts/mutation_check.py all | NAME [NAME ...]\n"
    "  inverts the rule behind each security test and expects its tests to go red"
)


MUTATIONS += (
    Mutation(
        "v2-slot-renamed",
        "target_side/fence/limits.py",
        "            if hierarchy.version == 1:\n",
        "            if True:\n",
        ("tests/test_limits.py -k slot_under_cgroup_v2",),
    ),
    Mutation(
        "nul-cut-path-opened",
        "target_side/fence/nofollow.py",
        '    if "\\0" in path:\n',
        "    if False:\n",
        ("tests/test_nofollow.py -k nul_byte",),
    ),
    Mutation(
        "refused-cgroup-left-open",
        "target_side/fence/launcher.py",
        "        except BaseException:\n            os.close(fd)\n            raise\n        return fd\n",
        "        except LauncherError:\n            os.close(fd)\n            raise\n        return fd\n",
        ("tests/test_launcher.py -k descriptor_of_a_cgroup",),
        also=(("target_side/fence/nofollow.py", '    if "\\0" in path:\n', "    if False:\n"),),
    ),
    Mutation(
        "prepared-child-death-read-as-a-pid",
        "target_side/fence/launcher_client.py",
        '            if "gone" in reply:\n',
        "            if False:\n",
        ("tests/test_launcher.py -k child_died_after_a_turn_took",),
    ),
    Mutation(
        "prepared-start-blocks-the-launcher",
        "target_side/fence/launcher.py",
        "            failure = await _read_to_end(self.errors, HELPER_TIMEOUT_S)\n",
        "            failure = _read_until_eof(self.errors, HELPER_TIMEOUT_S)\n",
        ("tests/test_launcher.py -k slow_to_start",),
    ),
    Mutation(
        "launcher-stops-accepting-when-short",
        "target_side/fence/launcher.py",
        "            if exc.errno not in SHORT_OF:\n",
        "            if True:\n",
        ("tests/test_launcher.py -k out_of_descriptors",),
    ),
    Mutation(
        "prepared-processes-unbounded",
        "target_side/fence/launcher.py",
        "        if waiting >= MAX_PREPARED:\n",
        "        if False:\n",
        ("tests/test_launcher.py -k bounded_number",),
    ),
    Mutation(
        "prepared-again-after-its-child-died",
        "target_side/fence/launcher.py",
        "        if self.child is not None or self.was_prepared:\n",
        "        if self.child is not None or self.prepared is not None:\n",
        ("tests/test_launcher.py -k prepared_child_died_launches_nothing",),
    ),
    Mutation(
        "client-keeps-a-targets-cookies",
        "agent_side/client.py",
        "            cookies=_NoCookies(),\n",
        "",
        ("tests/test_client.py -k cookie",),
    ),
    Mutation(
        "turn-waits-for-pipes-held-outside-it",
        "target_side/fence/runner.py",
        "await asyncio.wait(reading.values(), timeout=DRAIN_S)",
        "await asyncio.wait(reading.values(), timeout=None)",
        ("tests/test_drain.py",),
    ),
    Mutation(
        "session-records-written-in-any-order",
        "target_side/service/sessions.py",
        "            async with record.writing:\n",
        "            if record.writing is not None:\n",
        ("tests/test_sessions.py -k last_state",),
    ),
    Mutation(
        "turn-started-without-its-spool",
        "target_side/service/turns.py",
        "            record.spool.create(report=False)\n",
        "            with contextlib.suppress(StorageError): record.spool.create(report=False)\n",
        ("tests/test_disk_full.py -k spool_the_disk",),
    ),
    Mutation(
        "sweep-leaves-torn-tails",
        "target_side/service/store.py",
        '            return [Path(e.path) for e in entries if e.name.partition(".")[0] in turn_ids]\n',
        '            return [Path(e.path) for e in entries if e.name in {f"{t}.frames" for t in turn_ids}]\n',
        (
            "tests/test_durability.py -k retention_sweep",
            "tests/test_ledger_recovery.py -k lost_and_found",
        ),
    ),
    Mutation(
        "spool-files-not-taken-back",
        "target_side/service/store.py",
        "            if turn_id != entry.name:\n                yield Unrecorded(turn_id=turn_id)\n            elif",
        "            if",
        ("tests/test_ledger_recovery.py -k leaves_its_spool_alone",),
    ),
)


MUTATIONS += (
    Mutation(
        "ended-turns-never-rest",
        "target_side/service/turns.py",
        "        spool = record.spool.at_rest()\n        if spool is None:\n            return\n",
        "        spool = None\n        if spool is None:\n            return\n",
        ("tests/test_durability.py -k rest_and_answer",),
    ),
    Mutation(
        "woken-spool-loses-its-index",
        "target_side/service/spool.py",
        "        spool._offsets, spool._kinds, spool._size = offsets, kinds, size\n",
        "        spool._offsets, spool._kinds, spool._size = offsets[:-1], kinds[:-1], size\n",
        ("tests/test_durability.py -k rest_and_answer",),
    ),
    Mutation(
        "sweep-passes-over-resting-turns",
        "target_side/service/turns.py",
        "        resting = [(turn_id, r[2]) for turn_id, r in self._resting.items() if r[1] < oldest]\n",
        "        resting: list[tuple[str, str | None]] = []\n",
        ("tests/test_durability.py -k rest_and_answer",),
    ),
    Mutation(
        "listing-reads-the-whole-ledger",
        "target_side/service/listing.py",
        "        if len(created) == limit and _latest_moment(turn) < created[0] - LISTING_SLACK:\n",
        "        if False:\n",
        ("tests/test_durability.py -k back_only",),
    ),
    Mutation(
        "listing-takes-an-earlier-state-of-a-turn",
        "target_side/service/listing.py",
        "        if turn_id in seen:\n            continue  # an earlier state of a turn already found\n",
        "        if turn_id in seen and False:\n            continue\n",
        ("tests/test_durability.py -k back_only",),
    ),
    Mutation(
        "ledger-read-backwards-loses-a-block-edge",
        "target_side/service/ledger.py",
        "            carry = lines[0]  # it may begin in the block before\n",
        '            carry = b""\n',
        ("tests/test_durability.py -k newest_first",),
    ),
    Mutation(
        "ledger-read-backwards-takes-a-half-appended-line",
        "target_side/service/ledger.py",
        "        position = _whole_end(f)\n",
        "        position = f.seek(0, os.SEEK_END)\n",
        ("tests/test_durability.py -k newest_first",),
    ),
    Mutation(
        "restart-reads-the-whole-ledger",
        "target_side/service/ledger.py",
        "                if not unfinished:\n                    break\n",
        "                if not unfinished:\n                    pass\n",
        ("tests/test_ledger_recovery.py -k oldest_kept",),
    ),
    Mutation(
        "restart-loses-the-launchs-key",
        "target_side/service/ledger.py",
        "                found[turn_id] = replace(later, idempotency=key)  # the launch keeps it\n",
        "                pass\n",
        ("tests/test_ledger_recovery.py -k oldest_kept",),
    ),
    Mutation(
        "restart-stops-at-a-turns-latest-record",
        "target_side/service/ledger.py",
        '            if record.get("kind") == "launch" or turn.get("started_at") is None:\n',
        "            if True:\n",
        ("tests/test_ledger_recovery.py -k oldest_kept",),
    ),
    Mutation(
        "chain-prefix-skips-prev",
        "target_side/service/ledger.py",
        """    return f'{{"seq":{seq},"prev":"{prev}",'.encode()""",
        """    return f'{{"seq":{seq},'.encode()""",
        (
            "tests/test_ledger_recovery.py -k past_its_prefix",
            "tests/test_durability.py -k edited_record",
        ),
    ),
    Mutation(
        "chain-verify-parses-every-record",
        "target_side/service/ledger.py",
        "    if line.startswith(_chain_prefix(seq, prev)):\n",
        "    if False:\n",
        ("tests/test_ledger_recovery.py -k without_parsing",),
    ),
    Mutation(
        "chain-of-another-layout-refused",
        "target_side/service/ledger.py",
        '    if record.get("prev") != prev:\n',
        "    if True:\n",
        ("tests/test_ledger_recovery.py -k another_layout",),
    ),
    Mutation(
        "torn-tail-search-reads-the-whole-ledger",
        "target_side/service/ledger.py",
        "    position = before\n    while position > 0:\n        step = min(BACKWARD_BLOCK, position)\n",
        "    position = before\n    while position > 0:\n        step = position\n",
        ("tests/test_ledger_recovery.py -k only_the_end",),
    ),
    Mutation(
        "torn-tail-search-misses-the-last-line",
        "target_side/service/ledger.py",
        "        start = _line_start_before(f, end - 1) if end else 0\n",
        "        start = _line_start_before(f, end) if end else 0\n",
        ("tests/test_ledger_recovery.py -k torn_tail_is_found",),
    ),
    Mutation(
        "state-files-read-through-a-link",
        "target_side/safe_files.py",
        "        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)\n",
        "        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)\n",
        ("tests/test_ledger_recovery.py -k planted",),
    ),
    Mutation(
        "session-file-read-through-a-link",
        "target_side/service/session_store.py",
        "StoredSession.model_validate_json(read_whole(path))",
        "StoredSession.model_validate_json(path.read_bytes())",
        ("tests/test_ledger_recovery.py -k session_or_an_earlier",),
    ),
    Mutation(
        "ledger-link-refused-without-a-reason",
        "target_side/service/ledger.py",
        "        if exc.errno == errno.ELOOP:\n            raise LedgerError(",
        "        if False:\n            raise LedgerError(",
        ("tests/test_ledger_recovery.py -k ledger_planted",),
    ),
    Mutation(
        "ledger-read-refuses-what-only-json-reads",
        "target_side/service/ledger.py",
        "    except ValueError:\n        return json.loads(line)\n",
        "    except ValueError:\n        raise\n",
        ("tests/test_ledger_recovery.py -k json_module",),
    ),
    Mutation(
        "earlier-versions-spool-looked-for-in-the-new-place",
        "target_side/service/store.py",
        "        return Unrecorded(turn_id=directory.name, in_own_directory=True)\n",
        "        return Unrecorded(turn_id=directory.name)\n",
        ("tests/test_ledger_recovery.py -k earlier",),
    ),
    Mutation(
        "signal-before-the-fence-is-taken-goes-nowhere",
        "target_side/fence/runner.py",
        "            self._waiting_signals.append(SIGNALS[name])\n            return 0\n",
        "            return self._proc.signal_fence(SIGNALS[name])\n",
        ("tests/test_turns.py -k before_the_target_has_taken",),
    ),
    Mutation(
        "waiting-signals-never-sent",
        "target_side/fence/runner.py",
        "        for signum in waiting:\n            self._proc.signal_fence(signum)\n",
        "        for signum in waiting:\n            pass\n",
        ("tests/test_turns.py -k before_the_target_has_taken",),
    ),
    Mutation(
        "resting-turn-served-to-any-role",
        "target_side/service/turns.py",
        "        if role is None or role not in roles:\n",
        "        if role is None:\n",
        ("tests/test_durability.py -k rest_and_answer",),
    ),
)


def main() -> int:
    names = sys.argv[1:]
    known = {m.name for m in MUTATIONS}
    unknown = [n for n in names if n != "all" and n not in known]
    if not names or unknown:
        if unknown:
            print(f"unknown mutation(s): {', '.join(unknown)}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        print("known: " + " ".join(sorted(known)), file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if "all" in names or m.name in names]
    orphans.become_subreaper()
    results = [run(m) for m in chosen]
    print(f"{sum(results)}/{len(results)} mutations caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
