"""Step 5: the server's certificate and key: kept when they exist, else the operator's pair
or a CA and certificate made by the new release."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

from paddock_deploy.addresses import health_host, is_wildcard, split_listen
from paddock_deploy.context import Context, Outcome
from paddock_deploy.errors import DeployError
from paddock_deploy.files import restore, snapshot
from paddock_deploy.protocol import certificate_sha256, pem_certificates
from paddock_deploy.service_user import Account


def run(ctx: Context) -> Outcome:
    account = ctx.need_account()
    existing = ctx.existing
    if existing is not None:
        server = existing.get("server", {})
        if server.get("tls_cert") is None:
            return Outcome(
                False,
                f"nothing to do ({ctx.config_file} serves plain HTTP on loopback; no TLS to keep)",
            )
        cert, key = Path(server["tls_cert"]), Path(server["tls_key"])
    else:
        cert, key = ctx.tls_dir / "cert.pem", ctx.tls_dir / "key.pem"
    ctx.cert_file, ctx.key_file = cert, key
    ca = cert.parent / "ca.pem"
    ctx.ca_file = ca if ca.is_file() else None
    if cert.exists() or key.exists():
        if not (cert.is_file() and key.is_file()):
            raise DeployError(f"only one of {cert} and {key} exists; restore or remove it")
        fixed = fix_key(ctx, key, account)
        kept = f"kept the existing certificate {cert}"
        return Outcome(bool(fixed), f"{kept}; {fixed}" if fixed else f"nothing to do ({kept})")
    ctx.ensure_dir(cert.parent, 0o755, 0, 0)
    if ctx.opts.tls_cert is not None:
        return install_operator_pair(ctx, cert, key, account)
    return make_tls(ctx, cert, key, ca, account)


def fix_key(ctx: Context, key: Path, account: Account) -> str | None:
    """The server reads the key as the service user, and nobody else may."""
    st = key.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise DeployError(f"{key} is not a regular file")
    if (st.st_uid, stat.S_IMODE(st.st_mode) & 0o077) == (account.uid, 0):
        return None
    before = snapshot(key)
    ctx.tx.on_failure(f"owner and mode of {key}", lambda: restore(key, before))
    os.chown(key, account.uid, account.gid, follow_symlinks=False)
    os.chmod(key, 0o600)
    return f"{key} is now {account.name}'s, mode 0600"


def install_operator_pair(ctx: Context, cert: Path, key: Path, account: Account) -> Outcome:
    given_cert, given_key = Path(ctx.opts.tls_cert), Path(ctx.opts.tls_key)
    cert_pem = given_cert.read_text()
    if not pem_certificates(cert_pem):
        raise DeployError(f"{given_cert} holds no PEM certificate")
    ctx.write_new(cert, cert_pem.encode(), 0o644, 0, 0)
    ctx.write_new(key, given_key.read_bytes(), 0o600, account.uid, account.gid)
    return Outcome(
        True,
        f"installed the operator's certificate and key as {cert} and {key}; "
        f"certificate SHA-256 {certificate_sha256(cert_pem)}",
    )


def make_tls(ctx: Context, cert: Path, key: Path, ca: Path, account: Account) -> Outcome:
    hosts = certificate_hosts(ctx)
    code = (
        "import json, sys; from target_side.tools.tls import make_tls_material; "
        "m = make_tls_material(sys.argv[1:]); "
        "json.dump({'ca': m.ca_cert_pem.decode(), 'chain': m.cert_chain_pem.decode(), "
        "'key': m.key_pem.decode()}, sys.stdout)"
    )
    made = json.loads(
        ctx.run(
            [str(ctx.need_release() / "bin" / "python"), "-c", code, *hosts],
            show_stdout_on_error=False,
            what="making a CA and a server certificate",
        ).stdout
    )
    ctx.write_new(ca, made["ca"].encode(), 0o644, 0, 0)
    ctx.write_new(cert, made["chain"].encode(), 0o644, 0, 0)
    ctx.write_new(key, made["key"].encode(), 0o600, account.uid, account.gid)
    ctx.ca_file = ca
    return Outcome(
        True,
        f"made a CA and a server certificate for {', '.join(hosts)} "
        f"(key 0600, {account.name}); CA SHA-256 {certificate_sha256(made['ca'])}",
    )


def certificate_hosts(ctx: Context) -> list[str]:
    host = split_listen(ctx.listen)[0]
    hosts = [health_host(host), "127.0.0.1", "localhost", *ctx.opts.tls_host]
    if ":" in health_host(host):
        hosts.append("::1")
    hosts += [socket.gethostname(), socket.getfqdn()]
    return list(dict.fromkeys(h for h in hosts if h and not is_wildcard(h)))
