"""Which other nodes have files of a step being written (`FILES`, answered by `HAVE`), and
the answers to such requests.

A multi-node DCP commit waits for the records other nodes write in etcd of the shards their
ranks sealed. When they are late, the committer asks the peers themselves: a node that has a
shard its records do not show wrote it and cannot record it (cut off from etcd), and then the
save cannot commit and must fail within its bound, never return success; when no node has them
and every node answered, they are still to come (`cp -r` writes `.metadata` before the shards)
and the commit waits for them here. A node that is down, or does not answer, may have them:
the commit cannot tell, and treats it as the first case."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from tierfs import manifest as mf
from tierfs.fs.model.ports import FilesOnPeers, SaveHere
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel
from tierfs.replication.peers.directory import PeerDirectory

ASK_TIMEOUT = 5.0  # seconds a peer has to answer (it only looks in its tree)

# (step path, names) -> the names of files of that step in this node's tree
FilesHere = Callable[[str, list[str]], list[str]]
# step path -> what this node writes of the save under way of that step
FilesWritten = Callable[[str], SaveHere]


class PeerFiles:
    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def ask(self, step_path: str, names: set[str], deadline: float) -> FilesOnPeers:
        """`fs.model.ports.ShardsOnPeers`: every node seen since this daemon started is asked
        (at once) which of `names` it has in the step, by `deadline` (trio time) and within
        ASK_TIMEOUT."""
        found = FilesOnPeers({}, set())
        wanted = sorted(names)

        async def ask_one(node_id: str, channel: PeerChannel) -> None:
            for start in range(0, len(wanted), proto.MAX_NAMES):
                reply = await channel.request("FILES", path=step_path,
                                              names=wanted[start:start + proto.MAX_NAMES],
                                              expect="HAVE")
                for name in reply["names"]:
                    if name in names:
                        found.held.setdefault(name, node_id)

        await self._ask_each([p.node_id for p in self.directory.peers], ask_one, found,
                             deadline)
        return found

    async def written(self, step_path: str, nodes: set[str] | None,
                      deadline: float) -> FilesOnPeers:
        """`fs.model.ports.ShardsOnPeers.written`: these nodes (None: every peer that is up)
        are asked (at once, page by page) which files of the save under way of the step they
        write, by `deadline` (trio time) and within ASK_TIMEOUT; a node down or not answering
        is `unanswered`."""
        found = FilesOnPeers({}, set())
        if nodes is None:
            nodes = {p.node_id for p in self.directory.peers if self.directory.is_up(p.node_id)}

        async def ask_one(node_id: str, channel: PeerChannel) -> None:
            after, more = "", True
            while more:
                reply = await channel.request("WRITTEN", path=step_path, after=after,
                                              expect="WRITES")
                names = reply["names"]
                for name in names:
                    found.held.setdefault(name, node_id)
                for name in reply["open"]:
                    found.writing.setdefault(name, node_id)
                for entry in mf.decode_dirs(reply["dirs"]):  # (validated on receipt)
                    if entry.path.startswith(f"{step_path}/"):
                        found.dirs.setdefault(entry.path, entry)
                found.versions[node_id] = reply["version"]
                more = bool(reply["more"]) and bool(names)
                after = names[-1] if names else after

        await self._ask_each(sorted(nodes), ask_one, found, deadline)
        return found

    async def _ask_each(self, nodes: list[str],
                        ask_one: Callable[[str, PeerChannel], Awaitable[None]],
                        found: FilesOnPeers, deadline: float) -> None:
        """`ask_one` of each node at once over a channel to it, by `deadline` and within
        ASK_TIMEOUT; a node that is down (it may hold files, and cannot say) or does not
        answer goes in `found.unanswered`."""
        async def ask(node_id: str) -> None:
            if not self.directory.is_up(node_id):
                found.unanswered.add(node_id)
                return
            try:
                with trio.fail_after(max(0.0, min(ASK_TIMEOUT,
                                                  deadline - trio.current_time()))):
                    async with self.directory.channel(node_id) as channel:
                        await ask_one(node_id, channel)
            except (OSError, proto.ProtocolError, trio.TooSlowError):
                found.unanswered.add(node_id)

        async with trio.open_nursery() as nursery:
            for node_id in nodes:
                nursery.start_soon(ask, node_id)


def written_handler(files_written: FilesWritten) -> Callable[[proto.Message, PeerChannel],
                                                           Awaitable[None]]:
    """WRITTEN: a page of the files this node writes of the step, after `after` in name
    order, with the directories that hold them (as many as one message may name: a page
    ends early where their directories would not fit)."""
    async def on_written(message: proto.Message, channel: PeerChannel) -> None:
        save = files_written(message["path"])
        after = message["after"]
        rest = [name for name in save.names if name > after]
        page: list[str] = []
        dirs: dict[str, mf.DirEntry] = {}
        dir_bytes = 0
        for name in proto.name_batches(rest, str)[0]:
            parts = name.split("/")[:-1]
            new = [rel for rel in ("/".join(parts[:i + 1]) for i in range(len(parts)))
                   if rel in save.dirs and rel not in dirs]
            added = sum(len(save.dirs[rel].path.encode()) for rel in new)
            if page and (len(dirs) + len(new) > proto.MAX_NAMES
                         or dir_bytes + added > proto.MAX_NAME_BYTES):
                break
            page.append(name)
            dirs.update((rel, save.dirs[rel]) for rel in new)
            dir_bytes += added
        await channel.send("WRITES", names=page, open=[n for n in page if n in save.still_open],
                           dirs=mf.encode_dirs(list(dirs.values())[:proto.MAX_NAMES]),
                           more=len(page) < len(rest), version=save.version)

    return on_written


def files_handler(files_here: FilesHere) -> Callable[[proto.Message, PeerChannel],
                                                     Awaitable[None]]:
    async def on_files(message: proto.Message, channel: PeerChannel) -> None:
        await channel.send("HAVE", names=files_here(message["path"], message["names"]))

    return on_files
