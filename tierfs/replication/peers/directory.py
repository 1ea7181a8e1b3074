"""The peers as the data connections see them: who the nodes are and who is up, from etcd.

The live members come from `coordination.membership` (each daemon's key under a lease; every
node follows the member prefix). This module adds what the peer clients and the peer port ask
of them: the address to connect to, the authenticated connections (kept alive in a pool),
and the peers `status` lists (every node seen since this daemon started, up or down).
There is no heartbeat of its own: a node is up while its lease lives. Connections follow who
is *admitted* (live, or gone for less than a rejoin grace: `coordination.membership`), so a lease
that ended in an etcd outage of a node that lives refuses none of its connections.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import trio

from tierfs.replication.coordination import membership as live_members
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel, connect
from tierfs.replication.peers.handshakes import OK, PeerLinks
from tierfs.replication.peers.pool import CONNECTIONS, SPARE, SWEEP_EVERY, PeerPool
from tierfs.replication.peers.tls import PeerTls


@dataclass
class Member:
    node_id: str
    addr: str  # HOST:PORT as the node registered it
    up: bool

    @property
    def host(self) -> str:
        return self.addr.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.addr.rpartition(":")[2])


class LiveIds:
    """`node in ids`: whether `node` is an admitted member now (checked at each connection)."""

    def __init__(self, live: live_members.Membership) -> None:
        self._live = live

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, str) and self._live.admits(node_id)


class PeerDirectory:
    """The members of the cluster for this node's peer connections."""

    def __init__(self, live: live_members.Membership, token: bytes,
                 tls: PeerTls | None = None, connections: int = CONNECTIONS) -> None:
        self.live = live
        self.me = live.node_id
        self.token = token
        self.tls = tls  # --peer-tls: every connection in TLS, both ways
        self.ids = LiveIds(live)
        self._seen: dict[str, str] = {}  # every node seen since start: node id -> address
        self._domains: dict[str, str] = {}  # their --failure-domain, those that have one
        # a transfer to or from one peer uses this many connections at once
        self.connections = connections
        self.pool = PeerPool(self.connect, per_peer=connections + SPARE)
        self.links = PeerLinks(self._probe)  # whether each member's handshake succeeds

    @property
    def changed(self) -> trio.Event:
        """Set (and replaced) at every change of the live members."""
        return self.live.changed

    @property
    def members(self) -> dict[str, Member]:
        """Every node seen since this daemon started, this one included, up or down."""
        for node_id, info in self.live.members.items():
            self._seen[node_id] = info.address
            if info.domain is not None:
                self._domains[node_id] = info.domain
        return {node_id: Member(node_id, addr, node_id in self.live.members)
                for node_id, addr in sorted(self._seen.items())}

    @property
    def peers(self) -> list[Member]:
        return [m for m in self.members.values() if m.node_id != self.me]

    def domain_of(self, node_id: str) -> str | None:
        """The failure domain `node_id` registered with (also after it left), if any."""
        info = self.live.members.get(node_id)
        if info is not None and info.domain is not None:
            self._domains[node_id] = info.domain
        if node_id == self.me:
            return self.live.info.domain
        return self._domains.get(node_id)

    def is_up(self, node_id: str) -> bool:
        return self.live.is_up(node_id)

    def may_be_up(self, node_id: str) -> bool:
        """Live, or gone so recently that it may be registering again (`admits`), or not seen
        yet while this node itself is just starting (a cluster starting together); and not a
        member whose peer handshake fails (`handshakes`): its copies cannot be read."""
        info = self.live.admitted.get(node_id)
        if info is not None and self.links.failing(node_id, info.address):
            return False
        return self.live.admits(node_id) or self.live.starting

    @property
    def generation(self) -> int:
        """Changes whenever `is_up` or `may_be_up` may answer otherwise."""
        return self.live.generation + self.links.generation

    def _member(self, node_id: str) -> Member:
        info = self.live.admitted.get(node_id)
        if info is None:
            raise OSError(f"node {node_id} is not a live member of the cluster")
        return Member(node_id, info.address, True)

    async def connect(self, node_id: str) -> PeerChannel:
        """A new authenticated channel to a live member (OSError if it is not one), for the
        caller to close."""
        member = self._member(node_id)
        try:
            return await connect(member.host, member.port, self.token, self.me, self.ids,
                                 node_id, self.tls.client if self.tls else None)
        except (OSError, proto.ProtocolError, trio.TooSlowError):
            self.links.check_soon(node_id)  # is its handshake failing for good?
            raise

    async def _probe(self, node_id: str) -> None:
        """A PING to a live member (`links`), on a connection of the pool: a new one proves
        the handshake, and then serves the requests that follow."""
        async with self.channel(node_id) as channel:
            await channel.request("PING", node_id=self.me, expect="PONG")

    @contextlib.asynccontextmanager
    async def channel(self, node_id: str) -> AsyncIterator[PeerChannel]:
        """An authenticated channel to a live member for a few requests (OSError if it is not
        one), lent by the pool: a connection kept alive from an earlier block, or a new one
        (waiting while as many as the pool lends per peer are busy). It goes back to the pool
        when the block ends normally with every request answered, and is closed otherwise."""
        member = self._member(node_id)
        async with self.pool.channel((node_id, member.addr)) as channel:
            yield channel

    async def run(self) -> None:
        """Keep the pool tidy: idle connections close before the peer's server drops them,
        and at once when their peer leaves; all of them close when this task ends. Meanwhile,
        probe each member's handshake (`links`)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.links.run, self._others, lambda: self.live.changed)
            try:
                while True:
                    with trio.move_on_after(SWEEP_EVERY):
                        await self.changed.wait()
                    await self.pool.sweep(self._live_keys())
            finally:
                await self.pool.aclose()

    def _others(self) -> dict[str, str]:
        """The members whose handshakes `links` keeps: the admitted ones, so that a node
        whose handshake failed stays failing through its grace after it leaves (`may_be_up`
        asks about those too; forgotten, its copies counted again for those seconds)."""
        return {node_id: info.address for node_id, info in self.live.admitted.items()
                if node_id != self.me}

    def _live_keys(self) -> set[tuple[str, str]]:
        return {(node_id, info.address) for node_id, info in self.live.admitted.items()}

    def status(self) -> list[dict[str, object]]:
        """Each peer: `state` is `up`, `up, refused (token)`, `up, refused (TLS)`,
        `up, unreachable` or `down`; `link_error` says why a live one's handshake fails."""
        return [{"node_id": m.node_id, "addr": m.addr, "up": m.up, **self._link(m),
                 **({"domain": domain} if (domain := self.domain_of(m.node_id)) else {})}
                for m in self.peers]

    def _link(self, member: Member) -> dict[str, str]:
        if not member.up:
            return {"state": "down"}
        state = self.links.state(member.node_id, member.addr)
        if state == OK:
            return {"state": "up"}
        return {"state": f"up, {state}",
                "link_error": self.links.error(member.node_id, member.addr)}
