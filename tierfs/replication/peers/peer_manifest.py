"""Committed manifests between peers, on demand and in chunks: a node that learns a commit
from its commit record in etcd (one watch event) fetches the step's manifest from a node that
lists that version (the committer first), not from etcd's per-file records.

    MANIFEST {path, version, offset}  ->  MANIFEST_PART {total} + up to CHUNK bytes, or ERROR

The bytes are the manifest as `tierfs.manifest.encode` writes it; the asker reassembles them
(no size cap: as many chunks as it takes), decodes and checks them against what it asked for.
A server encodes a manifest once and keeps the last few (every node asks for the same new
step at about the same time)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tierfs import manifest as mf
from tierfs.replication.coordination.cluster_commit import ManifestUnavailable
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel
from tierfs.replication.peers.directory import PeerDirectory

CHUNK = 4 << 20  # bytes per MANIFEST_PART: well under the frame cap, few round trips
MAX_MANIFEST = 1 << 30  # a total beyond this is a hostile peer's, not a step's
FETCH_TIMEOUT = 30.0  # per part
KEEP_ENCODED = 4

# (step path, version) -> the committed manifest of that version here, or None
Committed = Callable[[str, int], mf.StepManifest | None]


class ManifestServer:
    """Answers MANIFEST from the steps this node lists committed (its own or learned)."""

    def __init__(self, committed: Committed) -> None:
        self._committed = committed
        self._encoded: OrderedDict[tuple[str, int], tuple[mf.StepManifest, bytes]] = \
            OrderedDict()
        self.served_parts = 0

    async def on_manifest(self, message: proto.Message, channel: PeerChannel) -> None:
        path, version, offset = message["path"], message["version"], message["offset"]
        data = self._encode(path, version)
        if data is None:
            await channel.send("ERROR", message=f"{path} v{version} is not committed here")
            return
        if offset > len(data):
            raise proto.ProtocolError(f"MANIFEST offset {offset} beyond {len(data)} bytes")
        # counted before the send: the reader may have the last part before this task resumes
        self.served_parts += 1
        await channel.send("MANIFEST_PART", memoryview(data)[offset:offset + CHUNK],
                           total=len(data))

    def _encode(self, path: str, version: int) -> bytes | None:
        manifest = self._committed(path, version)
        if manifest is None:
            return None
        key = (path, version)
        cached = self._encoded.get(key)
        if cached is not None and cached[0] is manifest:
            self._encoded.move_to_end(key)
            return cached[1]
        data = mf.encode(manifest)
        self._encoded[key] = (manifest, data)
        while len(self._encoded) > KEEP_ENCODED:
            self._encoded.popitem(last=False)
        return data


class ManifestFetcher:
    """Asks a peer for a committed manifest."""

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def fetch(self, node_id: str, path: str, version: int) -> mf.StepManifest:
        """The manifest of `path` at `version` as `node_id` lists it, checked; ManifestUnavailable
        (or OSError, trio.TooSlowError) if it cannot give it (coordination's `FetchManifest`)."""
        try:
            return await self._fetch(node_id, path, version)
        except proto.ProtocolError as exc:
            raise ManifestUnavailable(str(exc)) from exc

    async def _fetch(self, node_id: str, path: str, version: int) -> mf.StepManifest:
        parts: list[bytes] = []
        received = 0
        total: int | None = None
        async with self.directory.channel(node_id) as channel:
            while total is None or received < total:
                await channel.send("MANIFEST", path=path, version=version, offset=received)
                reply = await channel.receive("MANIFEST_PART", timeout=FETCH_TIMEOUT)
                total = _check_part(total, reply, received)
                parts.append(bytes(reply.payload))
                received += len(reply.payload)
        try:
            manifest = mf.decode(b"".join(parts))
        except mf.ManifestError as exc:
            raise proto.ProtocolError(f"manifest of {path} from {node_id}: {exc}") from None
        if manifest.path != path or manifest.version != version:
            raise proto.ProtocolError(f"{node_id} sent the manifest of {manifest.path} "
                                      f"v{manifest.version} for {path} v{version}")
        return manifest


def _check_part(total: int | None, reply: proto.Message, received: int) -> int:
    """The manifest's total length, once a part is checked against the ones before it."""
    size = reply["total"]
    if size > MAX_MANIFEST or (total is not None and size != total):
        raise proto.ProtocolError(f"MANIFEST_PART with a bad total ({size})")
    if received + len(reply.payload) > size or (not reply.payload and received < size):
        raise proto.ProtocolError("MANIFEST_PART does not fit the manifest's length")
    return size
