"""Throwaway X.509 certificates for tests and the bench (`cryptography`): a CA, and
certificates it signs, for a TLS server at an IP address, a client, or both (`--peer-tls`),
valid for a chosen window (an expired one, to check it is refused)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAY = datetime.timedelta(days=1)


def _write(directory: Path, name: str, certificate: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> None:
    (directory / f"{name}.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path = directory / f"{name}.key"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private at once
    with open(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def _load(directory: Path, name: str
          ) -> tuple[x509.Certificate, CertificateIssuerPrivateKeyTypes]:
    """A CA's certificate and key, as make_ca wrote them."""
    certificate = x509.load_pem_x509_certificate((directory / f"{name}.crt").read_bytes())
    key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
    return certificate, key  # type: ignore[return-value]


def make_ca(directory: Path, name: str) -> None:
    """`name`.crt and `name`.key: a self-signed CA, valid from yesterday for two days."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - DAY).not_valid_after(now + 2 * DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256()))
    _write(directory, name, certificate, key)


def make_cert(directory: Path, ca: str, name: str, *, ip: str | None = None,
              client_only: bool = False, valid_from: datetime.datetime | None = None,
              valid_until: datetime.datetime | None = None) -> None:
    """`name`.crt and `name`.key signed by the CA `ca` (made by make_ca in `directory`): for
    a server at `ip` (its CommonName the name, the IP its subjectAltName) and a client both,
    or, `client_only`, a client certificate without a CommonName (etcd's JSON gateway refuses
    one that has). Valid from yesterday for two days unless told otherwise."""
    ca_certificate, ca_key = _load(directory, ca)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)] if client_only
                        else [x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_certificate.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid_from or now - DAY).not_valid_after(valid_until or now + 2 * DAY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([] if client_only
                                                  else [ExtendedKeyUsageOID.SERVER_AUTH])
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    _write(directory, name, builder.sign(ca_key, hashes.SHA256()), key)
