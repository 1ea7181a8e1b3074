"""Deletes across the cluster: telling a peer that a committed step was deleted (it drops its
copy, if not newer, and remembers the delete so that no copy brings the step back), and
answering such requests. The durable record and the retries are `fs.lifecycle.deletes`'."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from tierfs.fs.lifecycle.deletes import Tombstone
from tierfs.fs.model.ports import TierError
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel
from tierfs.replication.peers.directory import PeerDirectory

# (path, version, committed_ns, sender): drop what is covered and remember the delete.
ApplyDelete = Callable[[str, int, int, str], None]


class PeerDelete:
    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def delete(self, tomb: Tombstone, node_id: str) -> None:
        """Have `node_id` drop the deleted step; TierError while it cannot be reached."""
        if node_id not in self.directory.ids:
            return  # no longer a member of the cluster: nothing to clean there
        try:
            async with self.directory.channel(node_id) as channel:
                await channel.request("DELETE", path=tomb.path, version=tomb.version,
                                      committed_ns=tomb.committed_ns)
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            raise TierError(f"{node_id}: {exc or 'timed out'}") from exc


def delete_handler(apply: ApplyDelete) -> Callable[[proto.Message, PeerChannel],
                                                  Awaitable[None]]:
    async def on_delete(message: proto.Message, channel: PeerChannel) -> None:
        apply(message["path"], message["version"], message["committed_ns"], channel.peer_id)
        await channel.send("OK")

    return on_delete
