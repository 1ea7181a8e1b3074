"""What a node proves before it registers as a member, so that a mount that cannot work is
refused with one line instead of joining and failing every exchange: that it reaches its own
peer port at its advertised address with its token (a handshake with itself through
--advertise), that its token is the cluster's (`cluster.token_check`), and that it speaks to
peers as the cluster does: with TLS or without (`--peer-tls`, recorded by the cluster's first
node), and with TLS, that a live member takes its certificate (and it the member's)."""

from __future__ import annotations

import json
import ssl

import trio

from tierfs.mount_helper.config import parse_address
from tierfs.replication.coordination.etcd import (
    ClusterUrl,
    Etcd,
    EtcdError,
    retry_unavailable,
)
from tierfs.replication.coordination.membership import MemberInfo
from tierfs.replication.coordination.token_check import TokenMismatch, check_token
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import (
    CONNECT_TIMEOUT,
    AuthError,
    PeerChannel,
    TlsRefused,
    WrongPeer,
    connect,
    open_socket,
)

TLS_PROBES = 3  # live members asked whether they take this node's certificate


class AdmissionRefused(Exception):
    """This node cannot work as a member; the message is the mount's one line."""


async def check_reaches_itself(advertise: str, token: bytes, node_id: str,
                               tls: ssl.SSLContext | None = None) -> None:
    """A handshake with this node's own peer server through `advertise`, as the other nodes
    will connect (in TLS if `tls`): AdmissionRefused if nothing answers there, or something
    else does."""
    host, port = parse_address(advertise, "--advertise")
    advice = ("--advertise must be the address the other nodes reach this node's --listen "
              "port at")
    try:
        channel = await connect(host, port, token, node_id, {node_id}, node_id, tls)
    except TlsRefused as exc:
        raise AdmissionRefused(f"this node's own peer port refuses it over TLS at {advertise} "
                               f"({exc}): --peer-cert must be a certificate of --peer-cacert, "
                               f"the cluster's CA") from None
    except WrongPeer as exc:
        raise AdmissionRefused(f"the advertised address {advertise} is the peer port of node "
                               f"{exc.found!r}, not this node's ({node_id!r}): {advice}"
                               ) from None
    except AuthError as exc:
        raise AdmissionRefused(f"the advertised address {advertise} is not this node's peer "
                               f"port ({exc}): {advice}") from None
    except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or "timed out"
        raise AdmissionRefused(f"this node cannot reach itself at its advertised address "
                               f"{advertise} ({why.lower()}): {advice}") from None
    try:
        await channel.request("PING", node_id=node_id, expect="PONG")
    except (proto.ProtocolError, trio.TooSlowError) as exc:
        raise AdmissionRefused(f"the advertised address {advertise} does not answer as this "
                               f"node's peer port ({exc or 'timed out'}): {advice}") from None
    finally:
        await channel.aclose()


async def check_cluster_token(etcd: Etcd, cluster: ClusterUrl, token: bytes) -> None:
    """AdmissionRefused if this node's token is not the cluster's; EtcdError if etcd is not
    there to say (after the usual retries)."""
    try:
        await retry_unavailable(lambda: check_token(etcd, cluster, token),
                                "check the cluster's token")
    except TokenMismatch as exc:
        raise AdmissionRefused(str(exc)) from None


async def check_transport(etcd: Etcd, cluster: ClusterUrl, tls: ssl.SSLContext | None,
                          node_id: str) -> None:
    """AdmissionRefused if this node's --peer-tls is not the cluster's (its first node
    recorded it under `/<prefix>/peer-tls`), or, with TLS, if a live member refuses this
    node's certificate or presents one this node refuses; EtcdError if etcd does not
    answer."""
    key = cluster.key("peer-tls")
    recorded = await retry_unavailable(lambda: _record_transport(etcd, key, tls is not None),
                                       "check the cluster's peer TLS")
    if recorded is not None and recorded != (tls is not None):
        raise AdmissionRefused(
            "the cluster's peers use TLS (--peer-tls): mount this node with --peer-tls and a "
            "certificate of the cluster's CA" if recorded else
            "the cluster's peers do not use TLS: mount this node without --peer-tls (to turn "
            f"it on, stop every node and delete the etcd key {key})")
    if tls is None:
        return
    members = await retry_unavailable(lambda: etcd.get_prefix(cluster.key("members") + "/"),
                                      "list the cluster's members")
    asked = 0
    for kv in members.kvs:
        member = kv.key.rpartition("/")[2]
        try:
            address = MemberInfo.decode(member, kv.value).address
        except (ValueError, TypeError):
            continue
        if member == node_id:
            continue
        if asked == TLS_PROBES:
            return
        asked += 1
        if await _takes_certificate(address, tls, member):
            return  # one member's word: the CA is the cluster's


async def _record_transport(etcd: Etcd, key: str, tls: bool) -> bool | None:
    """Whether the cluster's peers use TLS, as recorded (recorded now if not yet: None)."""
    if await etcd.put_if_absent(key, json.dumps({"tls": tls}).encode()):
        return None
    found = await etcd.get(key)
    if found is None:  # deleted meanwhile (a cluster being reset): the next mount records it
        return None
    try:
        recorded = json.loads(found.value)["tls"]
    except (ValueError, KeyError, TypeError) as exc:
        raise EtcdError(f"{key} is not a record of tierfs: {exc}") from None
    return bool(recorded)


async def _takes_certificate(address: str, tls: ssl.SSLContext, member: str) -> bool:
    """Whether the TLS handshake with the member at `address` succeeds both ways (its first
    frame arrives: it took this node's certificate); AdmissionRefused if either end refuses
    the other's certificate; False if it does not answer (down, or not yet listening)."""
    host, port = parse_address(address, "the member address")
    try:
        sock = await open_socket(host, port, tls)
    except TlsRefused as exc:
        raise _certificate_refused(member, address, exc) from None
    except (OSError, trio.TooSlowError):
        return False
    channel = PeerChannel(sock)
    try:
        await channel.receive("HELLO", timeout=CONNECT_TIMEOUT)
    except TlsRefused as exc:
        raise _certificate_refused(member, address, exc) from None
    except (proto.ProtocolError, trio.TooSlowError):
        return False
    finally:
        await channel.aclose()
    return True


def _certificate_refused(member: str, address: str, exc: Exception) -> AdmissionRefused:
    return AdmissionRefused(
        f"the peer TLS handshake with node {member} at {address} failed ({exc}): --peer-cert "
        f"must be a certificate of the cluster's CA, and --peer-cacert that CA, as on every "
        f"node")
