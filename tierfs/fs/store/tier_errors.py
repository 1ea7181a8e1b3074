"""The errors the file system's ports to other tiers raise (`fs.model.ports`): a failure of a
tier is a `TierError` whatever client met it (boto, the peer protocol, etcd), so that `fs`
catches that and nothing broader."""

from __future__ import annotations


class TierError(Exception):
    """Another tier (a peer, the persistent tier, the cluster's records) could not do what
    was asked: the one error type the outward ports raise for a failure of their tier."""


class ObjectMissing(TierError):
    """The tier holds no object for the file: not a failure of the tier (the next may have
    it), and what `tierfs verify` reports as missing."""
