"""The cluster-wide side of a multi-node DCP commit.

With DCP every rank writes its shard into the same step path on its own node's mount, and only
rank 0's node sees `.metadata`. That node learns from `.metadata` which files the checkpoint
has, asks its peers which of the missing ones they hold sealed (SEALED), and pulls them; the step
then commits there whole, and gossip brings the committed manifest to the other nodes, which
adopt it for the files they wrote themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from tierfs import manifest as mf
from tierfs.replication import protocol as proto
from tierfs.replication.channel import PeerChannel
from tierfs.replication.membership import Membership

log = logging.getLogger(__name__)

SealedLookup = Callable[[str, list[str]], list[mf.FileEntry]]


class SealedFiles:
    def __init__(self, membership: Membership, lookup: SealedLookup) -> None:
        self.membership = membership
        self._lookup = lookup

    async def collect(self, step_path: str,
                      names: set[str]) -> dict[str, tuple[str, mf.FileEntry]]:
        """Where the peers hold sealed copies of these files: name -> (node id, entry)."""
        found: dict[str, tuple[str, mf.FileEntry]] = {}

        async def ask(node_id: str) -> None:
            try:
                channel = await self.membership.connect(node_id)
                try:
                    reply = await channel.request("SEALED", path=step_path,
                                                  names=sorted(names), expect="SEALED_FILES")
                finally:
                    await channel.aclose()
                for fields in reply["files"]:
                    entry = mf.entry_from_fields(fields)
                    if entry.name in names:
                        found.setdefault(entry.name, (node_id, entry))
            except (OSError, proto.ProtocolError, trio.TooSlowError, mf.ManifestError) as exc:
                log.info("asking %s for the files of %s failed: %s", node_id, step_path, exc)

        async with trio.open_nursery() as nursery:
            for member in self.membership.peers:
                nursery.start_soon(ask, member.node_id)
        return found

    async def on_sealed(self, message: proto.Message, channel: PeerChannel) -> None:
        names = message["names"]
        if not all(isinstance(n, str) for n in names):
            raise proto.ProtocolError("SEALED names must be strings")
        for name in names:
            try:
                mf.check_relative_path(name)
            except mf.ManifestError as exc:
                raise proto.ProtocolError(f"SEALED: {exc}") from None
        entries = self._lookup(message["path"], names)
        await channel.send("SEALED_FILES", files=[mf.entry_fields(e) for e in entries])
