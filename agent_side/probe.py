"""What a listener speaks, TLS or plain HTTP: asked only after a first exchange failed.

An ``http://`` URL for a listener that serves HTTPS fails as a dropped
connection (the server hangs up on bytes that are not a TLS handshake), which
the client would retry for its whole budget; ``https://`` for a plain listener
fails as an unexplained TLS error. One short probe over the same route (a
direct socket, or a channel of the SSH connection) tells the two apart, so the
user hears the fix at once. Neither probe sends the token.
"""

from __future__ import annotations

import ssl

import httpcore

PROBE_TIMEOUT_S = 5.0

_PROBE_FAILURES = (httpcore.NetworkError, httpcore.TimeoutException, OSError, ssl.SSLError)


def speaks_tls(
    backend: httpcore.NetworkBackend, host: str, port: int, timeout: float = PROBE_TIMEOUT_S
) -> bool:
    """Whether ``host:port`` completes a TLS handshake; nothing is sent after it."""
    # Unverified on purpose: the question is only whether TLS answers at all.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        stream = backend.connect_tcp(host, port, timeout=timeout)
    except _PROBE_FAILURES:
        return False
    try:
        stream = stream.start_tls(context, server_hostname=None, timeout=timeout)
    except _PROBE_FAILURES:
        return False
    finally:
        stream.close()
    return True


def speaks_plain_http(
    backend: httpcore.NetworkBackend, host: str, port: int, timeout: float = PROBE_TIMEOUT_S
) -> bool:
    """Whether ``host:port`` answers a plain-text HTTP request (the health route, no token)."""
    try:
        stream = backend.connect_tcp(host, port, timeout=timeout)
    except _PROBE_FAILURES:
        return False
    try:
        stream.write(
            f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode(),
            timeout=timeout,
        )
        return stream.read(5, timeout=timeout) == b"HTTP/"
    except _PROBE_FAILURES:
        return False
    finally:
        stream.close()
