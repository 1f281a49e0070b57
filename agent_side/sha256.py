"""The agent side's SHA-256: names derived from routes, tokens, scripts and files.

``hashlib`` loads OpenSSL's library when imported (~3.5 ms of every ``paddock``
command); CPython's own SHA-256 module, which ``hashlib`` falls back to, loads
in microseconds and gives the same digests. Builds without it use ``hashlib``.
"""

from __future__ import annotations

# The private modules have no type stubs; each gives what hashlib.sha256 gives.
try:
    from _sha2 import sha256 as _sha256  # type: ignore[import-not-found]  # CPython 3.12+
except ImportError:
    try:
        from _sha256 import sha256 as _sha256  # type: ignore[import-not-found]  # 3.11
    except ImportError:
        from hashlib import sha256 as _sha256


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` as lowercase hex."""
    return _sha256(data).hexdigest()
