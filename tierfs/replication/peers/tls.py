"""Optional TLS for peer data (`--peer-tls`): mutual TLS between the nodes, each with a
certificate of the cluster's CA (`--peer-cacert`), around the same framed protocol.

The token handshake and every frame's MAC stay as they are inside TLS: TLS adds secrecy on the
wire (an eavesdropper sees no file bytes) and shuts out every process without a certificate of
the cluster's CA before it can send a byte of the protocol. Any certificate of that CA is a
node's: peers are reached by address, so no host name is checked; which node it is, the token
handshake says. Both ends require TLS 1.3.

A cluster runs with TLS or without it: the first node of a cluster records which under
`/<prefix>/peer-tls` in etcd, and a node mounted the other way is refused at mount, as one
whose certificate a live member refuses is (`mount_helper.admission.check_transport`).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from tierfs.replication.certificates import dates_problem

# ssl.OP_ENABLE_KTLS from Python 3.12; the same bit (SSL_OP_ENABLE_KTLS) for OpenSSL 3 before
OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)


@dataclass(frozen=True)
class PeerTlsFiles:
    """--peer-cacert, --peer-cert and --peer-key: where the cluster's CA certificate, this
    node's certificate (signed by it) and its private key are."""

    cacert: str
    cert: str
    key: str


@dataclass(frozen=True)
class PeerTls:
    """The two TLS contexts of a node: for the connections it takes (`server`) and those it
    makes (`client`), both requiring the other end's certificate of the cluster's CA."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def load(files: PeerTlsFiles) -> PeerTls:
    """Both contexts; ValueError (one line) if a file does not load, or the certificate is
    not valid now (the peers would only answer `bad certificate`)."""
    if problem := dates_problem(files.cert, "--peer-cert"):
        raise ValueError(problem)
    return PeerTls(_context(files, ssl.PROTOCOL_TLS_SERVER),
                   _context(files, ssl.PROTOCOL_TLS_CLIENT))


def _context(files: PeerTlsFiles, protocol: int) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # Records encrypted and decrypted by the kernel where it and OpenSSL can (a no-op where
    # they cannot: this project's kernel has no kernel TLS).
    context.options |= OP_ENABLE_KTLS
    if protocol == ssl.PROTOCOL_TLS_SERVER:
        # No session tickets: no connection is resumed, and a ticket nobody read would make
        # an idle pooled connection look closed by its peer.
        context.num_tickets = 0
    context.check_hostname = False  # peers are reached by address: the CA says who is one
    context.verify_mode = ssl.CERT_REQUIRED
    for what, loading in (
            (f"--peer-cacert {files.cacert}",
             lambda: context.load_verify_locations(cafile=files.cacert)),
            (f"--peer-cert {files.cert} with --peer-key {files.key}",
             lambda: context.load_cert_chain(files.cert, files.key))):
        try:
            loading()
        except (ssl.SSLError, OSError) as exc:
            why = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
            raise ValueError(f"{what} does not load: {str(why).lower()}") from None
    return context
