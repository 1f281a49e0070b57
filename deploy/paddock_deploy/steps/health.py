"""Step 10: ``GET /v1/health`` over TLS, verified against the CA made here (an operator's
certificate is pinned instead), retried until ``--health-timeout``."""

from __future__ import annotations

import http.client
import json
import ssl
import time
from typing import Any

from paddock_deploy.addresses import health_host, split_listen
from paddock_deploy.context import Context, Outcome
from paddock_deploy.errors import DeployError
from paddock_deploy.protocol import certificate_sha256, der_sha256
from paddock_deploy.steps.release import current_release


def run(ctx: Context) -> Outcome:
    url, body = wait_healthy(ctx, ctx.opts.health_timeout)
    ctx.health = body
    causes = body.get("causes", [])
    said = "; ".join(f"{c.get('cause')}: {c.get('detail')}" for c in causes)
    state = body.get("status", "?")
    detail = f"{url}/v1/health says {state} (version {body.get('version')})"
    if said:
        detail += f" -- {said}; run 'paddock-target doctor' for what to do"
    return Outcome(False, detail)


def base_url(ctx: Context) -> tuple[str, str, int]:
    host, port = split_listen(ctx.listen)
    host = health_host(host)
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if ctx.cert_file is not None else "http"  # plain only on loopback
    return f"{scheme}://{shown}:{port}", host, port


def tls_context(ctx: Context) -> tuple[ssl.SSLContext, str | None]:
    """Verify against the CA made here; an operator's certificate is pinned instead."""
    if ctx.ca_file is not None:
        return ssl.create_default_context(cafile=str(ctx.ca_file)), None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the pin below is the check: exact certificate match
    pin = None
    if ctx.cert_file is not None:
        pin = certificate_sha256(ctx.cert_file.read_text())
    return context, pin


def get_health(ctx: Context) -> dict[str, Any]:
    url, host, port = base_url(ctx)
    conn: http.client.HTTPConnection
    pin = None
    if ctx.cert_file is None:
        conn = http.client.HTTPConnection(host, port, timeout=5)
    else:
        context, pin = tls_context(ctx)
        conn = http.client.HTTPSConnection(host, port, context=context, timeout=5)
    try:
        conn.connect()
        if pin is not None:
            sock = conn.sock
            der = None
            if isinstance(sock, ssl.SSLSocket):
                der = sock.getpeercert(binary_form=True)
            if der is None or der_sha256(der) != pin:
                raise DeployError(f"{url} presented a certificate other than {ctx.cert_file}")
        conn.request("GET", "/v1/health")
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise DeployError(f"{url}/v1/health answered HTTP {response.status}")
    body: dict[str, Any] = json.loads(data)
    if body.get("status") not in {"armed", "degraded"}:
        raise DeployError(f"{url}/v1/health answered something else: {data[:200]!r}")
    return body


def wait_healthy(ctx: Context, timeout: float) -> tuple[str, dict[str, Any]]:
    url = base_url(ctx)[0]
    started = time.monotonic()
    deadline = started + timeout
    last = "no answer"
    while True:
        try:
            return url, get_health(ctx)
        except (OSError, ssl.SSLError, http.client.HTTPException, ValueError, DeployError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise DeployError(
                f"{url}/v1/health did not answer within {timeout:.0f}s "
                f"(last: {last}); see the server log"
            )
        time.sleep(0.3)


def check_previous(ctx: Context) -> str | None:
    """After a rollback: is the previous install serving again?"""
    if not ctx.was_running or not ctx.listen:
        return None
    try:
        body = wait_healthy(ctx, 30)[1]
    except DeployError as exc:
        return f"the previous install does NOT answer: {exc}"
    release = current_release(ctx.current_link)
    name = release.name if release else "?"
    return f"the previous install (release {name}) is serving again, health {body.get('status')}"
