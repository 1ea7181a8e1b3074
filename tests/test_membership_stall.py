"""A daemon stalled for longer than its lease's ttl between the lease grant and its registration
(seen with 20 daemons starting at once on 2 cores) still joins: it takes a new lease, instead of
failing to start with etcd's "requested lease not found". Against the real test etcd; the stall
is a delay before the client's first registration write."""

from __future__ import annotations

import uuid

import pytest
import trio

from tierfs.devtools.etcd import Etcd as EtcdServer
from tierfs.replication.coordination.etcd import Etcd, parse_cluster_url
from tierfs.replication.coordination.membership import Membership

pytestmark = pytest.mark.store

TTL = 2  # seconds: etcd's smallest lease with its default election timeout


class StalledOnce(Etcd):
    """The real client, but the first put-if-absent waits out the lease first."""

    stalled = False

    async def put_if_absent(self, key: str, value: bytes, lease: int = 0) -> bool:
        if not self.stalled:
            self.stalled = True
            await trio.sleep(TTL + 1.5)  # past the ttl and etcd's expiry check (every 0.5 s)
        return await super().put_if_absent(key, value, lease)


async def test_a_stall_past_the_ttl_before_registering_takes_a_new_lease(
        etcd_server: EtcdServer) -> None:
    cluster = parse_cluster_url(etcd_server.cluster_url(f"tierfs-test/{uuid.uuid4().hex[:10]}"))
    etcd = StalledOnce(cluster.endpoints)
    member = Membership(etcd, cluster, "node0", "127.0.0.1:7000", ttl=TTL)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(15):
            await nursery.start(member.run)
        assert etcd.stalled
        assert member.members.keys() == {"node0"}
        kv = await Etcd(cluster.endpoints).get(member.key)
        assert kv is not None and kv.lease != 0
        nursery.cancel_scope.cancel()
