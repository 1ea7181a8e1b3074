"""Kept-alive peer connections: a few authenticated channels per peer, lent one request
sequence at a time, so that one handshake serves many requests.

A borrower gets an idle channel to the peer (the most recently returned) or a new one, at most
`per_peer` per peer (the connections a transfer uses at once, `--peer-connections`, and SPARE
more for the requests that come meanwhile): beyond that it waits until one is returned
(backpressure). A channel comes
back to the pool only if the borrower's block ended normally and the channel is still in step
with its peer (PeerChannel.reusable); on any error, timeout or cancellation it is closed. An
idle channel is closed after MAX_IDLE (before the peer's server drops it), when its peer is no
longer a live member, when the peer has closed it meanwhile (checked at each loan), and when
the pool closes (daemon exit).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container
from dataclasses import dataclass, field

import trio

from tierfs.replication.peers.channel import PeerChannel
from tierfs.replication.peers.server import IDLE_TIMEOUT

CONNECTIONS = 4  # connections one transfer to or from a peer uses at once, by default
SPARE = 2  # connections to a peer beyond those, for requests while a transfer runs
PER_PEER = CONNECTIONS + SPARE
MAX_IDLE = IDLE_TIMEOUT * 0.75  # the server closes at IDLE_TIMEOUT: leave a margin for clocks
SWEEP_EVERY = 5.0

# (node id, address): a node back at another address is another peer
Key = tuple[str, str]


@dataclass
class _Peer:
    slots: trio.Semaphore
    idle: list[tuple[PeerChannel, float]] = field(default_factory=list)  # (channel, since)


class PeerPool:
    def __init__(self, connect: Callable[[str], Awaitable[PeerChannel]],
                 max_idle: float = MAX_IDLE, per_peer: int = PER_PEER) -> None:
        self._connect = connect
        self.max_idle = max_idle
        self.per_peer = per_peer
        self._peers: dict[Key, _Peer] = {}
        self.opened = 0  # connections made (one handshake each), for tests and status

    @contextlib.asynccontextmanager
    async def channel(self, key: Key) -> AsyncIterator[PeerChannel]:
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(trio.Semaphore(self.per_peer))
        async with peer.slots:
            channel = await self._take(key[0], peer)
            try:
                yield channel
            except BaseException:
                await channel.aclose()
                raise
            if channel.reusable:
                peer.idle.append((channel, time.monotonic()))
            else:
                await channel.aclose()

    async def _take(self, node_id: str, peer: _Peer) -> PeerChannel:
        while peer.idle:
            channel, since = peer.idle.pop()
            if time.monotonic() - since < self.max_idle and not channel.closed_by_peer():
                return channel
            await channel.aclose()
        channel = await self._connect(node_id)
        self.opened += 1
        return channel

    async def sweep(self, live: Container[Key]) -> None:
        """Close idle channels that are too old or whose peer is not live any more."""
        now = time.monotonic()
        closing = []
        for key, peer in list(self._peers.items()):
            stale = [item for item in peer.idle
                     if key not in live or now - item[1] >= self.max_idle]
            peer.idle[:] = [item for item in peer.idle if item not in stale]
            closing += [channel for channel, _ in stale]
            if not peer.idle and key not in live and peer.slots.value == self.per_peer:
                del self._peers[key]  # nobody borrows or waits: forget the peer
        for channel in closing:  # after the bookkeeping: a return meanwhile is kept apart
            await channel.aclose()

    def idle_count(self) -> int:
        return sum(len(peer.idle) for peer in self._peers.values())

    async def aclose(self) -> None:
        await self.sweep(())
