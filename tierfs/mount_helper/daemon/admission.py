"""What a node proves before it registers as a member, so that a mount that cannot work is
refused with one line instead of joining and failing every exchange: that it reaches its own
peer port at its advertised address with its token (a handshake with itself through
--advertise), and that its token is the cluster's (`cluster.token_check`)."""

from __future__ import annotations

import trio

from tierfs.mount_helper.config import parse_address
from tierfs.replication.coordination.etcd import ClusterUrl, Etcd, retry_unavailable
from tierfs.replication.coordination.token_check import TokenMismatch, check_token
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import AuthError, connect


class AdmissionRefused(Exception):
    """This node cannot work as a member; the message is the mount's one line."""


async def check_reaches_itself(advertise: str, token: bytes, node_id: str) -> None:
    """A handshake with this node's own peer server through `advertise`, as the other nodes
    will connect: AdmissionRefused if nothing answers there, or something else does."""
    host, port = parse_address(advertise, "--advertise")
    advice = ("--advertise must be the address the other nodes reach this node's --listen "
              "port at")
    try:
        channel = await connect(host, port, token, node_id, {node_id}, node_id)
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
