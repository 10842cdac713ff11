"""A throw-away PKI made at run time with `cryptography` (CAs, server and client
certificates, expired and wrong-host variants), written as PEM files into a directory."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


class CA:
    """A certificate authority that issues leaf certificates into ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.dir = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
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
            .sign(self.key, hashes.SHA256())
        )
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        file_stem: str,
        cn: str,
        *,
        hosts: tuple[str, ...] = (),
        dns_names: tuple[str, ...] = (),
        client: bool = False,
        expired: bool = False,
    ) -> Issued:
        """A leaf: a server certificate for ``hosts`` (IPs or DNS names) or, with ``client``,
        a client certificate; ``expired`` makes one that ended yesterday."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        start, end = (
            (now - dt.timedelta(days=10), now - dt.timedelta(days=1))
            if expired
            else (now - dt.timedelta(hours=1), now + dt.timedelta(days=7))
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        out = Issued(self.dir / f"{file_stem}.pem", self.dir / f"{file_stem}.key")
        out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out.key)
        return out


def serial_of(pem: bytes) -> int:
    """The serial number of a PEM or DER certificate (to tell two server certificates apart)."""
    if pem.startswith(b"-----"):
        return x509.load_pem_x509_certificate(pem).serial_number
    return x509.load_der_x509_certificate(pem).serial_number
