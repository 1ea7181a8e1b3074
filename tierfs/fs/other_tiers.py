"""The namespace's view of copies elsewhere: steps in the persistent tier, replicas on peers,
steps the cluster's gossip tells of, the files of a multi-node DCP step written on other
nodes, and deletes, which must reach all of them (`fs.deletes`). A mixin of Namespace."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import trio

from tierfs import manifest as mf
from tierfs.fs import dcp_metadata
from tierfs.fs.deletes import DELETES_DIR, PERSIST, Deletes, peer_target
from tierfs.fs.fetch import apply_attributes
from tierfs.fs.nodes import (
    MANIFEST,
    METADATA,
    PEERS_MARK,
    REPLICAS_MARK,
    FsError,
    Node,
    Seal,
    StepState,
    some_names,
)

log = logging.getLogger(__name__)


class OtherTiers:
    """Copies of steps in the persistent tier and on peers, as this node knows them."""

    @functools.cached_property
    def deletes(self) -> Deletes:
        """This RAM dir's record of deleted steps (made on first use)."""
        return Deletes(Path(self.store.root) / DELETES_DIR)

    def step_removed(self, step: StepState) -> None:
        """Call-out of the namespace: a step directory leaves the tree (rmdir, or a directory
        renamed over it). If it held a committed version (even one being re-saved), that
        version is deleted from every tier, and never listed again."""
        if step.manifest is not None:
            self.deletes.record(step.manifest.path, step.manifest.version,
                                step.manifest.committed_ns)

    def delete_from_peer(self, path: str, version: int, committed_ns: int,
                         sender: str) -> None:
        """A peer deleted this step: drop this node's copy of it (if not newer), remember the
        delete, and remove it from the persistent tier too (an upload from here may be late)."""
        self.deletes.record(path, version, committed_ns,
                            [PERSIST] if PERSIST in self.deletes.targets else [])
        node = self.find_step(path)
        step = node.step if node is not None else None
        if step is None or step.manifest is None or step.manifest.committed_ns > committed_ns:
            return
        if step.committed:
            self._forget_step(node, f"deleted on {sender}")
            return
        # Being re-saved here: the files at hand stay, as a step that is not committed.
        for _rel, child in list(self._files_under(node)):
            if child.remote is not None:
                self._drop_fetch(child)
                self._detach(child)
        self._remove_hidden(node, self.backing(node))
        log.info("%s was deleted on %s; the version being written here stays", path, sender)

    def _deleted(self, manifest: mf.StepManifest, offered_by: list[str]) -> bool:
        """Whether `manifest` is a deleted version; the tiers that offer it get cleaned."""
        if not self.deletes.covers(manifest):
            return False
        self.deletes.remind(manifest, offered_by)
        return True

    def find_step(self, relpath: str) -> Node | None:
        node = self.root
        try:
            for part in relpath.split("/"):
                node = self.child(node, os.fsencode(part))
        except FsError:
            return None
        return node if node.is_dir and self.step_of(node) is not None else None

    def is_current(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is still the committed version of its step (worth uploading)."""
        node = self.find_step(manifest.path)
        return node is not None and node.step.manifest is manifest

    def committed_manifests(self) -> list[mf.StepManifest]:
        """Committed steps in RAM whose version has not reached the persistent tier."""
        found = []
        for node in self.steps():
            step = node.step
            if step.committed and not step.persisted and step.in_ram and \
                    step.manifest.node_id == self.node_id and \
                    step.retired_version != step.manifest.version:
                found.append(step.manifest)
        return sorted(found, key=lambda m: (m.step, m.path))

    def mark_persisted(self, manifest: mf.StepManifest) -> None:
        node = self.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest:
            self._write_persist_mark(node, manifest.version, "persisted")
            node.step.persisted_version = manifest.version
            self.enforce_keep_ram()

    def mark_retired(self, relpath: str) -> None:
        """Retention removed the step from the persistent tier: never upload it again."""
        node = self.find_step(relpath)
        if node is None or node.step.manifest is None:
            return
        if not node.step.in_ram and not node.step.dirty:
            self._forget_step(node)  # both policies let it go: it is gone from tierfs
            return
        version = node.step.manifest.version
        self._write_persist_mark(node, version, "retired")
        node.step.persisted_version = 0
        node.step.retired_version = version

    def _forget_step(self, step_node: Node, why: str = "") -> None:
        for _rel, node in list(self._files_under(step_node)):
            if node.remote is None:
                self._unlink_backing(self.backing(node), node)
            self._drop_fetch(node)
            self._detach(node)
        self._drop_resident_refs(step_node.step)
        shutil.rmtree(self.backing(step_node))
        self._detach_tree(step_node)
        log.info("%s %s", os.fsdecode(step_node.name), why or "left the last tier that held it")

    def _detach_tree(self, node: Node) -> None:
        for child in list((node.children or {}).values()):
            self._detach_tree(child)
        self._detach(node)

    def _peer_holders(self, step: StepState) -> list[str]:
        """Other nodes known to hold the committed version: replicas of ours, or the owner."""
        if not step.committed:
            return []
        known = step.replicas | step.holders
        if step.manifest.node_id != self.node_id:
            known = known | {step.manifest.node_id}
        return sorted(known - {self.node_id})

    def _tiers(self, step: StepState, in_ram: bool) -> str:
        tiers = ["ram"] if in_ram else []
        tiers += [f"peer:{peer}" for peer in self._peer_holders(step)]
        if step.persisted:
            tiers.append("persist")
        return ",".join(tiers)

    def _committed_step_holding(self, node: Node) -> StepState | None:
        for step_node in self._enclosing_steps(node if node.is_dir else node.parent):
            step = self.step_of(step_node)
            if step is not None:
                return step if step.committed else None
        return None

    def adopt_persisted(self, manifest: mf.StepManifest) -> bool:
        """Show a step found in the persistent tier (a fresh node, or one that left RAM).

        A step this node already has, in any state, is left as it is, and a deleted one is not
        shown. Returns whether the step was added."""
        if self._deleted(manifest, [PERSIST]):
            return False
        node = self.find_step(manifest.path)
        if node is not None:
            step = node.step
            if (step.manifest is not None and step.manifest.version == manifest.version
                    and step.manifest.same_content(manifest) and not step.persisted):
                self._write_persist_mark(node, manifest.version, "persisted")
                step.persisted_version = manifest.version
            elif step.committed and self._supersede(
                    node, manifest, "the persistent tier",
                    lambda: self._write_persist_mark(node, manifest.version, "persisted"),
                    release=True) is not None:
                step.persisted_version = manifest.version
                self._add_remote_files(node, list(manifest.files))
            return False
        step_node = self._install_step(manifest, "the persistent tier")
        if step_node is None:
            return False
        self._write_persist_mark(step_node, manifest.version, "persisted")
        step_node.step.persisted_version = manifest.version
        self._add_remote_files(step_node, list(manifest.files))
        return True

    def adopt_replica(self, manifest: mf.StepManifest, sender: str) -> bool:
        """Install a replica whose files a peer has sent and this node has verified (they are
        committed objects here already). Returns whether this node now holds that version: a
        step here in the same version is filled in, an older committed version that nothing
        here is writing or reading is superseded, anything else is left as it is."""
        if self._deleted(manifest, [peer_target(sender)]):
            return False
        existing = self.find_step(manifest.path)
        old_refs: list[str] = []
        if existing is not None:
            step = existing.step
            if step.manifest is not None and step.manifest.version == manifest.version:
                self._fill_from_objects(existing)  # e.g. a multi-node DCP step held in part
                return True
            superseded = self._supersede(existing, manifest, f"node {sender}")
            if superseded is None:
                return False
            step_node, old_refs = existing, superseded
        else:
            installed = self._install_step(manifest, f"node {sender}")
            if installed is None:
                return False
            step_node = installed
        # The manifest is on disk first: a crash from here on is repaired by _restore_step.
        step = step_node.step
        for entry in manifest.files:
            parent, name = self._entry_parent(step_node, entry.name)
            path = os.path.join(self.backing(parent), name)
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(self.store.object_path(entry.xxh3), tmp)
            apply_attributes(tmp, entry)
            os.rename(tmp, path)
            node = self._attach(parent, name, stat.S_IFREG)
            node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks),
                             os.lstat(path).st_ino)
            self.store.add_ref(entry.xxh3, path)
            step.resident.add(entry.name)
        for digest in old_refs:  # after the new refs: objects both versions share stay
            self.store.drop_ref(digest)
        log.info("holding a replica of %s v%d from %s (%d files, %d bytes)", manifest.path,
                 manifest.version, sender, len(manifest.files), manifest.total_bytes)
        return True

    def _write_peers_mark(self, step_node: Node, version: int, holders: set[str]) -> None:
        line = " ".join([str(version), *sorted(holders)])
        self._write_file_atomically(os.path.join(self.backing(step_node), PEERS_MARK),
                                    line.encode())

    def _supersede(self, step_node: Node, manifest: mf.StepManifest, source: str,
                   record: Callable[[], None] | None = None, *,
                   release: bool = False) -> list[str] | None:
        """A newer version of a step committed elsewhere replaces the older committed version
        this node holds (it was away while the step was re-saved): never let the old bytes
        shadow the new commit. Refused (None) unless `manifest` is newer and nothing here
        writes, commits or reads the step; the caller retries (gossip, replication).

        On disk, `record` first notes where the new version's files are (peers, the
        persistent tier), so that a restart finds them; then the new manifest replaces the
        old one; then the old files leave the tree. The old version's object digests are
        released here (`release`) or returned for the caller to release once the new version
        holds its own references (objects both versions share must stay)."""
        step = step_node.step
        old = step.manifest
        if (old is None or manifest.version <= old.version or step.dirty
                or step.commit_pending or self._busy(step_node)):
            return None
        if record is not None:
            record()
        self._write_file_atomically(os.path.join(self.backing(step_node), MANIFEST),
                                    mf.encode(manifest))
        old_refs = [old.entry(name).xxh3 for name in step.resident]
        for _rel, node in list(self._files_under(step_node)):
            if node.remote is None:
                self._unlink_backing(self.backing(node), node)
            self._drop_fetch(node)
            self._detach(node)
        step.manifest = manifest
        step.resident = set()
        step.replicas = set()
        step.holders = set()
        step.persisted_version = 0
        step.retired_version = 0
        log.warning("%s v%d here is superseded by v%d from %s", manifest.path,
                    old.version, manifest.version, source)
        if release:
            for digest in old_refs:
                self.store.drop_ref(digest)
            return []
        return old_refs

    def _install_step(self, manifest: mf.StepManifest, source: str) -> Node | None:
        """The directories of a step committed elsewhere, and its manifest, written first."""
        parent = self.root
        for part in map(os.fsencode, manifest.path.split("/")):
            child = parent.children.get(part)
            if child is None:
                os.mkdir(os.path.join(self.backing(parent), part), 0o755)
                child = self._attach(parent, part, stat.S_IFDIR)
                number = self.step_number_at(parent, part)
                if number is not None:
                    child.step = StepState(number)
            elif not child.is_dir:
                log.warning("step %s from %s is hidden by a file here", manifest.path, source)
                return None
            parent = child
        step = self.step_of(parent)
        if step is None or step.manifest is not None or parent.children:
            log.warning("step %s from %s does not fit this namespace (step pattern, or a "
                        "directory of that name in use)", manifest.path, source)
            return None
        self._write_file_atomically(os.path.join(self.backing(parent), MANIFEST),
                                    mf.encode(manifest))
        step.manifest = manifest
        step.dirty = False
        step.resident = set()
        return parent

    def replica_holders(self, manifest: mf.StepManifest) -> set[str]:
        """Peers known to hold this version (replicas, the writer, gossip)."""
        node = self.find_step(manifest.path)
        if node is None or node.step.manifest is not manifest:
            return set()
        return set(self._peer_holders(node.step))

    def mark_replicated(self, manifest: mf.StepManifest, peer: str) -> None:
        node = self.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest:
            node.step.replicas.add(peer)
            self._write_node_list(node, REPLICAS_MARK, node.step.replicas)
            self.enforce_keep_ram()

    def held_manifests(self) -> list[mf.StepManifest]:
        """Committed steps whose files are all in this node's RAM, whoever wrote them."""
        return [manifest for manifest, _holders in self.holdings()]

    def owned_manifests(self) -> list[mf.StepManifest]:
        """Committed steps this node made and holds (not replicas it holds for others)."""
        return sorted((n.step.manifest for n in self.steps()
                       if n.step.committed and n.step.in_ram
                       and n.step.manifest.node_id == self.node_id),
                      key=lambda m: (m.step, m.path))

    def holdings(self) -> list[tuple[mf.StepManifest, list[str]]]:
        """Committed steps whose files are all in this node's RAM, with who else holds them."""
        return [(n.step.manifest, [self.node_id, *self._peer_holders(n.step)])
                for n in self.steps() if n.step.committed and n.step.in_ram]

    def learn(self, manifest: mf.StepManifest, holders: list[str]) -> None:
        """A peer holds this committed step: list it here, readable from those holders."""
        others = set(holders) - {self.node_id}
        if self._deleted(manifest, [peer_target(h) for h in sorted(others)]):
            return
        node = self.find_step(manifest.path)
        if node is not None:
            step = node.step
            if step.manifest is not None and step.manifest.version == manifest.version:
                if not others <= step.holders:
                    step.holders |= others
                    if not step.in_ram:
                        self._write_node_list(node, PEERS_MARK, step.holders)
            elif not step.committed:
                self._join_cluster_commit(node, manifest, others)
            elif self._supersede(node, manifest, ", ".join(sorted(others)),
                                 lambda: self._write_peers_mark(node, manifest.version, others),
                                 release=True) is not None:
                step.holders = others
                self._add_remote_files(node, list(manifest.files))
            return
        step_node = self._install_step(manifest, f"node {', '.join(sorted(others))}")
        if step_node is None:
            return
        step_node.step.holders = others
        self._write_node_list(step_node, PEERS_MARK, others)
        self._add_remote_files(step_node, list(manifest.files))
        log.info("%s v%d is in the cluster (held by %s)", manifest.path, manifest.version,
                 ", ".join(sorted(others)))

    def _join_cluster_commit(self, step_node: Node, manifest: mf.StepManifest,
                             others: set[str]) -> None:
        """Another node committed this step (multi-node DCP) while ranks here wrote some of
        its files: if every file here is sealed with the content the manifest names, this
        node's copy is committed as the same version; otherwise it stays `writing`."""
        step = step_node.step
        local = list(self._files_under(step_node))
        for rel, node in local:
            entry = manifest.entry(rel)
            if (entry is None or node.remote is not None or node.seal is None
                    or node.active_writers or node.seal.digest.xxh3 != entry.xxh3):
                log.warning("%s here differs from the version %s committed: kept as writing",
                            self.relpath(step_node), ", ".join(sorted(others)))
                return
        self._write_file_atomically(os.path.join(self.backing(step_node), MANIFEST),
                                    mf.encode(manifest))
        self._drop_resident_refs(step)
        for rel, node in local:
            self.store.add_ref(manifest.entry(rel).xxh3, self.backing(node))
        step.manifest = manifest
        step.resident = {rel for rel, _node in local}
        step.dirty = False
        step.commit_pending = False
        step.holders = others
        self._write_node_list(step_node, PEERS_MARK, others)
        self._add_remote_files(step_node, [e for e in manifest.files
                                           if e.name not in step.resident])
        log.info("%s v%d committed on %s; this node holds %d of its files", manifest.path,
                 manifest.version, ", ".join(sorted(others)), len(local))

    def holders_of(self, step_path: str) -> list[str]:
        node = self.find_step(step_path)
        if node is None:
            return []
        return sorted((node.step.holders | set(self._peer_holders(node.step)))
                      - {self.node_id})

    def sealed_files(self, step_path: str, names: list[str]) -> list[mf.FileEntry]:
        """Which of these files of `step_path` this node holds sealed (for a peer's commit)."""
        step_node = self.find_step(step_path)
        if step_node is None:
            return []
        found = []
        wanted = set(names)
        for rel, node in self._files_under(step_node):
            if (rel in wanted and node.remote is None and node.seal is not None
                    and node.active_writers == 0):
                found.append(mf.entry_from_stat(rel, node.seal.digest,
                                                os.lstat(self.backing(node))))
        return found

    def sealed_path(self, step_path: str, name: str, xxh3: str) -> bytes | None:
        """The RAM store path of a sealed file with exactly this content, if held here."""
        step_node = self.find_step(step_path)
        if step_node is None:
            return None
        for rel, node in self._files_under(step_node):
            if (rel == name and node.remote is None and node.seal is not None
                    and node.seal.digest.xxh3 == xxh3 and node.active_writers == 0):
                return self.backing(node)
        return None

    async def _pull_missing_dcp_files(self, step_node: Node) -> bool:
        """Before a DCP step commits, every shard its `.metadata` names must be here: on a
        single node (`cp -r`, `rsync`, `tar` may write `.metadata` first) by waiting for them,
        on several nodes by bringing in the shards other nodes' ranks wrote. False while some
        are missing (`missing_dcp_files` names them)."""
        missing = await self.missing_dcp_files(step_node)
        if not missing:
            return True
        step_path = self.relpath(step_node)
        if self.collect_sealed is None:
            log.info("commit of %s waits for %s, named by its .metadata", step_path,
                     some_names(missing))
            return False
        found = await self.collect_sealed(step_path, missing)
        if set(found) != missing:
            log.info("commit of %s waits for %s from other nodes", step_path,
                     ", ".join(sorted(missing - set(found))))
            return False
        if self.find_step(step_path) is not step_node:
            return False
        for name, (peer, entry) in found.items():
            if name not in {rel for rel, _n in self._files_under(step_node)}:
                step_node.step.holders.add(peer)
                self._add_remote_files(step_node, [entry], step_path)
        log.info("commit of %s pulls %d files written on %s", step_path, len(found),
                 ", ".join(sorted({peer for peer, _e in found.values()})))
        return True

    async def missing_dcp_files(self, step_node: Node) -> set[str]:
        """Files the step's DCP `.metadata` names that are not in the directory (none when it
        has no readable `.metadata`: such a step commits with the files at hand)."""
        metadata = step_node.children.get(METADATA)
        if metadata is None or metadata.remote is not None:
            return set()
        try:
            with open(self.backing(metadata), "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_ino, st.st_size, st.st_mtime_ns)
                if step_node.step.dcp_files is None or step_node.step.dcp_files[0] != key:
                    data = f.read()
                    expected = await trio.to_thread.run_sync(dcp_metadata.shard_files, data)
                    step_node.step.dcp_files = (key, expected)  # pending commits ask again
        except (OSError, FsError, dcp_metadata.MetadataError) as exc:
            log.info("commit of %s uses the files at hand: %s", self.relpath(step_node), exc)
            return set()
        expected = step_node.step.dcp_files[1]
        return expected - {rel for rel, _node in self._files_under(step_node)}

    async def retry_pending_commits(self) -> None:
        """Commits left pending (writers, or shards not yet found on other nodes) try again."""
        for step_node in list(self.steps()):
            if step_node.step.commit_pending and not self._has_active_writers(step_node):
                await self._commit_quietly(step_node)
