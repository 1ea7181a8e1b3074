"""What this node's saves tell the cluster, and what its commits need from it: the record of
each file it sealed (that this node holds it) and of each save it writes, the files of a step
that other nodes wrote (a multi-node DCP step's shards, a step saved on several nodes without a
`.metadata`: found by their records, else by asking the nodes), and the commit's own record,
written before the saver's call returns, or later while etcd is away.

`ClusterWrites` is the `CommitTiers` port of `fs.lifecycle.commits`; on a single node (no
`SealedCollector`) a DCP commit waits for the shards its `.metadata` names to be written here,
and nothing is recorded. It decides, and the `Tree`'s parts change the nodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.model import dcp_metadata, tree_walk
from tierfs.fs.model.nodes import METADATA, FsError, Node, some_names
from tierfs.fs.model.ports import (
    CoordinationUnavailable,
    FilesOnPeers,
    SealedCollector,
    ShardsOnPeers,
    Spawner,
    TierError,
)

if TYPE_CHECKING:
    from tierfs.fs.lifecycle.step_versions import StepVersions
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.step_manifests import StepManifests
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

# Seconds a commit waits for other nodes' records of the shards its `.metadata` names before
# it asks the nodes themselves (`locate_files`): records come as the shards' hashes do.
ASK_PEERS_AFTER = 1.0
# Seconds the mkdir of a step directory in a cluster waits for etcd to record that this node
# writes it (`saving_recorded`): a commit another node begins after the mkdir then asks this
# one for its files.
WRITER_WAIT = 0.5


class ClusterWrites:
    """The cluster's records of this node's sealed files and commits, and the shards of
    multi-node DCP steps other nodes hold."""

    def __init__(self, tree: Tree, versions: StepVersions, background: Spawner,
                 sealed: SealedCollector | None = None, shards: ShardsOnPeers | None = None,
                 *, manifests: StepManifests, residents: Residents) -> None:
        self.tree = tree
        self.versions = versions  # holders added (shards elsewhere) and forgotten
        self.background = background
        self.sealed = sealed  # the cluster's records of who holds which file (etcd)
        self.shards = shards  # asks the peers for files of a step their records lack
        self._manifests = manifests  # the shards a step's `.metadata` names
        self._residents = residents  # shards held elsewhere listed, old copies evicted
        # files of steps being committed here that stay on the other nodes that wrote them
        self._elsewhere: dict[str, set[str]] = {}
        self._unpublished: dict[str, mf.StepManifest] = {}  # committed while etcd was away
        # step -> the base of the save this node writes, and whether etcd knows it yet
        self._saving: dict[str, tuple[int, trio.Event]] = {}
        self._writing_seals = False  # a task writes the queued seals (`note_sealed`)

    # -- multi-node DCP steps ----------------------------------------------------------------

    async def locate_files(self, step_node: Node, deadline: float) -> bool:
        """Before a step commits, every file of it must be known: those other nodes write of
        a step without `.metadata` (`_other_writers_files`: DeepSpeed's and Megatron-LM's
        ranks on several nodes) are found as a DCP step's shards are. Every shard a DCP
        step's `.metadata` names must be known: on a
        single node (`cp -r`, `rsync`, `tar` may write `.metadata` first) by waiting for them,
        on several nodes by finding the records of the shards other nodes' ranks sealed (the
        shards stay where they were written: the manifest names their holders), waiting for
        them until `deadline` (trio time). Records still missing after ASK_PEERS_AFTER are
        asked of the peers themselves (`_unrecorded`): shards no node has are still to come
        here (False at once); shards a node has that it did not record by the deadline (it
        is cut off from etcd), or that a node which cannot answer may have, make the commit
        fail (`CoordinationUnavailable`), so that the saver's call never returns success for
        a step that did not commit. A step saved again over its committed version asks the
        same of the files it has only as they were in that version (`_old_copies`): a node
        that saved one again has its new record taken (the step must not mix two saves);
        one that nobody saved again by the deadline stays as it is. False while some are
        missing (`missing_dcp_files` names them); `CoordinationUnavailable` if etcd does
        not answer by the deadline."""
        missing = await self.missing_dcp_files(step_node)
        others = await self._other_writers_files(step_node, deadline)
        if others is None:
            return False
        missing |= set(others.held)
        step_path = self.tree.relpath(step_node)
        old = self._old_copies(step_node) if self.sealed is not None else set()
        if not missing and not old:
            return True
        if self.sealed is None:
            log.info("commit of %s waits for %s, named by its .metadata", step_path,
                     some_names(missing))
            return False
        step = step_node.step
        base = step.base
        early = min(deadline, trio.current_time() + ASK_PEERS_AFTER)
        try:
            found = await self.sealed.collect(step_path, missing | old, early, base)
        except CoordinationUnavailable:
            if early >= deadline:
                raise
            found = {}  # etcd slow for a moment: the wait below is the one that counts
        on_peers = None
        if not missing <= set(found) and self.shards is not None:
            on_peers = await self.shards.ask(step_path, missing - set(found), deadline)
            if not on_peers.held and not on_peers.unanswered:
                log.info("commit of %s waits for %s, named by its .metadata: no node has "
                         "them yet", step_path, some_names(missing - set(found)))
                return False
        if not (missing | old) <= set(found) and early < deadline:
            found = await self.sealed.collect(step_path, missing | old, deadline, base)
        if not missing <= set(found):
            if on_peers is not None:
                raise CoordinationUnavailable(self._unrecorded(missing - set(found), on_peers))
            log.info("commit of %s waits for %s from other nodes", step_path,
                     ", ".join(sorted(missing - set(found))))
            return False
        if self.tree.find_step(step_path) is not step_node or step_node.step is not step:
            return False
        if old - set(found):
            log.info("commit of %s: no node saved %s again; as it was", step_path,
                     some_names(old - set(found)))
        elsewhere = self._elsewhere.setdefault(step_path, set())
        for name, (peer, entry) in found.items():
            node = tree_walk.entry_node(step_node, name)
            if node is not None and node.remote is None:  # a copy of the committed version
                if node.seal is not None and node.seal.digest.xxh3 == entry.xxh3:
                    continue  # saved again with the same bytes: the copy here is the file
                if self._residents.evict_file(step, step.manifest.entry(name), node) is None \
                        and node.remote is None:
                    log.info("commit of %s waits: its old copy of %s here is open", step_path,
                             name)
                    return False
            self.versions.add_holder(step_node, peer)
            self._residents.add_remote_files(step_node, [entry], step_path)
            elsewhere.add(name)
        if found:
            log.info("commit of %s names %d files held on %s: they stay there", step_path,
                     len(found), ", ".join(sorted({peer for peer, _e in found.values()})))
        self.versions.give_written_dirs(others.dirs.values())
        return True

    def note_saving(self, step_node: Node) -> None:
        """A save of this step goes on here (its first change since its commit, its mkdir, a
        file's close): in a cluster, the nodes record that they write it
        (`SealedCollector.note_writer`), once per save, so that its committer takes their
        files (`_other_writers_files`)."""
        if self.sealed is None or not step_node.is_dir or step_node.step is None:
            return
        base = step_node.step.base
        try:
            step_path = self.tree.relpath(step_node)
        except FsError:
            return
        known = self._saving.get(step_path)
        if known is None or known[0] != base:
            recorded = trio.Event()
            self._saving[step_path] = (base, recorded)
            self.background.spawn(self._note_writer, step_path, base, recorded)

    async def _note_writer(self, step_path: str, base: int, recorded: trio.Event) -> None:
        assert self.sealed is not None
        try:
            await self.sealed.note_writer(step_path, base)
        finally:
            recorded.set()

    async def saving_recorded(self, step_node: Node) -> None:
        """Returns once etcd knows that this node writes the save of the step under way
        (`note_saving`), or after WRITER_WAIT (etcd slow or away: the record follows)."""
        try:
            known = self._saving.get(self.tree.relpath(step_node))
        except FsError:
            return
        if known is not None:
            with trio.move_on_after(WRITER_WAIT):
                await known[1].wait()

    async def _other_writers_files(self, step_node: Node, deadline: float
                                   ) -> FilesOnPeers | None:
        """The files other nodes write of this save of a step directory, which its commit
        takes with those written here (`held`, with the directories that hold them there,
        `dirs`): DeepSpeed's and Megatron-LM's ranks write their files
        of one step on every node, with no `.metadata` naming them (a DCP step's names them
        all: none asked). The nodes are those that recorded that they write it
        (`note_saving`), each asked which files; while etcd cannot say, every live peer.
        None while one of them has a file of it open for writing (its save goes on: the
        commit waits), or another node committed this save already (this node joins its
        commit instead); `CoordinationUnavailable` if one cannot say (down, unreachable) by
        `deadline`: the step must not commit without its files."""
        if self.sealed is None or self.shards is None or not step_node.is_dir \
                or METADATA in (step_node.children or {}):  # a DCP step: it names its files
            return FilesOnPeers({}, set())
        step_path = self.tree.relpath(step_node)
        base = step_node.step.base
        writers = await self.sealed.other_writers(step_path, base, deadline,
                                                  self._previous_step(step_node))
        if writers is not None and not writers:
            return FilesOnPeers({}, set())  # (None: etcd cannot say, every live peer is asked)
        said = await self.shards.written(step_path, writers, deadline)
        committed = sorted(node for node, version in said.versions.items() if version > base)
        if committed:
            log.info("commit of %s waits: %s committed this save, which this node joins",
                     step_path, ", ".join(committed))
            return None
        if said.unanswered:
            nodes = sorted(said.unanswered)
            raise CoordinationUnavailable(
                f"{', '.join(nodes)} {'write' if len(nodes) > 1 else 'writes'} files of "
                f"{step_path} and did not say which (down, or unreachable?)",
                waits_for="the nodes that write it")
        if said.writing:
            log.info("commit of %s waits for %s, being written on %s", step_path,
                     some_names(set(said.writing)), ", ".join(sorted(set(said.writing.values()))))
            return None
        written = self._residents.written_in_save
        for rel, node in tree_walk.files_under(step_node):
            if written(step_node.step, rel, node):
                said.held.pop(rel, None)
        return said

    def _previous_step(self, step_node: Node) -> str | None:
        """The committed step saved before this one beside it (the highest number below
        its), whose writers this one's commit expects (`SealedCollector.other_writers`)."""
        number, parent = step_node.step.number, step_node.parent
        if number is None or parent is None:
            return None
        older = [n for n in parent.children.values() if n.is_dir and n.step is not None
                 and n.step.committed and n.step.number is not None and n.step.number < number]
        if not older:
            return None
        try:
            return self.tree.relpath(max(older, key=lambda n: n.step.number))
        except FsError:
            return None

    @staticmethod
    def _unrecorded(names: set[str], on_peers: FilesOnPeers) -> str:
        """Why files a `.metadata` names have no record in etcd by the commit's deadline."""
        held: dict[str, list[str]] = {}
        for name in names & set(on_peers.held):
            held.setdefault(on_peers.held[name], []).append(name)
        why = [f"{node} wrote {some_names(files)} and did not record "
               f"{'them' if len(files) > 1 else 'it'} in etcd (cut off from etcd? or its daemon "
               "restarted before it did: a save cut short there, written again or removed)"
               for node, files in sorted(held.items())]
        rest = names - set(on_peers.held)
        if rest:
            why.append(f"{some_names(rest)} may be on {', '.join(sorted(on_peers.unanswered))}, "
                       "which did not answer (down?)" if on_peers.unanswered
                       else f"{some_names(rest)} had no record in time")
        return "; ".join(why)

    def _old_copies(self, step_node: Node) -> set[str]:
        """Files its `.metadata` names that a step saved again has here only as they were in
        its committed version: a copy held here that was not written since
        (`Residents.unchanged_since_commit`), or a file held elsewhere whose entry is still the
        old one; not those this commit located already."""
        step = step_node.step
        old = step.manifest
        if old is None or step.committed or step.dcp_files is None:
            return set()
        if old.path != self.tree.relpath(step_node):
            return set()  # renamed since: its files are its own, nobody saves them again there
        located = self._elsewhere.get(self.tree.relpath(step_node), set())
        found = set()
        for rel, node in tree_walk.files_under(step_node):
            entry = old.entry(rel)
            if entry is None or rel in located or rel not in step.dcp_files[1]:
                continue
            if (node.remote.entry.xxh3 == entry.xxh3 if node.remote is not None
                    else self._residents.unchanged_since_commit(step, rel, node)):
                found.add(rel)
        return found

    def held_elsewhere(self, step_node: Node) -> set[str]:
        """Files of the step being committed here that other nodes wrote and keep."""
        return self._elsewhere.get(self.tree.relpath(step_node), set())

    async def missing_dcp_files(self, step_node: Node) -> set[str]:
        """Files the step's DCP `.metadata` names that are not in the directory (none when it
        has no readable `.metadata`: such a step commits with the files at hand). The
        `.metadata` is decoded in a thread."""
        metadata = (step_node.children or {}).get(METADATA)  # none for a single file
        if metadata is None or metadata.remote is not None:
            return set()
        try:
            with open(self.tree.backing(metadata), "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_ino, st.st_size, st.st_mtime_ns)
                if step_node.step.dcp_files is None or step_node.step.dcp_files[0] != key:
                    data = f.read()
                    expected = await trio.to_thread.run_sync(dcp_metadata.shard_files, data)
                    self._manifests.note_dcp_files(step_node.step, key, expected)
        except (OSError, FsError, dcp_metadata.MetadataError) as exc:
            log.info("commit of %s uses the files at hand: %s", self.tree.relpath(step_node),
                     exc)
            return set()
        expected = step_node.step.dcp_files[1]
        return expected - {rel for rel, _node in tree_walk.files_under(step_node)}

    # -- seal records ------------------------------------------------------------------------

    def note_sealed(self, node: Node) -> None:
        """A file's last writer is done: the cluster records that this node holds it, once its
        seal (hashed in the background, `fs.tree.sealing`) exists. A file sealed already (a
        small one, at its close) joins the seals' next batch at once, and one task writes the
        batches: a save of many small files spawns no task per file."""
        step_node = next(tree_walk.enclosing_steps(node.parent), None)
        if self.sealed is None or step_node is None or node.remote is not None:
            return
        self.note_saving(step_node)  # a save begun while the step was still watched
        if node.seal is None:
            self.background.spawn(self._record_sealed, node, step_node)
            return
        if self._queue_sealed(node, step_node) and not self._writing_seals:
            self._writing_seals = True
            self.background.spawn(self._write_seals)

    def note_attributes(self, node: Node) -> None:
        """A file's mode, owner or mtime changed after its close: one this node writes for the
        save under way of a step is recorded again (`note_sealed`), since the committer of a
        step saved on several nodes takes this node's files from their records (a `chmod`
        after the save; `rsync -a` and `tar x` set them after each file's close, and the
        record still queued is the one replaced)."""
        if self.sealed is None or node.parent is None or node.active_writers \
                or node.open_for_writing:
            return  # (no walk up the tree: `tar x` and `rsync -a` set them on every file)
        step_node = next(tree_walk.enclosing_steps(node.parent), None)
        if step_node is None or step_node.step is None:
            return
        rel = tree_walk.path_below(step_node, node)
        if rel is not None and self._residents.written_in_save(step_node.step, rel, node):
            self.note_sealed(node)

    async def _record_sealed(self, node: Node, step_node: Node) -> None:
        """`note_sealed` of a file whose hash runs: recorded once the hash is joined."""
        assert self.sealed is not None
        with contextlib.suppress(OSError, FsError):  # gone meanwhile
            await self.tree.seal(node)  # joins the background hash
        if node.seal is not None and self._queue_sealed(node, step_node):
            await self.sealed.write_queued()
        # (no seal: written again meanwhile, and its next close records it)

    def _queue_sealed(self, node: Node, step_node: Node) -> bool:
        """Queue `node`'s seal for its record (False: it left the step meanwhile). Its entry
        is taken now: a seal queued before a commit of its step is in the batches that commit
        knows of (`ClusterCommits.publish` drops those a rename left stale)."""
        assert self.sealed is not None and node.seal is not None
        rel = tree_walk.path_below(step_node, node)
        if rel is None:
            return False
        try:
            entry = mf.entry_from_stat(rel, node.seal.digest, os.lstat(self.tree.backing(node)))
            step_path = self.tree.relpath(step_node)
        except (OSError, FsError):
            return False  # gone meanwhile
        self.sealed.queue_sealed(step_path, [entry],
                                 step_node.step.base if step_node.step is not None else 0)
        return True

    async def _write_seals(self) -> None:
        assert self.sealed is not None
        try:
            while self.sealed.seals_queued:
                await self.sealed.write_queued()
        finally:
            self._writing_seals = False

    # -- the commit's record -----------------------------------------------------------------

    async def publish(self, step_node: Node, manifest: mf.StepManifest,
                      deadline: float | None) -> bool:
        """This node committed `manifest`: the cluster learns it (a commit record in etcd),
        before the saver's call returns, by `deadline` (trio time; None: the collector's
        own). Without etcd the step is
        committed here and its record is written by a later retry (`publish_pending`): False
        (`awaits_publication`)."""
        self._elsewhere.pop(manifest.path, None)
        self._saving.pop(manifest.path, None)
        if self.sealed is None:
            return True
        try:
            await self.sealed.publish(manifest, set(step_node.step.resident), deadline)
        except TierError as exc:  # etcd unreachable, or a record refused: retried later
            log.warning("the cluster does not know of %s v%d yet: %s", manifest.path,
                        manifest.version, exc)
            self._unpublished[manifest.path] = manifest
            return False
        return True

    def awaits_publication(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is committed here but etcd lacks its commit record."""
        return self._unpublished.get(manifest.path) is manifest

    def publish_later(self, manifest: mf.StepManifest) -> None:
        """A step committed here whose commit record etcd lacks: written by `publish_pending`.
        The copies this node's marks name for it are forgotten (`StepVersions.forget_holders`:
        no copy is made before its commit record, so they belong to records that are gone);
        the record written names this node, and the copies are made anew."""
        node = self.tree.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest and \
                (node.step.replicas or node.step.holders):
            log.info("%s v%d: etcd has no record of it; the copies this node knew of (%s) "
                     "are not counted", manifest.path, manifest.version,
                     ", ".join(sorted(node.step.replicas | node.step.holders)))
            self.versions.forget_holders(node)
        self._unpublished[manifest.path] = manifest

    async def publish_pending(self) -> None:
        """Commit records that etcd could not take before (it was down): try again."""
        for path, manifest in list(self._unpublished.items()):
            node = self.tree.find_step(path)
            del self._unpublished[path]
            if node is not None and node.step.manifest is manifest:
                await self.publish(node, manifest, None)
