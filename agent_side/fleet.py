"""``paddock deploy HOST1 HOST2 ...`` and ``--inventory FILE``: many hosts at once.

    every host checked here first (destination, name, options), then, at most
    --parallel at a time, each one deployed as ``paddock deploy HOST`` does it:
        connect (host key, login) -> the shared wheel and script -> upload, run, store
    the wheel is built once, by the first host to need it, and shared: the same
        sources make the same wheel, so a host already on it has nothing to do
    each host's lines are prefixed with its name (in --json, a "host" field)
    one host failing (and rolling back, as the script does) stops no other
    a summary table: host, result, failed step, release, seconds

The exit status is the worst host's: 0 when every host is deployed or
unchanged; otherwise, from least to most worrying, 2 (refused, nothing
changed), 1 (failed, rolled back), 130 (interrupted), 125 (paddock failed:
the state of that host is unknown), 3 (rollback incomplete: the host needs a
look).

An inventory is TOML; a table per host, keys named as the command line's
long options, repeated options as lists:

    [defaults]                       # for every host
    role = ["builder"]
    python = "/usr/bin/python3"

    [hosts."build-1"]                # the name the target is stored under
    ssh = "root@10.0.0.5"            # where to reach it (default: the name)
    listen = "127.0.0.1:8443"

    [hosts."build-2"]
    ssh = "admin@10.0.0.6:2222"
    identity = ["~/.ssh/fleet"]
    route = "https"

A host's own table wins over the command line, which wins over [defaults].
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_side.deploy import (
    INTERRUPTED,
    DeployRequest,
    HostPlan,
    HostRun,
    SharedFiles,
    _Progress,
    deploy,
    plan_host,
    script_options,
)
from agent_side.errors import AgentError, UsageError
from agent_side.ssh import PassphraseSource
from agent_side.views import visible
from paddock_deploy.protocol import PASSED_OPTIONS, Exit
from shared.exit_status import ExitStatus

DEFAULT_PARALLEL = 4
SEVERITY = (
    Exit.OK,
    Exit.REFUSED,
    Exit.ROLLED_BACK,
    INTERRUPTED,
    int(ExitStatus.PADDOCK_FAILED),
    Exit.ROLLBACK_INCOMPLETE,
)
"""Exit statuses from the least to the most worrying: the fleet exits with the worst."""
RESULTS = {
    Exit.ROLLED_BACK: "rolled back",
    Exit.REFUSED: "refused",
    Exit.ROLLBACK_INCOMPLETE: "ROLLBACK INCOMPLETE",
    INTERRUPTED: "interrupted",
}
LISTS = frozenset(
    {"role", "identity", "known-hosts"}
    | {option.flag.removeprefix("--") for option in PASSED_OPTIONS if option.repeated}
)
"""Inventory keys whose value is a list (the command line's repeatable options)."""
SINGLE = frozenset(
    {"route", "python", "fail-at"}
    | {option.flag.removeprefix("--") for option in PASSED_OPTIONS if not option.repeated}
)
HOST_ONLY = frozenset({"ssh", "url"})
"""Keys that name one host, so they belong in its own table, never in [defaults]."""


# --- what to deploy where -------------------------------------------------------------------


@dataclass(frozen=True)
class Shared:
    """What every host shares: the files to upload, and how to show progress."""

    wheel: Path | None = None
    wheelhouse: Path | None = None
    script: Path | None = None
    as_json: bool = False


def requests_for(
    destinations: Sequence[str],
    inventory: Path | None,
    given: Mapping[str, Any],
    shared: Shared,
    name: str | None = None,
) -> list[DeployRequest]:
    """One ``DeployRequest`` per host: the positional ones, then the inventory's.

    ``given`` holds the options given on the command line, by their inventory
    key (``role``, ``listen``, ``fail-at``, ...); ``name`` is ``--name``, for
    one host only.
    """
    hosts: list[tuple[str | None, Mapping[str, Any]]] = [(name, {"ssh": d}) for d in destinations]
    defaults: Mapping[str, Any] = {}
    if inventory is not None:
        defaults, tables = read_inventory(inventory)
        hosts += [(host, {"ssh": host, **table}) for host, table in tables.items()]
    if not hosts:
        raise UsageError("name a host to deploy (USER@HOST[:PORT]), or give --inventory FILE")
    if name is not None and len(hosts) > 1:
        raise UsageError("--name names one host's target; with several, name them in --inventory")
    if given.get("url") is not None and len(hosts) > 1:
        raise UsageError("--url is one host's listener; with several, give url in --inventory")
    return [
        _request({**defaults, **given, **table}, host_name, shared) for host_name, table in hosts
    ]


def _request(values: Mapping[str, Any], name: str | None, shared: Shared) -> DeployRequest:
    route = values.get("route") or "ssh"
    if route not in ("ssh", "https"):
        raise UsageError(f'{values["ssh"]}: route {route!r}: give "ssh" or "https"')
    if values.get("url") is not None and route != "https":
        raise UsageError(f"{values['ssh']}: url names a direct route: give route https too")
    pairs: list[tuple[str, str | None]] = []
    for option in PASSED_OPTIONS:
        value = values.get(option.flag.removeprefix("--"))
        if option.repeated:
            pairs += [(option.flag, v) for v in value or ()]
        else:
            pairs.append((option.flag, value))
        if option.choices and value is not None and value not in option.choices:
            raise UsageError(f"{option.flag} {value!r}: one of {', '.join(option.choices)}")
    return DeployRequest(
        destination=values["ssh"],
        roles=tuple(values.get("role") or ()),
        identity_files=tuple(values.get("identity") or ()),
        known_hosts=tuple(values.get("known-hosts") or ()),
        script_options=script_options(pairs, values.get("fail-at")),
        name=name,
        route=route,
        url=values.get("url"),
        wheel=shared.wheel,
        wheelhouse=shared.wheelhouse,
        script=shared.script,
        python=values.get("python") or "python3",
        as_json=shared.as_json,
    )


def read_inventory(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``[defaults]`` and each ``[hosts.NAME]`` of ``path``, every key and value checked."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"--inventory {path}: cannot read it: {exc}") from exc
    unknown = sorted(set(data) - {"defaults", "hosts"})
    if unknown:
        raise UsageError(
            f"{path}: unknown key {unknown[0]!r}; only [defaults] and [hosts.NAME] belong"
        )
    defaults = _table(path, "defaults", data.get("defaults", {}), host=False)
    hosts = data.get("hosts", {})
    if not isinstance(hosts, dict) or not hosts:
        raise UsageError(f"{path}: no [hosts.NAME] table; add one per host to deploy")
    tables = {name: _table(path, f"hosts.{name}", hosts[name], host=True) for name in hosts}
    return defaults, tables


def _table(path: Path, where: str, table: Any, *, host: bool) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise UsageError(f"{path} [{where}] is not a table")
    allowed = LISTS | SINGLE | (HOST_ONLY if host else frozenset())
    for key, value in table.items():
        if key in HOST_ONLY and not host:
            raise UsageError(f"{path} [{where}]: {key!r} names one host; put it in its table")
        if key not in allowed:
            known = ", ".join(sorted(allowed))
            raise UsageError(f"{path} [{where}]: unknown key {key!r} (known: {known})")
        if key in LISTS:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UsageError(f'{path} [{where}]: {key} must be a list ({key} = ["..."])')
        elif not isinstance(value, str):
            raise UsageError(f'{path} [{where}]: {key} must be a string ({key} = "...")')
    return table


# --- deploying them ------------------------------------------------------------------------


@dataclass(frozen=True)
class HostResult:
    """One line of the summary table."""

    name: str
    destination: str
    status: int
    result: str
    failed_step: str | None
    release: str | None
    seconds: float

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.name,
            "destination": self.destination,
            "exit_code": self.status,
            "result": self.result,
            "failed_step": self.failed_step,
            "release": self.release,
            "seconds": round(self.seconds, 1),
        }


def deploy_fleet(
    requests: Sequence[DeployRequest],
    environ: Mapping[str, str],
    passphrase: PassphraseSource | None,
    *,
    parallel: int = DEFAULT_PARALLEL,
) -> int:
    """Deploy every request, ``parallel`` at a time; the worst host's exit status.

    One request is ``paddock deploy HOST`` exactly (no prefix, no table).
    """
    if parallel < 1:
        raise UsageError("--parallel must be at least 1")
    if len(requests) == 1:
        return deploy(requests[0], environ, passphrase)
    asking = _one_prompt_at_a_time(passphrase)
    plans = [plan_host(request, asking) for request in requests]
    _refuse_duplicates(plans)
    as_json = requests[0].as_json
    with tempfile.TemporaryDirectory(prefix="paddock-deploy-") as scratch:
        files = SharedFiles.checked(requests[0], Path(scratch))
        runs = [HostRun(plan, _Progress(as_json, sys.stdout, host=plan.name)) for plan in plans]
        results = _run_all(runs, files, environ, parallel)
    _summary(results, as_json)
    return worst(result.status for result in results)


def worst(statuses: Any) -> int:
    """The most worrying of ``statuses`` (``SEVERITY``; one it does not know counts as 125)."""
    ranked = [SEVERITY.index(s) if s in SEVERITY else SEVERITY.index(125) for s in statuses]
    return int(SEVERITY[max(ranked, default=0)])


def _one_prompt_at_a_time(source: PassphraseSource | None) -> PassphraseSource | None:
    if source is None:
        return None
    lock = threading.Lock()

    def ask(path: str) -> str | None:
        with lock:  # hosts connecting side by side must not prompt over each other
            return source(path)

    return ask


def _refuse_duplicates(plans: Sequence[HostPlan]) -> None:
    seen: dict[str, str] = {}
    for plan in plans:
        if plan.name in seen:
            raise UsageError(
                f"{seen[plan.name]} and {plan.request.destination} would both be stored as "
                f"target {plan.name!r}; name them apart in --inventory ([hosts.NAME])"
            )
        seen[plan.name] = plan.request.destination


def _run_all(
    runs: Sequence[HostRun], files: SharedFiles, environ: Mapping[str, str], parallel: int
) -> list[HostResult]:
    stop = threading.Event()

    def one(run: HostRun) -> HostResult:
        started = time.monotonic()
        if stop.is_set():
            return _result(run, INTERRUPTED, 0.0)
        try:
            status = run.run(files, environ)
        except (AgentError, OSError) as exc:
            label = exc.label if isinstance(exc, AgentError) else "error"
            run.progress.warn(f"{label}: {exc}")
            status = int(ExitStatus.PADDOCK_FAILED)
        finally:
            run.close()
        if stop.is_set() and status == ExitStatus.PADDOCK_FAILED:
            status = INTERRUPTED
        return _result(run, status, time.monotonic() - started)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="host")
    futures = [pool.submit(one, run) for run in runs]
    try:
        concurrent.futures.wait(futures)
    except KeyboardInterrupt:
        stop.set()
        for run in runs:
            run.progress.warn("interrupted: the target rolls back when it next reports progress")
            # A closed session makes the script's next progress line fail: it rolls back.
            run.close()
        concurrent.futures.wait(futures)
    finally:
        pool.shutdown(wait=True)
    return [future.result() for future in futures]


def _result(run: HostRun, status: int, seconds: float) -> HostResult:
    outcome = run.progress.outcome.result or {}
    plan = run.plan
    if status == Exit.OK:
        word = "deployed" if outcome.get("changed") else "unchanged"
        return HostResult(
            plan.name, plan.request.destination, status, word, None, outcome.get("release"), seconds
        )
    step = outcome.get("failed_step")
    if step is None and status in (ExitStatus.PADDOCK_FAILED, INTERRUPTED):
        step = run.phase  # paddock's own stage: connect, build, upload, script, store
    word = RESULTS.get(status, "failed")
    return HostResult(plan.name, plan.request.destination, status, word, step, None, seconds)


def _summary(results: Sequence[HostResult], as_json: bool) -> None:
    if as_json:
        record = {
            "event": "summary",
            "hosts": [r.as_json() for r in results],
            "exit_code": worst(r.status for r in results),
        }
        print(json.dumps(record), flush=True)
        return
    rows = [("HOST", "RESULT", "FAILED STEP", "RELEASE", "SECONDS")]
    rows += [
        (r.name, r.result, r.failed_step or "-", r.release or "-", f"{r.seconds:.1f}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(flush=True)
    for row in rows:
        line = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(visible(line.rstrip()), flush=True)
