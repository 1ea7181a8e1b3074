"""The cluster's record that its steps went to a persistent tier, so that a node given an empty
store where the cluster persisted steps can tell: its volume is not mounted on that node (an
NFS, Lustre or FSx store), or it is the wrong store. A node's own RAM dir says the same for the
steps it persisted (its `persisted` marks); a fresh node has no such marks, so the cluster says
it here:

    /<prefix>/store   {"url", "node", "at"}

written once (a transaction that fails if the key exists) by the first node that persists a
step, or that mounts a store already holding steps; never changed after, so it costs etcd one
key per cluster, and a node one read at a mount with a new store.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from tierfs.replication.coordination.etcd import ClusterUrl, Etcd, EtcdError


@dataclass(frozen=True)
class StoreUse:
    url: str  # the store's URL as the node that wrote the record gave it
    node: str
    at_ns: int


class StoreRecord:
    def __init__(self, etcd: Etcd, cluster: ClusterUrl) -> None:
        self._etcd = etcd
        self._key = cluster.key("store")

    async def read(self) -> StoreUse | None:
        """The record, None if no node of the cluster persisted a step yet. EtcdError if etcd
        does not answer, or the record is not one (never written by tierfs)."""
        found = await self._etcd.get(self._key)
        if found is None:
            return None
        try:
            fields = json.loads(found.value)
            return StoreUse(str(fields["url"]), str(fields["node"]), int(fields["at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise EtcdError(f"{self._key} is not a record of tierfs: {exc}") from None

    async def write(self, url: str, node: str) -> None:
        """Record that `node` persisted steps to `url`, unless a node did before."""
        value = json.dumps({"url": url, "node": node, "at": time.time_ns()}).encode()
        await self._etcd.put_if_absent(self._key, value)
