"""TLS material for a target: a private CA and a server certificate signed by it.

Used by ``paddock-target tls init``, the embedded ``--local`` target and the
deploy script. The agent pins the CA certificate (or its fingerprint); the CA
key is not kept, so a new certificate comes with a new CA.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=825)


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes: the CA certificate to trust, and the server's chain and key."""

    ca_cert_pem: bytes
    cert_chain_pem: bytes
    key_pem: bytes

    @property
    def ca_fingerprint(self) -> str:
        """SHA-256 of the CA certificate (DER), as colon-separated hex."""
        cert = x509.load_pem_x509_certificate(self.ca_cert_pem)
        return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def make_tls_material(hosts: list[str], now: dt.datetime | None = None) -> TlsMaterial:
    """A fresh CA and a server certificate valid for ``hosts`` (names or IP addresses)."""
    now = now or dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "paddock target CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = (
        _builder(subject, ca_name, key.public_key(), now)
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return TlsMaterial(
        ca_cert_pem=ca_cert.public_bytes(pem),
        cert_chain_pem=cert.public_bytes(pem) + ca_cert.public_bytes(pem),
        key_pem=key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, now: dt.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


@dataclass(frozen=True)
class TlsFiles:
    """Where ``write_tls_files`` put the material."""

    ca_cert: Path
    cert_chain: Path
    key: Path


def write_tls_files(directory: Path, material: TlsMaterial) -> TlsFiles:
    """``ca.pem`` and ``cert.pem`` (0644) and ``key.pem`` (0600) in ``directory``.

    Refuses (``FileExistsError``) before writing anything if one of them exists:
    a certificate in use is never replaced. ``directory`` is made (0755) if missing.
    """
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    planned = (
        (files.ca_cert, material.ca_cert_pem, 0o644),
        (files.cert_chain, material.cert_chain_pem, 0o644),
        (files.key, material.key_pem, 0o600),
    )
    for path, _, _ in planned:
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists already; remove it or choose another --dir")
    written: list[Path] = []
    try:
        for path, data, mode in planned:
            _write_new(path, data, mode)
            written.append(path)
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    return files


def _write_new(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL | O_NOFOLLOW: never write through a file (or symlink) someone placed there first.
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), mode)  # the umask may have narrowed the public files
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
