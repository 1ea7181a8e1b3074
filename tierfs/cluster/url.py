"""The `--cluster` URL, etcd://HOST:PORT[,HOST:PORT...]/PREFIX: parsed without the etcd client
(the command line validates it and must not import trio or requests)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEME = "etcd"


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
class ClusterUrl:
    """etcd endpoints and the key prefix naming one cluster (no leading or trailing '/')."""

    endpoints: tuple[Endpoint, ...]
    prefix: str

    def key(self, *parts: str) -> str:
        """The etcd key `/<prefix>/<parts...>`."""
        return "/" + "/".join((self.prefix, *parts))

    def __str__(self) -> str:
        return f"{SCHEME}://{','.join(map(str, self.endpoints))}/{self.prefix}"


def parse_cluster_url(text: str) -> ClusterUrl:
    """Parse `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`; `ClusterUrlError` says what is wrong."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme != SCHEME:
        raise ClusterUrlError(f"--cluster {text!r}: must start with {SCHEME}://")
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
    return ClusterUrl(endpoints, prefix)


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
