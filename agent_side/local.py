"""The embedded target behind ``paddock run --local``: real TLS, real token, on loopback.

Everything it makes lives in one private temporary directory (searchable,
never listable), removed when the context ends: the TLS key, the CA to trust,
the state root. The token exists only in memory; the target holds just its
sha256.

Run as root, its role's turns act as a uid of their own, as on any target.
Run as anyone else, the embedded target is that person's own, and no uid
but theirs is theirs to give: its turns run as them (``identity =
"server"``), inside the same fence, and a note says so.

This is the only agent-side module that imports ``target_side``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent_side.sha256 import sha256_hex
from agent_side.views import say
from target_side.config import FenceConfig, RoleConfig, ServerConfig, Settings
from target_side.service.server import ServerThread
from target_side.tools.tls import make_tls_material, write_tls_files

LOCAL_ROLE = "default"
"""The embedded target's one role."""


@dataclass(frozen=True)
class LocalTarget:
    """Where the embedded target listens and how to reach it."""

    url: str
    token: str = field(repr=False)
    cacert: str
    workspace: str


@contextlib.contextmanager
def local_target(workspace: str | None = None) -> Iterator[LocalTarget]:
    """Run an embedded target whose one role, ``default``, may work in ``workspace``.

    ``workspace`` defaults to the current directory, resolved physically.
    """
    workspace = os.path.realpath(workspace or os.getcwd())
    root = Path(tempfile.mkdtemp(prefix="paddock-local-", dir=_private_parent(workspace)))
    try:
        # Searchable, not listable: turns run as a uid of their own and reach their home
        # below it by path; everything in it is private (keys 0600, state 0700 inside).
        os.chmod(root, 0o711)  # noqa: S103 - searchable by design, never listable
        token = secrets.token_urlsafe(32)
        settings = _settings(root, workspace, sha256_hex(token.encode()))
        if settings.fence.identity == "server":
            say(
                "note: not run as root, so the embedded target's turns run as you "
                "(still fenced); as root each role gets a uid of its own"
            )
        with ServerThread(settings) as server:
            yield LocalTarget(
                url=server.url, token=token, cacert=str(root / "ca.pem"), workspace=workspace
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _settings(root: Path, workspace: str, token_sha256: str) -> Settings:
    files = write_tls_files(root, make_tls_material(["127.0.0.1"]))
    return Settings(
        server=ServerConfig(
            listen="127.0.0.1:0",
            tls_cert=str(files.cert_chain),
            tls_key=str(files.key),
            state_root=str(root / "state"),
        ),
        roles={LOCAL_ROLE: RoleConfig(token_sha256=token_sha256, workspaces=(workspace,))},
        fence=FenceConfig(identity="per-role" if os.getuid() == 0 else "server"),
    )


def _private_parent(workspace: str) -> str:
    """A directory for the private root that the workspace does not contain.

    The fence refuses to mount a workspace that holds the target's own key store
    (a ``parent`` conflict), so running from ``/tmp`` needs the root elsewhere.
    """
    # mkdtemp makes a fresh 0700 directory inside, so a shared parent is safe to use.
    shared = ["/var/tmp", "/dev/shm"]  # noqa: S108
    candidates = [tempfile.gettempdir(), *shared, str(Path.home() / ".cache")]
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if (
            os.path.isdir(real)
            and os.access(real, os.W_OK | os.X_OK)
            and not _inside(real, workspace)
        ):
            return real
    return tempfile.gettempdir()


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
