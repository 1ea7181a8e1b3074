"""The cluster-wide namespace: every node tells every peer which committed steps it holds
(the manifests and who holds them), every couple of seconds and whenever a peer comes up; a node
starting pulls it from its peers before it answers. So every node lists every committed step of
the cluster, and knows where to read the ones it does not hold."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from tierfs import manifest as mf
from tierfs.replication import protocol as proto
from tierfs.replication.channel import PeerChannel
from tierfs.replication.membership import Membership

log = logging.getLogger(__name__)

GOSSIP_EVERY = 2.0
BATCH = 200  # manifests per message, well under the header size cap

Holdings = Callable[[], list[tuple[mf.StepManifest, list[str]]]]
Learn = Callable[[mf.StepManifest, list[str]], None]


class Gossip:
    def __init__(self, membership: Membership, holdings: Holdings, learn: Learn) -> None:
        self.membership = membership
        self._holdings = holdings
        self._learn = learn

    async def run(self) -> None:
        while True:
            changed = self.membership.changed
            async with trio.open_nursery() as nursery:
                for member in self.membership.peers:
                    if member.up:
                        nursery.start_soon(self._tell, member.node_id)
            with trio.move_on_after(GOSSIP_EVERY):
                await changed.wait()  # a peer came up: tell it at once

    async def pull_all(self) -> None:
        """Learn what every reachable peer holds (at start, before the mount answers)."""
        async with trio.open_nursery() as nursery:
            for member in self.membership.peers:
                nursery.start_soon(self._pull, member.node_id)

    async def _tell(self, node_id: str) -> None:
        try:
            channel = await self.membership.connect(node_id)
            try:
                for batch in self._batches():
                    await channel.request("GOSSIP", manifests=batch)
            finally:
                await channel.aclose()
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            log.debug("gossip to %s failed: %s", node_id, exc)

    async def _pull(self, node_id: str) -> None:
        try:
            channel = await self.membership.connect(node_id)
            try:
                await channel.send("PULL")
                while True:
                    message = await channel.receive("GOSSIP", "OK")
                    if message.type == "OK":
                        break
                    self._absorb(message, node_id)
            finally:
                await channel.aclose()
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            log.info("could not pull the cluster's steps from %s yet: %s", node_id, exc)

    def _batches(self) -> list[list[list[object]]]:
        entries = [[mf.encode(manifest), holders] for manifest, holders in self._holdings()]
        return [entries[i:i + BATCH] for i in range(0, len(entries), BATCH)] or [[]]

    # -- the peer port's side ----------------------------------------------------------------

    async def on_gossip(self, message: proto.Message, channel: PeerChannel) -> None:
        self._absorb(message, channel.peer_id)
        await channel.send("OK")

    async def on_pull(self, message: proto.Message, channel: PeerChannel) -> None:
        for batch in self._batches():
            await channel.send("GOSSIP", manifests=batch)
        await channel.send("OK")

    def _absorb(self, message: proto.Message, sender: str) -> None:
        for item in message["manifests"]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)
                    and isinstance(item[1], list)
                    and all(isinstance(h, str) for h in item[1])):
                raise proto.ProtocolError("malformed GOSSIP entry")
            try:
                manifest = mf.decode(item[0])
            except mf.ManifestError as exc:
                raise proto.ProtocolError(f"bad manifest in GOSSIP: {exc}") from None
            self._learn(manifest, item[1])
