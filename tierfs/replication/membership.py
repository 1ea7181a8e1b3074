"""Cluster membership: who the nodes are (`--peers`), who answers (a heartbeat to every peer
every second), and where a node's committed files go (the next K live nodes on a ring ordered by
node id)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio

from tierfs.replication import protocol as proto
from tierfs.replication.channel import connect

log = logging.getLogger(__name__)

HEARTBEAT_EVERY = 1.0
DOWN_AFTER = 3.0


@dataclass
class Member:
    node_id: str
    host: str
    port: int
    up: bool = False
    last_seen: float = 0.0

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


class Membership:
    def __init__(self, me: str, members: dict[str, tuple[str, int]], token: bytes) -> None:
        if me not in members:
            raise ValueError(f"this node ({me}) is not in --peers")
        self.me = me
        self.token = token
        self.members = {node_id: Member(node_id, host, port)
                        for node_id, (host, port) in sorted(members.items())}
        self.members[me].up = True
        self.ids = set(self.members)
        self.changed = trio.Event()

    @property
    def peers(self) -> list[Member]:
        return [m for m in self.members.values() if m.node_id != self.me]

    def is_up(self, node_id: str) -> bool:
        member = self.members.get(node_id)
        return member is not None and member.up

    def successors(self, count: int) -> list[str]:
        """The next `count` live nodes after this one on the ring ordered by node id."""
        ring = sorted(self.members)
        start = ring.index(self.me)
        after = ring[start + 1:] + ring[:start]
        return [node_id for node_id in after if self.members[node_id].up][:count]

    async def connect(self, node_id: str):  # type: ignore[no-untyped-def]
        member = self.members[node_id]
        return await connect(member.host, member.port, self.token, self.me, self.ids, node_id)

    async def run(self) -> None:
        while True:
            async with trio.open_nursery() as nursery:
                for member in self.peers:
                    nursery.start_soon(self._ping, member)
            await trio.sleep(HEARTBEAT_EVERY)

    async def _ping(self, member: Member) -> None:
        try:
            with trio.fail_after(2 * HEARTBEAT_EVERY):
                channel = await self.connect(member.node_id)
                try:
                    await channel.request("PING", node_id=self.me, expect="PONG")
                finally:
                    await channel.aclose()
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            if member.up and time.monotonic() - member.last_seen > DOWN_AFTER:
                member.up = False
                log.warning("peer %s (%s) is down: %s", member.node_id, member.addr, exc)
                self._signal()
            return
        self.saw(member.node_id)

    def saw(self, node_id: str) -> None:
        """`node_id` just answered an authenticated request."""
        member = self.members[node_id]
        member.last_seen = time.monotonic()
        if not member.up:
            member.up = True
            log.info("peer %s (%s) is up", member.node_id, member.addr)
            self._signal()

    def _signal(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def status(self) -> list[dict[str, object]]:
        return [{"node_id": m.node_id, "addr": m.addr, "up": m.up} for m in self.peers]
