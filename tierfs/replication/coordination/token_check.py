"""The cluster's check of its peer token, made at every mount before a node registers: the
first node that mounts a prefix stores a random nonce and the HMAC of it under its token,

    /<prefix>/token-check   {"nonce": hex, "mac": hex}

and every later mount computes the HMAC of that nonce under its own token and compares. A node
given another token is refused at mount (its peers would refuse every connection it makes and
takes); the token itself never goes to etcd. One key per cluster, one read per mount."""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from tierfs.replication.coordination.etcd import ClusterUrl, Etcd, EtcdError

CONTEXT = b"tierfs-token-check-v1"


class TokenMismatch(Exception):
    """This node's token is not the one the cluster's first node mounted with."""


def _mac(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, CONTEXT + nonce, hashlib.sha256).digest()


async def check_token(etcd: Etcd, cluster: ClusterUrl, token: bytes) -> None:
    """Record the token's check if the cluster has none yet, else compare with it:
    TokenMismatch if it differs, EtcdError if etcd does not answer or the key is not tierfs's."""
    key = cluster.key("token-check")
    nonce = os.urandom(32)
    record = {"nonce": nonce.hex(), "mac": _mac(token, nonce).hex()}
    if await etcd.put_if_absent(key, json.dumps(record).encode()):
        return
    found = await etcd.get(key)
    if found is None:  # deleted meanwhile (a cluster being reset): the next mount records it
        return
    try:
        fields = json.loads(found.value)
        stored_nonce, stored_mac = bytes.fromhex(fields["nonce"]), bytes.fromhex(fields["mac"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EtcdError(f"{key} is not a record of tierfs: {exc}") from None
    if not hmac.compare_digest(_mac(token, stored_nonce), stored_mac):
        raise TokenMismatch(
            f"this node's token is not the cluster's (the one its first node mounted with): "
            f"give every node the same --token-file (to change the cluster's token, stop every "
            f"node and delete the etcd key {key})")
