"""`tierfs verify` across the cluster: asking a peer to check its own copy of a committed file
against the manifest (and, when asked, to repair a bad one: it quarantines the copy and pulls a
good one back, verified chunk by chunk), and answering such requests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from tierfs import manifest as mf
from tierfs.fs.model.ports import TierError
from tierfs.replication.coordination.commit_records import FileRecord
from tierfs.replication.coordination.placement import copies_wanted
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel
from tierfs.replication.peers.directory import PeerDirectory

STATES = {"good", "bad", "missing", "repaired"}
VERIFY_TIMEOUT = 600.0  # hashing a large file, and fetching it again if it was bad

CheckHeld = Callable[[str, str, str, bool], Awaitable[str]]
# the file records of a committed version (`ClusterCommits.placements`)
Placements = Callable[[mf.StepManifest], Awaitable[dict[str, FileRecord] | None]]


class PeerVerify:
    def __init__(self, directory: PeerDirectory, placements: Placements, replicas: int) -> None:
        self.directory = directory
        self._placements = placements
        self.replicas = replicas  # --replicas: K

    async def file_holders(self, manifest: mf.StepManifest) -> dict[str, set[str]] | None:
        """Who holds each file of this committed version, as its record says: the peers a
        verify asks about that file (not every node holding some file of the step)."""
        records = await self._placements(manifest)
        if records is None:
            return None
        return {name: set(record.holders) for name, record in records.items()}

    def copies_wanted(self) -> int:
        """The copies each file should have on nodes (`placement.copies_wanted`) in the
        cluster known here, its nodes up or not, this one included (as status counts them)."""
        return copies_wanted(self.replicas, len(self.directory.peers) + 1)

    async def verify(self, node_id: str, step_path: str, entry: mf.FileEntry,
                     repair: bool) -> str:
        """The state of `node_id`'s copy (`fs.model.ports.PeerCopies`); TierError if the peer
        cannot be reached, does not answer in time or answers wrongly."""
        try:
            async with self.directory.channel(node_id) as channel:
                await channel.send("VERIFY", path=step_path, name=entry.name, xxh3=entry.xxh3,
                                   repair=repair)
                reply = await channel.receive("VERIFIED", timeout=VERIFY_TIMEOUT)
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            raise TierError(f"{node_id}: {exc or 'timed out'}") from exc
        if reply["state"] not in STATES:
            raise TierError(f"{node_id}: VERIFIED with an unknown state {reply['state']!r}")
        return reply["state"]


def verify_handler(check_held: CheckHeld) -> Callable[[proto.Message, PeerChannel],
                                                      Awaitable[None]]:
    async def on_verify(message: proto.Message, channel: PeerChannel) -> None:
        digest = message["xxh3"]
        if not proto.is_xxh3_128(digest):
            raise proto.ProtocolError("VERIFY with a malformed xxh3")
        state = await check_held(message["path"], message["name"], digest, message["repair"])
        await channel.send("VERIFIED", state=state)

    return on_verify
