"""One constructor per refusal rule: the only place each rule's wording lives.

Each returns the ``Refusal`` itself, a value: the planner raises it as a
``RefusedError`` where it stops (``raise RefusedError(refusals.x(...))``), and
code that only reports one (a failed launch, a file operation's answer) uses
the value as it is. A rule reads the same wherever it is detected, and a grep
for the rule name finds one place.
"""

from __future__ import annotations

from shared.wire import Refusal
from target_side.policy.forbidden import Collision

_CONFLICT_WORDS = {
    "exact": "is the forbidden path",
    "descendant": "lies inside the forbidden path",
    "parent": "would expose the forbidden path",
}


def forbidden_path(subject: str, given: str, resolved: str, hit: Collision) -> Refusal:
    alias = "" if given == resolved else f" (it resolves to {resolved})"
    return _refused(
        "forbidden-path",
        subject,
        given,
        resolved,
        f"{given}{alias} {_CONFLICT_WORDS[hit.conflict.value]} {hit.entry.path} "
        f"({hit.entry.why}); ask for a path that neither contains nor lies inside it",
    )


def socket_path(subject: str, given: str, resolved: str) -> Refusal:
    return _refused(
        "forbidden-path",
        subject,
        given,
        resolved,
        f"{resolved} is a unix socket, and no socket is ever bound into a fence "
        "(read-only does not stop a socket); remove it from the request",
    )


def outside_workspace(
    subject: str, given: str, resolved: str, workspaces: tuple[str, ...]
) -> Refusal:
    return _refused(
        "outside-workspace",
        subject,
        given,
        resolved,
        f"{resolved} is not inside a workspace of this role ({', '.join(workspaces)}); "
        "use a path inside one of them",
    )


def bad_mount(subject: str, given: str, resolved: str, why: str) -> Refusal:
    return _refused("bad-mount", subject, given, resolved, f"{resolved} {why}")


def missing_path(subject: str, given: str, resolved: str, what: str = "") -> Refusal:
    """``bad-mount``, for a path that is not there: raised as ``MissingPath`` (a file
    operation answers it 404)."""
    return bad_mount(subject, given, resolved, f"does not exist on the target{what}")


def protected_path(subject: str, given: str, resolved: str | None, why: str) -> Refusal:
    return _refused(
        "protected-path",
        subject,
        given,
        resolved,
        f"{resolved or given} {why}, which runs later outside any fence, so no file operation "
        "writes it; change it with a turn if you must (where it stays read-only or is audited), "
        "or leave it out",
    )


def protected_mount(subject: str, given: str, resolved: str, member: str) -> Refusal:
    return _refused(
        "protected-path",
        subject,
        given,
        resolved,
        f"{resolved} {'is' if resolved == member else 'lies inside'} {member}, which stays "
        "read-only in every writable mount (it runs later, outside any fence); ask for a "
        "directory outside it",
    )


def bad_archive(member: str | None, why: str) -> Refusal:
    where = f"member {member!r}" if member else "the archive"
    return _refused(
        "bad-archive",
        "archive",
        member,
        None,
        f"{where} {why}; nothing was extracted. Send a tar whose members are plain files, "
        "directories and links that stay inside the directory",
    )


def file_too_large(subject: str, given: str, size: int, limit_mb: int, role: str) -> Refusal:
    return _refused(
        "limit-exceeds-role",
        "limits.file_mb",
        given,
        None,
        f"{subject} is {_mib(size)}, above role {role!r}'s file_mb of {limit_mb} MiB; "
        "move less at once, or have the operator raise [roles.NAME.limits] file_mb",
    )


def _mib(size: int) -> str:
    return f"{size} bytes" if size < 1 << 20 else f"{size / (1 << 20):.1f} MiB"


def unreachable_for_role(
    subject: str, given: str, resolved: str, directory: str, uid: int, mode: int
) -> Refusal:
    return _refused(
        "bad-mount",
        subject,
        given,
        resolved,
        f"the turn runs as uid {uid}, which cannot search {directory} (mode {mode:04o}) to "
        f"reach {resolved}; the operator can let it through (chmod o+x {directory}), or "
        "use a directory the role can reach",
    )


def shut_to_role(subject: str, directory: str, held: str, uid: int, mode: int) -> Refusal:
    """Something to keep read-only lies in a directory the turn's uid owns but may not search."""
    return _refused(
        "bad-mount",
        subject,
        directory,
        directory,
        f"{held} must stay as it is (what is there runs later, outside any fence), but "
        f"{directory} is closed to uid {uid}, which owns it (mode {mode:04o}): bubblewrap, "
        "running as that uid, cannot mount over what is inside, and the turn could open it "
        f"and change it; let the role search it (chmod u+x {directory}), or move it out of "
        "the writable mount",
    )


def bad_managed_entry(subject: str, given: str, why: str) -> Refusal:
    return _refused(
        "bad-mount",
        subject,
        given,
        None,
        f"{why}; the operator must fix the role's home entry (paddock-target config check "
        "names every one)",
    )


