"""Bind what was checked: paths swapped between the check, the open and the launch.

Each test swaps a real path at one of the two seams of ``launch_turn``
(``check-to-open``: after the plan checked it, before it is opened;
``open-to-launch``: after it is held, before bubblewrap starts) and shows
that the swap is either refused as ``path-changed`` or not what the fence gets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme
from conftest import Target, launch_planned, local_settings, make_settings

from shared.walk import canonical_path
from shared.wire import TurnRequest
from target_side.config import FenceConfig, Settings
from target_side.errors import RefusedError
from target_side.fence.runner import Outcome
from target_side.policy.plan import plan_turn
from target_side.service.server import ServerThread


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return Path(canonical_path(tmp_path))


@pytest.fixture
def settings(root: Path) -> Settings:
    return local_settings(root)


async def _run(
    settings: Settings, request: dict[str, object], inject: Callable[[str], None]
) -> tuple[Outcome, str]:
    """Plan, build and launch one turn with ``inject`` at the seams; its outcome and stdout."""
    full = TurnRequest.model_validate({"role": "builder", **request})
    outcome, seen = await launch_planned(settings, full, inject=inject)
    return outcome, "".join(str(f.get("data", "")) for kind, f in seen if kind == "stdout")


def _at(step: str, action: Callable[[], None]) -> Callable[[str], None]:
    def hook(name: str) -> None:
        if name == step:
            action()

    return hook


def _shared_dir(root: Path, content: str) -> Path:
    shared = root / "shared"
    shared.mkdir()
    (shared / "marker").write_text(content)
    return shared


def _decoy(root: Path) -> Path:
    decoy = root / "decoy"
    decoy.mkdir()
    (decoy / "marker").write_text("decoy\n")
    return decoy


async def test_mount_swapped_for_symlink_before_open_is_path_changed(
    settings: Settings, root: Path
) -> None:
    shared, decoy = _shared_dir(root, "original\n"), _decoy(root)

    def swap() -> None:
        shared.rename(root / "shared-orig")
        shared.symlink_to(decoy)

    with pytest.raises(RefusedError) as refused:
        await _run(
            settings,
            {"argv": ["cat", f"{shared}/marker"], "fs": {"read": [str(shared)]}},
            _at("check-to-open", swap),
        )
    assert refused.value.refusal.rule == "path-changed"
    assert refused.value.refusal.subject == "fs.read[0]"


async def test_mount_replaced_by_another_directory_before_open_is_path_changed(
    settings: Settings, root: Path
) -> None:
    # No symlink anywhere: only the device and inode the plan recorded can tell.
    shared = _shared_dir(root, "original\n")

    def swap() -> None:
        shared.rename(root / "shared-orig")
        shared.mkdir()
        (shared / "marker").write_text("impostor\n")

    with pytest.raises(RefusedError) as refused:
        await _run(
            settings,
            {"argv": ["cat", f"{shared}/marker"], "fs": {"read": [str(shared)]}},
            _at("check-to-open", swap),
        )
    assert refused.value.refusal.rule == "path-changed"


async def test_mount_parent_swapped_for_symlink_before_open_is_path_changed(
    settings: Settings, root: Path
) -> None:
    # The mounted inode itself is unchanged; only a component above it became a symlink.
    outer = root / "outer"
    shared = outer / "shared"
    shared.mkdir(parents=True)
    (shared / "marker").write_text("original\n")

    def swap() -> None:
        outer.rename(root / "outer-moved")
        outer.symlink_to(root / "outer-moved")

    with pytest.raises(RefusedError) as refused:
        await _run(
            settings,
            {"argv": ["cat", f"{shared}/marker"], "fs": {"read": [str(shared)]}},
            _at("check-to-open", swap),
        )
    assert refused.value.refusal.rule == "path-changed"


async def test_mount_swapped_after_open_mounts_the_checked_inode(
    settings: Settings, root: Path
) -> None:
    shared, decoy = _shared_dir(root, "original\n"), _decoy(root)

    def swap() -> None:
        shared.rename(root / "shared-orig")
        shared.symlink_to(decoy)

    outcome, out = await _run(
        settings,
        {"argv": ["cat", f"{shared}/marker"], "fs": {"read": [str(shared)]}},
        _at("open-to-launch", swap),
    )
    assert (outcome.exit_code, out) == (0, "original\n")


def _tool(workspace: Path, body: str) -> Path:
    tool = workspace / "tool.sh"
    tool.write_text(f"#!/bin/sh\necho {body}\n")
    tool.chmod(0o755)
    return tool


async def test_executable_replaced_before_open_is_path_changed(
    settings: Settings, root: Path
) -> None:
    tool = _tool(root / "ws", "original")

    def swap() -> None:
        tool.rename(root / "ws" / "tool.orig")
        _tool(root / "ws", "swapped")

    with pytest.raises(RefusedError) as refused:
        await _run(settings, {"argv": [str(tool)]}, _at("check-to-open", swap))
    assert refused.value.refusal.rule == "path-changed"
    assert refused.value.refusal.subject == "argv[0]"


async def test_executable_replaced_after_open_runs_the_checked_inode(
    settings: Settings, root: Path
) -> None:
    tool = _tool(root / "ws", "original")

    def swap() -> None:
        tool.rename(root / "ws" / "tool.orig")
        _tool(root / "ws", "swapped")

    outcome, out = await _run(settings, {"argv": [str(tool)]}, _at("open-to-launch", swap))
    assert (outcome.exit_code, out) == (0, "original\n")


# --- D3: a shim planted in a world-writable PATH directory ------------------------------------


def _shim_dir(workspace: Path) -> Path:
    shims = workspace / "shims"
    shims.mkdir()
    shims.chmod(0o777)  # after mkdir: mkdir's own mode is masked by the umask
    shim = shims / "ls"
    shim.write_text("#!/bin/sh\necho SHIM EXECUTED\n")
    shim.chmod(0o755)
    return shims


def test_naive_resolver_runs_a_shim_from_a_world_writable_path_dir(root: Path) -> None:
    # The hole, shown first: resolve by name against a PATH that includes the planted dir.
    (root / "ws").mkdir()
    shims = _shim_dir(root / "ws")
    found = shutil.which("ls", path=f"{shims}:/usr/bin:/bin")
    assert found == f"{shims}/ls"
    ran = subprocess.run([found], capture_output=True, text=True, check=True)
    assert ran.stdout == "SHIM EXECUTED\n"


@pytest.fixture
def shim_target(root: Path, ca: trustme.CA) -> Iterator[Target]:
    base = make_settings(root / "t", ca)
    workspace = Path(base.roles["builder"].workspaces[0])
    shims = _shim_dir(workspace)
    settings = base.model_copy(update={"fence": FenceConfig(path=f"{shims}:/usr/bin:/bin")})
    ca_file = root / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with ServerThread(settings) as server:
        yield Target(server.url, str(ca_file), settings, workspace)


def test_shim_in_world_writable_fence_path_dir_is_refused(shim_target: Target) -> None:
    with shim_target.client() as client:
        response = client.post("/v1/turns", json={"role": "builder", "argv": ["ls"]})
    assert response.status_code == 201
    turn = response.json()
    assert turn["state"] == "refused"
    assert turn["exit_code"] == 126
    assert turn["refusal"]["rule"] == "untrusted-executable"
    assert "without the sticky bit" in turn["refusal"]["detail"]


def _refusal_rule(settings: Settings, argv: list[str]) -> str:
    try:
        plan_turn(TurnRequest(role="builder", argv=argv), settings, f"t-{uuid.uuid4().hex}")
    except RefusedError as exc:
        return exc.refusal.rule
    return "accepted"


def test_executable_owned_by_someone_else_is_refused(settings: Settings, root: Path) -> None:
    tool = _tool(root / "ws", "theirs")
    assert _refusal_rule(settings, [str(tool)]) == "accepted"
    os.chown(tool, 4321, 4321)
    assert _refusal_rule(settings, [str(tool)]) == "untrusted-executable"


def test_executable_in_a_directory_owned_by_someone_else_is_refused(
    settings: Settings, root: Path
) -> None:
    theirs = root / "ws" / "theirs"
    theirs.mkdir()
    tool = _tool(theirs, "in their dir")
    assert _refusal_rule(settings, [str(tool)]) == "accepted"
    os.chown(theirs, 4321, 4321)
    assert _refusal_rule(settings, [str(tool)]) == "untrusted-executable"


def test_group_writable_executable_is_refused(settings: Settings, root: Path) -> None:
    tool = _tool(root / "ws", "writable")
    tool.chmod(0o775)
    assert _refusal_rule(settings, [str(tool)]) == "untrusted-executable"


async def test_mount_source_unlinked_after_open_is_path_changed_not_a_backend_failure(
    settings: Settings, root: Path
) -> None:
    # What useradd does to /etc/passwd: a new file renamed over the old, whose inode is
    # now unlinked. bubblewrap cannot mount a deleted file by its descriptor and says so.
    data = root / "data.txt"
    data.write_text("original\n")

    def replace() -> None:
        fresh = root / "data.new"
        fresh.write_text("replacement\n")
        fresh.rename(data)

    outcome, _ = await _run(
        settings,
        {"argv": ["cat", str(data)], "fs": {"read": [str(data)]}},
        _at("open-to-launch", replace),
    )
    assert outcome.exit_code == 126
    assert outcome.refusal is not None
    assert outcome.refusal.rule == "path-changed"
    assert "bubblewrap" in outcome.refusal.detail
