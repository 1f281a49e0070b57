"""Section ``files``: moving files through the file API vs through turns (``cat``).

Before ``/v1/files`` the only way to move a file was a turn: ``cat FILE`` to
fetch it (its bytes come back as output events, base64 where not UTF-8), and
``cat > FILE`` with the body sent to the turn's stdin (at most 1 MiB a
request). Rows run interleaved, one run of each per round, against one target
process over HTTPS, through the Python API (``Target.https``, one pool).
"""

from __future__ import annotations

import base64
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from agent_side.api import Target
from bench.common import MIB, Samples, ms, ratio, render_table
from bench.targets import ROLE, TargetInfo, target_process
from shared.wire import OutputEvent, TurnRequest
from target_side.config import RoleConfig, Settings

BIG = 10 * MIB
SMALL = 1024
TREE_FILES = 200
TREE_FILE_BYTES = 16 * 1024
STDIN_CHUNK = 1 * MIB - 1024
"""What one stdin request may carry (the body limit is 1 MiB)."""


def run(runs: int) -> str:
    with target_process() as target, target.https() as api:
        place = _role_directory(target)
        data = os.urandom(BIG)
        (place / "big").write_bytes(data)
        _own(place / "big")
        small = os.urandom(SMALL)
        rows = _rows(api, place, data, small)
        samples = _measure(rows, runs)
    cat = samples["GET 10 MiB: cat turn"].p50
    put_cat = samples["PUT 10 MiB: cat > file turn, stdin"].p50
    true = samples["turn: true"].p50
    table = []
    for name, found in samples.items():
        size = BIG if "10 MiB" in name else None
        rate = f"{size / MIB / found.p50:.0f}" if size else "-"
        base = put_cat if name.startswith("PUT 10") else cat if "10 MiB" in name else true
        table.append((name, ms(found.p50), ms(found.p95), rate, ratio(found.p50, base)))
    title = (
        f"7. Files: the file API vs turns ({runs} runs each, interleaved; "
        "x base: 10 MiB rows against their cat turn, the rest against a turn of true)"
    )
    return render_table(title, ("row", "p50 ms", "p95 ms", "MiB/s", "x base"), table)


def _rows(api: Target, place: Path, data: bytes, small: bytes) -> dict[str, Callable[[], object]]:
    tree = Path(tempfile.mkdtemp(prefix="paddock-bench-tree-"))
    for i in range(TREE_FILES):
        (tree / f"d{i % 10}").mkdir(exist_ok=True)
        (tree / f"d{i % 10}" / f"f{i}").write_bytes(os.urandom(TREE_FILE_BYTES))
    fetched = Path(tempfile.mkdtemp(prefix="paddock-bench-fetched-"))

    def check(got: bytes, want: bytes) -> None:
        if got != want:
            raise RuntimeError("the bytes that came back are not the bytes sent")

    def cat_turn() -> None:
        result = api.run(["cat", str(place / "big")])
        check(result.stdout, data)

    def stdin_turn() -> None:
        _upload_by_turn(api, place / f"up-{uuid.uuid4().hex}", data)

    return {
        "GET 10 MiB: read_file": lambda: check(api.read_file(str(place / "big")), data),
        "GET 10 MiB: cat turn": cat_turn,
        "PUT 10 MiB: write_file": lambda: api.write_file(str(place / "put"), data) and None,
        "PUT 10 MiB: cat > file turn, stdin": stdin_turn,
        "PUT 1 KiB: write_file": lambda: api.write_file(str(place / "small"), small) and None,
        "GET 1 KiB: read_file": lambda: api.read_file(str(place / "small")) and None,
        "list a directory: list_dir": lambda: api.list_dir(str(place)) and None,
        "turn: true": lambda: api.run(["true"]) and None,
        f"put_dir ({TREE_FILES} x 16 KiB)": lambda: (
            api.put_dir(str(tree), str(place / "tree")) and None
        ),
        f"get_dir ({TREE_FILES} x 16 KiB)": lambda: (
            api.get_dir(str(place / "tree"), str(fetched / uuid.uuid4().hex)) and None
        ),
    }


def _measure(rows: dict[str, Callable[[], object]], runs: int) -> dict[str, Samples]:
    for row in rows.values():
        row()  # warm-up, and what the later rows read must exist
    found: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(runs):
        for name, row in rows.items():
            started = time.perf_counter()
            row()
            found[name].append(time.perf_counter() - started)
    return {name: Samples(tuple(values)) for name, values in found.items()}


def _upload_by_turn(api: Target, path: Path, data: bytes) -> None:
    """The way before the file API: a ``cat > FILE`` turn, its stdin fed 1 MiB at a time."""
    client = api.client
    request = TurnRequest(role=ROLE, argv=["sh", "-c", f"cat > {path}"], stdin="open")
    turn = client.submit(request)
    view = memoryview(data)
    while view:
        chunk, view = view[:STDIN_CHUNK], view[STDIN_CHUNK:]
        client.write_stdin(turn.turn_id, bytes(chunk), eof=not view)
    for event in client.follow(turn.turn_id):
        if isinstance(event, OutputEvent) and event.data_b64:
            base64.b64decode(event.data_b64)


def _role_directory(target: TargetInfo) -> Path:
    """A directory of the role's own in the workspace (the role's uid writes there)."""
    place = Path(target.workspace) / "files-bench"
    place.mkdir()
    _own(place)
    return place


def _own(path: Path) -> None:
    settings = Settings(roles={ROLE: RoleConfig(token_sha256="0" * 64, workspaces=("/",))})
    os.chown(path, *settings.role_ids(ROLE))