def abnormal_destination(subject: str, given: str) -> Refusal:
    return _refused(
        "bad-mount",
        subject,
        given,
        None,
        f"the place inside the fence, {given!r}, is not a normal absolute path; "
        "write it without '.', '..', '//' or a trailing '/'",
    )


def too_many_directories(subject: str, given: str, resolved: str, limit: int) -> Refusal:
    return _refused(
        "bad-mount",
        subject,
        given,
        resolved,
        f"{resolved} holds more than {limit} directories, so not every repository and "
        "protected file in it can be checked; ask for a narrower writable directory, or have "
        "the operator raise [fence] scan_limit",
    )


def untrusted_path_dir(directory: str, why: str) -> Refusal:
    return _refused(
        "untrusted-executable",
        "fence.path",
        directory,
        directory,
        f"{directory}, on the fence's PATH, {why}; the operator must make it writable only by "
        "root or the service user, or take it off [fence] path",
    )


def not_found(name: str, where: str) -> Refusal:
    return _refused(
        "not-found",
        "argv[0]",
        name,
        None,
        f"{name!r} was not found {where}; give a program installed on the target, "
        "or its absolute path",
    )


def not_executable(given: str, resolved: str, why: str) -> Refusal:
    return _refused("not-executable", "argv[0]", given, resolved, f"{resolved} {why}")


def untrusted_executable(given: str, resolved: str, why: str) -> Refusal:
    return _refused(
        "untrusted-executable",
        "argv[0]",
        given,
        resolved,
        f"{why}; install the program somewhere only root or the service user can write",
    )


def digest_mismatch(expected: str, actual: str) -> Refusal:
    return _refused(
        "digest-mismatch",
        "script_sha256",
        None,
        None,
        f"the script's sha256 is {actual}, not {expected}; send the digest of the exact body",
    )


def reserved_env(name: str) -> Refusal:
    return _refused(
        "reserved-env",
        f"env.{name}",
        None,
        None,
        f"{name} is reserved: names starting PADDOCK_ are set by the target; remove it",
    )


def invalid_env(name: str, why: str) -> Refusal:
    return _refused(
        "invalid-env", f"env.{name}", None, None, f"environment variable {name!r} {why}"
    )


def network_not_allowed(role: str) -> Refusal:
    return _refused(
        "network-not-allowed",
        "network",
        None,
        None,
        f'role {role!r} does not allow network access; ask for network "none" '
        "(paddock run: drop --net), or have the operator set allow_network for the role",
    )


def limit_exceeds_role(name: str, asked: float, maximum: float) -> Refusal:
    return _refused(
        "limit-exceeds-role",
        f"limits.{name}",
        None,
        None,
        f"limits.{name} = {asked:g} is above the role's maximum of {maximum:g}; "
        "ask for at most that",
    )


def limit_exceeds_session(name: str, asked: float, maximum: float) -> Refusal:
    return _refused(
        "limit-exceeds-role",
        f"limits.{name}",
        None,
        None,
        f"limits.{name} = {asked:g} is above its session's {maximum:g} (set when the session "
        "was started); ask for at most that, or start a session with more",
    )


def identity_unavailable(role: str, detail: str) -> Refusal:
    return _refused("backend-unavailable", "role", None, None, f"role {role!r}: {detail}")


def no_terminal(helper: str, why: str) -> Refusal:
    return _refused(
        "backend-unavailable",
        "tty",
        helper,
        None,
        f"a terminal turn needs util-linux {helper} inside the fence, and: {why}; install "
        "util-linux on the target, or run the turn without a terminal",
    )


def no_session_host(program: str, why: str) -> Refusal:
    return _refused(
        "backend-unavailable",
        "session",
        program,
        None,
        f"a session needs the fence's {program} (its host runs in python3, its shell is bash), "
        f"and: {why}; install {program} on the target (in a directory of [fence] path), or run "
        "turns without a session",
    )


def backend_unavailable(detail: str) -> Refusal:
    return _refused("backend-unavailable", "fence", None, None, detail)


def path_changed(
    subject: str, given: str | None, resolved: str | None, seen: str | None = None
) -> Refusal:
    what = resolved or "a mounted path"
    how = seen or "a component became a symlink or was replaced"
    return _refused(
        "path-changed",
        subject,
        given,
        resolved,
        f"{what} changed between the check and the mount ({how}); "
        "retry, and find out what is rewriting it",
    )


def stale_lease(subject: str, detail: str) -> Refusal:
    """The lease named is not its seat's current, held generation (or none was named)."""
    return _refused("stale-lease", subject, None, None, detail)


def _refused(
    rule: str, subject: str, path: str | None, resolved: str | None, detail: str
) -> Refusal:
    return Refusal.model_validate(
        {"rule": rule, "subject": subject, "path": path, "resolved": resolved, "detail": detail}
    )
