"""The `--cluster` URL, etcd://HOST:PORT[,HOST:PORT...]/PREFIX (etcds:// for TLS), and how to
reach etcd (`EtcdSecurity`): parsed without the etcd client (the command line validates them
and must not import trio or httpx)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

SCHEME = "etcd"
TLS_SCHEME = "etcds"


class ClusterUrlError(ValueError):
    """A `--cluster` value that is not etcd://HOST:PORT[,HOST:PORT...]/PREFIX."""


# --- the --cluster URL ---------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS and credentials for etcd (etcdctl's names): https if `tls`, the server checked
    against `cacert` (else the system's CAs), this client's certificate `cert` and `key` if
    etcd asks for one, and a user and password if etcd has auth enabled."""

    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ClusterUrl:
    """etcd endpoints and the key prefix naming one cluster (no leading or trailing '/')."""

    endpoints: tuple[Endpoint, ...]
    prefix: str
    security: EtcdSecurity = EtcdSecurity()

    def key(self, *parts: str) -> str:
        """The etcd key `/<prefix>/<parts...>`."""
        return "/" + "/".join((self.prefix, *parts))

    def __str__(self) -> str:
        scheme = TLS_SCHEME if self.security.tls else SCHEME
        return f"{scheme}://{','.join(map(str, self.endpoints))}/{self.prefix}"


def parse_cluster_url(text: str) -> ClusterUrl:
    """Parse `etcd://HOST:PORT[,HOST:PORT...]/PREFIX` (or etcds://: TLS); `ClusterUrlError`
    says what is wrong."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in (SCHEME, TLS_SCHEME):
        raise ClusterUrlError(f"--cluster {text!r}: must start with {SCHEME}:// (or "
                              f"{TLS_SCHEME}:// for TLS)")
    hosts, slash, prefix = rest.partition("/")
    if not hosts:
        raise ClusterUrlError(f"--cluster {text!r}: no etcd endpoint (HOST:PORT)")
    prefix = prefix.strip("/")
    if not slash or not prefix:
        raise ClusterUrlError(f"--cluster {text!r}: no key prefix naming the cluster "
                              "(etcd://HOST:PORT/PREFIX)")
    segments = prefix.split("/")
    if any(s in ("", ".", "..") for s in segments) or any(c in prefix for c in "?#\0 "):
        raise ClusterUrlError(f"--cluster {text!r}: prefix {prefix!r} must be '/'-separated "
                              "names without empty, '.' or '..' parts, spaces, '?' or '#'")
    endpoints = tuple(_parse_endpoint(text, item) for item in hosts.split(","))
    if len(set(endpoints)) != len(endpoints):
        raise ClusterUrlError(f"--cluster {text!r}: an endpoint is named twice")
    return ClusterUrl(endpoints, prefix, EtcdSecurity(tls=scheme == TLS_SCHEME))


def _parse_endpoint(text: str, item: str) -> Endpoint:
    try:
        parts = urlsplit(f"//{item}")
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a port that is not a number, or out of range
        raise ClusterUrlError(f"--cluster {text!r}: endpoint {item!r}: {exc}") from None
    if not host or port is None or parts.username is not None or parts.path:
        raise ClusterUrlError(f"--cluster {text!r}: endpoint {item!r} is not HOST:PORT")
    if port == 0:
        raise ClusterUrlError(f"--cluster {text!r}: endpoint {item!r}: port 0")
    return Endpoint(host, port)
