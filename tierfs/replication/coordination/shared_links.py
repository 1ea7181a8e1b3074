"""The links a cluster keeps (`fs.model.links`: a relative link outside any step directory,
pointing inside the mount, such as Lightning's `last.ckpt` with `save_last="link"`) in etcd,
so that every node shows them and a node that replaces a lost one finds them, with or without
a store: before, a job resumed with `fit(ckpt_path="last")` on such a node trained from step 0.

One key per directory (`links/<directory>`: its links and the node whose mount last changed
them, in the store's `.tierfs-links` format), written by that node whenever a link there
changes, retried while etcd cannot take it; a directory left without links keeps an empty
map, so that a node back from an absence drops the links it had. Every other node mirrors the
keys into its tree (`Etcd.follow_prefix`), before its mount answers at a start. A node's own
keys are not applied back to it; at a start, the directories whose key it wrote last, or that
have none, are written again from its tree where it holds links there (a change etcd had not
taken when it stopped), and every other directory takes the cluster's links (all of them on a
node back with an empty RAM dir). Two nodes changing links of one directory at
once: the later write wins for the whole directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from urllib.parse import quote, unquote

import trio

from tierfs import manifest as mf
from tierfs.fs.model import links as symlinks
from tierfs.fs.model.links import LinkQueue
from tierfs.replication.coordination.etcd import Etcd, EtcdError, KeyValue, Snapshot, WatchEvent
from tierfs.replication.coordination.url import ClusterUrl

log = logging.getLogger(__name__)

TOP = "."  # the key of the mount's top directory


class SharedLinks:
    """This node's side of the cluster's links: what its mount changed goes to etcd, what
    other nodes changed comes into its tree."""

    def __init__(self, etcd: Etcd, cluster: ClusterUrl, node_id: str, changes: LinkQueue, *,
                 links_of: Callable[[str], dict[str, str]],
                 link_dirs: Callable[[], Iterable[str]],
                 replace: Callable[[str, dict[str, str]], int]) -> None:
        self.etcd = etcd
        self.prefix = cluster.key("links") + "/"
        self.node_id = node_id
        self.changes = changes  # the directories this node's mount changed links in
        self.links_of = links_of  # a directory's kept links in this node's tree
        self.link_dirs = link_dirs  # the directories holding links in this node's tree
        self.replace = replace  # make a directory's kept links these
        self._learned = False  # the cluster's links read once since the start

    async def learn_all(self) -> None:
        """At a start: the cluster's links into this tree, this node's own to etcd (by
        `publish`). Not waited for beyond one try: `follow` applies them once etcd answers."""
        try:
            snapshot = await self.etcd.get_prefix(self.prefix)
        except EtcdError as exc:
            log.warning("could not read the cluster's links yet: %s", exc)
            return
        self._apply_snapshot(snapshot)

    async def follow(self) -> None:
        """Mirror other nodes' changes, until cancelled (a snapshot after a compaction is
        applied whole again)."""
        send, receive = trio.open_memory_channel[Snapshot | list[WatchEvent]](0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.etcd.follow_prefix, self.prefix, send)
            async for batch in receive:
                if isinstance(batch, Snapshot):
                    self._apply_snapshot(batch)
                    continue
                for event in batch:
                    if event.kind == "put":
                        self._apply(event.kv)

    async def publish(self) -> None:
        """Write the links of each directory this node's mount changed, until cancelled."""
        async def write(directory: str) -> None:
            await self.etcd.put(self._key(directory),
                                symlinks.encode(self.links_of(directory), self.node_id))

        await self.changes.write_each(write, EtcdError, "etcd")

    def _apply_snapshot(self, snapshot: Snapshot) -> None:
        """Every key another node wrote made this tree's. The first time since the start,
        also this node's own keys of the directories where its tree holds no links (its RAM
        dir lost), and the directories where it does hold some and no other node wrote last
        are written again from here."""
        first, self._learned = not self._learned, True
        own = set(self.link_dirs()) if first else set()
        for kv in snapshot.kvs:
            directory = self._directory(kv.key)
            take_own = first and directory not in own
            if self._apply(kv, take_own=take_own) != self.node_id:
                own.discard(directory)  # another node's links: taken
        for directory in sorted(own):
            self.changes.note(directory)

    def _apply(self, kv: KeyValue, *, take_own: bool = False) -> str | None:
        """A directory's key, made this tree's unless this node wrote it (`take_own`: also
        then); its writer."""
        directory = self._directory(kv.key)
        try:
            if directory:
                mf.check_relative_path(directory)
            writer, links = symlinks.decode_written(directory, kv.value)
        except ValueError as exc:
            log.warning("ignoring the malformed links record %s: %s", kv.key, exc)
            return None
        if writer != self.node_id or take_own:
            changed = self.replace(directory, links)
            if changed:
                log.info("%d links of %s changed as node %s has them", changed,
                         directory or TOP, writer)
        return writer

    def _key(self, directory: str) -> str:
        return self.prefix + quote(directory or TOP, safe="")

    def _directory(self, key: str) -> str:
        directory = unquote(key[len(self.prefix):])
        return "" if directory == TOP else directory
