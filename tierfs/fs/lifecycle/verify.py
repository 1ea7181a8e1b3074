"""Checking committed files against their manifests on every tier, and repairing bad copies.

Three ways in, one rule: a copy whose bytes do not hash to its manifest entry is never served.

* **At start**, every committed object in the RAM dir is *unverified* (a crash, a stray writer
  or a bad DIMM may have changed it while no daemon watched). A background scan hashes them
  all; until it reaches a file, opening that file for reading hashes it first (once). A bad
  object is *quarantined*: it leaves service (the tree file and the object go) and the file
  becomes non-resident, so its reads go to the other tiers (peers, then the persistent tier),
  checked chunk by chunk, or fail with EIO; its bytes are kept, never destroyed, under
  `<ram-dir>/quarantine/` until a verified copy replaces them. Then the scan tries to bring
  the file back from a good copy. In a cluster, the file's record stops counting this node
  as a holder (in the background), so that the other holders restore a copy.
  Files committed, fetched or received while the daemon runs were hashed on the way in.
  Reads are not checked one by one: with FUSE passthrough the kernel reads resident files
  itself, so the check is per object (at start, at first open, and by `tierfs verify`).
* **`tierfs verify PATH`** checks every committed step under PATH on every tier that holds
  it: this node's RAM (hashing the files), each peer holder of each file (the holders its
  record in the cluster names, else those known here; the peer hashes its own copy and,
  when asked to repair, quarantines a bad one and pulls a good copy back, verified), and the
  persistent tier (reading every object back and checking its size and every chunk; a bad
  object is uploaded again from a verified copy, fetched into RAM first if needed). A peer
  that cannot be asked (down, or not answering) is *unreachable*: not a fault of its copies,
  but they do not count. Each step then says which of its files have no good copy on any
  reachable tier (*lost*, with their last holders) and which have fewer good copies in RAM
  (here and on peers) than K + 1 and none in the persistent tier (*short*).

What a repair may do: copy only *from* a copy verified good against the manifest (a fetch is
checked chunk by chunk and whole; an empty file needs another tier to confirm it holds it
empty), never from a copy merely different from a bad one. `--no-repair` reports and changes
nothing: not this node's RAM, not a peer's copy, not the persistent tier.

The tiers are injected (`PeerCopies`, `PersistCopies`, from `fs.model.ports`): `fs` imports
neither.
The `Verifier` holds the `Tree` (which takes a bad copy out of service: `Residents.quarantine`),
`BringBack` (which brings a good copy back, verified) and `Repairs` (which reports what is bad
or missing); it is the `ReadGate` of `Namespace.open`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
import xxhash

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import FsError, Node, StepState
from tierfs.fs.model.ports import (
    BringBack,
    ObjectMissing,
    PeerCopies,
    PersistCopies,
    Repairs,
    TierError,
)

if TYPE_CHECKING:
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.holders import Holdings
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.tree import Tree

__all__ = ["PeerCopies", "PersistCopies", "StepReport", "TierReport", "Verifier", "describe",
           "lost_files", "short_files"]

log = logging.getLogger(__name__)

GOOD, BAD, MISSING, REPAIRED = "good", "bad", "missing", "repaired"
# What a check may do about a bad RAM copy: only say so; take it out of service (its bytes
# kept); or take it out of service and bring a verified copy back.
REPORT, QUARANTINE, REPAIR = "report", "quarantine", "repair"
QUARANTINE_DIR = "quarantine"


@dataclass
class TierReport:
    tier: str
    good: int = 0
    bad: list[str] = field(default_factory=list)        # bad and not repaired
    missing: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    error: str = ""                                     # the tier could not be checked
    # A peer that does not hold a file (left its RAM, or holds only its own shards of a
    # multi-node DCP step): not a fault of that copy; "any tier" says if no good copy is left.
    not_held: list[str] = field(default_factory=list)
    held_good: set[str] = field(default_factory=set)    # good or repaired here
    kept: list[str] = field(default_factory=list)       # where bad RAM bytes were set aside
    # A peer that could not be asked (down, or not answering): its copies do not count, and
    # whether a file is lost for want of them is the step's verdict, not this tier's.
    unreachable: str = ""

    @property
    def ok(self) -> bool:
        return not (self.bad or self.missing or self.error)

    def as_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "good": self.good, "bad": self.bad, "missing": self.missing,
                "repaired": self.repaired, "error": self.error, "not_held": self.not_held,
                "kept": self.kept, "unreachable": self.unreachable, "ok": self.ok}


@dataclass
class StepReport:
    path: str
    version: int
    files: int
    bytes: int
    tiers: list[TierReport] = field(default_factory=list)
    # Files with no good copy on any reachable tier, and the nodes that held them last.
    lost: dict[str, list[str]] = field(default_factory=dict)
    # Files every one of whose good copies is in RAM (here, peers), fewer than `wanted`.
    short: dict[str, int] = field(default_factory=dict)
    wanted: int = 1  # K + 1

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "version": self.version, "files": self.files,
                "bytes": self.bytes, "tiers": [t.as_dict() for t in self.tiers],
                "lost": self.lost, "short": self.short, "wanted": self.wanted,
                "ok": all(t.ok for t in self.tiers)}


class Verifier:
    def __init__(self, tree: Tree, repairs: Repairs, bring_back: BringBack,
                 persist: PersistCopies | None = None,
                 peers: PeerCopies | None = None,
                 finish_pending: Callable[[Node], Awaitable[None]] | None = None, *,
                 store: RamStore, holdings: Holdings, residents: Residents) -> None:
        self.tree = tree
        self._store = store  # where a damaged object is set aside
        self._holdings = holdings  # which peers hold a file (checked there too)
        self._residents = residents  # a damaged object leaves its files
        # `Commits.finish_pending`: a step committed with its hashes to come is verified
        # once they are in (before, it has no manifest to check against).
        self._finish_pending = finish_pending
        self._repairs = repairs  # bad or missing copies reported
        self._bring_back = bring_back  # a good copy brought back from another tier
        self.persist = persist
        self.peers = peers
        self._threads = trio.CapacityLimiter(1)  # hashing must not starve the data path
        self._checking: dict[int, trio.Event] = {}
        # Backing inodes of committed files found in RAM at start: hashed before first use.
        self.unverified: set[int] = set()
        # (step path, version, file) whose RAM copy was found bad and has not come back, and
        # where its bytes are kept meanwhile.
        self.quarantined: set[tuple[str, int, str]] = set()
        self.kept: dict[tuple[str, int, str], bytes] = {}
        self.progress: dict[str, int] | None = None
        # RAM objects hashed by the start scan; bad RAM copies found and repaired, ever.
        self.scan_counts = {"checked": 0, "bad": 0, "repaired": 0}
        self.scan_done = trio.Event()

    # -- RAM objects found at start --------------------------------------------------------

    def collect_unverified(self) -> None:
        """Right after `Recovery.load`: every resident committed file is unverified."""
        for _step_node, _step, _entry, node in self._resident_files(None):
            if node.seal is not None:
                self.unverified.add(node.seal.backing_ino)

    async def before_read_open(self, node: Node) -> None:
        """The `ReadGate` of Namespace.open: an unverified resident file is hashed before it
        is read; a bad one is quarantined (its reads then go to the other tiers, or fail)."""
        if node.seal is None or node.seal.backing_ino not in self.unverified:
            return
        found = self._locate(node)
        if found is not None:
            await self._check_ram_file(*found, act=QUARANTINE)

    async def scan_at_start(self) -> None:
        """Hash every unverified RAM object in the background; quarantine and repair bad ones."""
        started = time.monotonic()
        try:
            for step_node, step, entry, node in list(self._resident_files(None)):
                if node.seal is None or node.seal.backing_ino not in self.unverified:
                    continue
                await self._check_ram_file(step_node, step, entry, node, act=REPAIR)
                self.scan_counts["checked"] += 1
            for path, version, name in sorted(self.quarantined):  # e.g. found by an open
                step_node = self.tree.find_step(path)
                if step_node is None or not self._current_version(step_node, version):
                    continue
                entry = step_node.step.manifest.entry(name)
                node = tree_walk.entry_node(step_node, entry.name) if entry else None
                if node is not None and node.remote is not None:
                    await self._repair_quarantined(node, step_node.step.manifest, entry)
        finally:
            self.scan_done.set()
        counts = self.scan_counts
        log.log(logging.ERROR if counts["bad"] > counts["repaired"] else logging.INFO,
                "RAM objects verified in %.2f s: %d files checked, %d bad, %d of them repaired "
                "from another tier", time.monotonic() - started, counts["checked"],
                counts["bad"], counts["repaired"])

    # -- `tierfs verify` ---------------------------------------------------------------------

    async def verify(self, relpath: str, repair: bool = True) -> list[StepReport]:
        step_nodes = self._steps_under(relpath)
        if self._finish_pending is not None:
            for step_node in step_nodes:
                await self._finish_pending(step_node)
        work = [(n, n.step.manifest) for n in step_nodes
                if n.step is not None and n.step.committed]
        if not work:
            raise FsError(errno.EINVAL, f"{relpath or '.'} holds no committed step")
        total = sum(e.size * (1 + len(self._holdings.file_peers(node.step, e.name))
                              + node.step.persisted)
                    for node, manifest in work for e in manifest.files)
        self.progress = {"checked_bytes": 0, "total_bytes": total, "steps": len(work),
                         "steps_done": 0}
        reports = []
        try:
            for step_node, manifest in work:
                reports.append(await self._verify_step(step_node, manifest, repair))
                self.progress["steps_done"] += 1
        finally:
            self.progress = None
        return reports

    async def _verify_step(self, step_node: Node, manifest: mf.StepManifest,
                           repair: bool) -> StepReport:
        report = StepReport(manifest.path, manifest.version, len(manifest.files),
                            manifest.total_bytes)
        step = step_node.step
        ram = TierReport("ram")
        for entry in manifest.files:
            node = tree_walk.entry_node(step_node, entry.name)
            if not self._current(step_node, manifest):
                ram.error = "the step changed while it was checked"
                break
            if node is not None and node.remote is not None and \
                    (manifest.path, manifest.version, entry.name) in self.quarantined:
                state = await self._repair_quarantined(node, manifest, entry) if repair else BAD
            elif node is None or node.remote is not None:
                continue  # not in this node's RAM: not a copy of this tier
            else:
                state = await self._check_ram_file(step_node, step, entry, node,
                                                   act=REPAIR if repair else REPORT, force=True)
            self._tally(ram, state, entry.name)
            kept = self.kept.get((manifest.path, manifest.version, entry.name))
            if kept is not None and state == BAD:
                ram.kept.append(os.fsdecode(kept))
            self._advance(entry.size)
        if ram.good or not ram.ok or ram.repaired:
            report.tiers.append(ram)
        asked = await self._peers_per_file(step, manifest)
        for peer in sorted({p for peers in asked.values() for p in peers}):
            entries = [e for e in manifest.files if peer in asked[e.name]]
            report.tiers.append(await self._verify_peer(peer, manifest, entries, repair))
        # (a step the store was seen to lack files of: the others are still there)
        if (step.persisted or step.store_lacking) and self._current(step_node, manifest):
            report.tiers.append(await self._verify_persisted(step_node, manifest, repair))
        self._judge(report, manifest, asked, ram)
        return report

    def _judge(self, report: StepReport, manifest: mf.StepManifest,
               asked: dict[str, set[str]], ram: TierReport) -> None:
        """The step's verdict: its lost files (no good copy on a tier reached: an "any
        tier" line), its short ones, and one log line."""
        report.wanted = self.peers.copies_wanted() if self.peers is not None \
            else self._repairs.replicas + 1
        in_ram = [t for t in report.tiers if t.tier == "ram" or t.tier.startswith("peer:")]
        stored = {name for t in report.tiers if t.tier == "persist" for name in t.held_good}
        for entry in manifest.files:
            name = entry.name
            copies = sum(name in t.held_good for t in in_ram)
            if not copies and name not in stored:
                held_here = name in ram.bad or name in ram.missing or \
                    (manifest.path, manifest.version, name) in self.quarantined
                report.lost[name] = sorted(asked.get(name, set())
                                           | ({self.tree.node_id} if held_here else set()))
            elif copies < report.wanted and name not in stored:
                report.short[name] = copies
        if report.lost:
            report.tiers.append(TierReport("any tier", bad=sorted(report.lost),
                                           error="no good copy of these files on any tier "
                                           "reached"))
        unreachable = [t.unreachable for t in report.tiers if t.unreachable]
        level = logging.ERROR if report.lost or not all(t.ok for t in report.tiers) else (
            logging.WARNING if report.short or unreachable else logging.INFO)
        verdict = ""
        if report.lost:
            verdict = f"; {lost_files(report.path, report.lost)}"
        elif report.short:
            verdict = f"; {short_files(report.path, report.short, report.wanted)}"
        log.log(level, "verified %s v%d: %s%s", manifest.path, manifest.version,
                "; ".join(describe(t) for t in report.tiers) or "no copy held anywhere",
                verdict)

    async def _peers_per_file(self, step: StepState,
                              manifest: mf.StepManifest) -> dict[str, set[str]]:
        """The peers to ask about each file: those its record names (read now: of a multi-node
        step each node holds only some files), with the step's replicas; for a file without a
        record, or with no cluster to ask, those this node knows (`Tree.file_peers`)."""
        recorded = None
        if self.peers is not None:
            try:
                recorded = await self.peers.file_holders(manifest)
            except TierError as exc:  # etcd away: what this node knows will do
                log.info("could not read the holders of %s: %s", manifest.path, exc)
        asked = {}
        for entry in manifest.files:
            holders = (recorded or {}).get(entry.name)
            asked[entry.name] = (self._holdings.file_peers(step, entry.name) if holders is None
                                 else (holders | step.replicas) - {self.tree.node_id})
        return asked

    async def _verify_peer(self, peer: str, manifest: mf.StepManifest,
                           entries: list[mf.FileEntry], repair: bool) -> TierReport:
        """Ask `peer` about each of `entries` (the files it holds, as far as known)."""
        tier = TierReport(f"peer:{peer}")
        if self.peers is None:
            tier.error = "no cluster"
            return tier
        for entry in entries:
            try:
                state = await self.peers.verify(peer, manifest.path, entry, repair)
            except TierError as exc:  # down, refused, timed out: its copies do not count
                tier.unreachable = f"could not ask {peer}: {exc or type(exc).__name__}"
                return tier
            if state == MISSING:
                tier.not_held.append(entry.name)
            else:
                self._tally(tier, state, entry.name)
            self._advance(entry.size)
        return tier

    async def _verify_persisted(self, step_node: Node, manifest: mf.StepManifest,
                                repair: bool) -> TierReport:
        tier = TierReport("persist")
        if self.persist is None:
            tier.error = "no persistent tier configured"
            return tier
        for entry in manifest.files:
            try:
                state = await self._check_persisted_file(
                    layout.data_dir(manifest.path, manifest.single_file), entry)
            except TierError as exc:
                tier.error = f"cannot read the persistent tier: {exc}"
                return tier
            if state != GOOD and repair:
                state = await self._reupload(step_node, manifest, entry, state)
            self._tally(tier, state, entry.name)
            self._advance(entry.size)
        lacking = [e.name for e in manifest.files if e.name not in tier.held_good]
        if tier.missing and repair and self._current(step_node, manifest) and \
                set(tier.missing) != step_node.step.store_lacking:
            # Objects gone, and not to be put back from here: the step is not persisted (a
            # bad object is only reported: it is there, and may be put right by hand).
            self._repairs.store_lacks(step_node, tier.missing, "by tierfs verify")
        try:
            stored = await self.persist.manifest(manifest.path, manifest.single_file)
            same = stored is not None and _same_manifest(stored, manifest)
            # Never a manifest whose files the store lacks: it would list a step that cannot
            # be read, on this node and on every fresh one.
            if not same and repair and not lacking:
                await self.persist.write_manifest(manifest.path, mf.encode(manifest),
                                                  manifest.single_file)
                tier.repaired.append(mf.MANIFEST_NAME)
                log.warning("manifest of %s in the persistent tier was %s: written again",
                            manifest.path, "missing" if stored is None else "wrong")
            elif not same:
                (tier.missing if stored is None else tier.bad).append(mf.MANIFEST_NAME)
        except TierError as exc:
            tier.error = f"cannot check the manifest in the persistent tier: {exc}"
        return tier

    async def _check_persisted_file(self, step_path: str, entry: mf.FileEntry) -> str:
        size = await self.persist.stored_size(step_path, entry)
        if size is None:
            return MISSING
        if size != entry.size:  # its chunks may all match: the size must, too
            log.error("size mismatch: %s/%s in the persistent tier has %d bytes, manifest "
                      "says %d", step_path, entry.name, size, entry.size)
            return BAD
        from_exc: str | None = None
        whole = xxhash.xxh3_128()
        for index, expected in enumerate(entry.chunks):
            offset = index * mf.CHUNK_SIZE
            length = min(mf.CHUNK_SIZE, entry.size - offset)
            try:
                data = await self.persist.read_range(step_path, entry, offset, length)
            except ObjectMissing:
                return MISSING
            if len(data) != length or mf.chunk_digest(data) != expected:
                from_exc = f"chunk {index}"
                break
            whole.update(data)
        if from_exc is None and whole.hexdigest() == entry.xxh3:
            return GOOD
        log.error("checksum mismatch: %s/%s in the persistent tier (%s)", step_path,
                  entry.name, from_exc or "whole file")
        return BAD

    async def _reupload(self, step_node: Node, manifest: mf.StepManifest, entry: mf.FileEntry,
                        state: str) -> str:
        """Upload a verified copy over a bad or missing object of the persistent tier."""
        node = tree_walk.entry_node(step_node, entry.name)
        if node is None:
            return state
        if node.remote is not None:
            try:
                # peers first; chunk-checked
                await self._bring_back.make_resident(node, empty=False)
            except (FsError, OSError) as exc:
                log.error("no good copy of %s/%s to upload again: %s", manifest.path,
                          entry.name, exc)
                return state
        found = self._locate(node)
        if found is None:
            return state
        if await self._check_ram_file(*found, act=REPORT, force=True) != GOOD:
            return state
        try:
            await self.persist.rewrite(layout.data_dir(manifest.path, manifest.single_file),
                                       entry, os.fsdecode(self.tree.backing(node)))
        except (TierError, OSError) as exc:
            log.error("upload of %s/%s again failed: %s", manifest.path, entry.name, exc)
            return state
        log.warning("%s/%s in the persistent tier was %s: uploaded again from a verified copy",
                    manifest.path, entry.name, state)
        return REPAIRED

    # -- this node's copies, also for a peer's VERIFY -----------------------------------------

    async def check_held_file(self, step_path: str, name: str, xxh3: str, repair: bool) -> str:
        """A peer asks: is my copy of this file good? (and repair it if not)."""
        step_node = self.tree.find_step(step_path)
        if step_node is None or not step_node.step.committed:
            return MISSING
        step = step_node.step
        entry = step.manifest.entry(name)
        if entry is None or entry.xxh3 != xxh3:
            return MISSING
        node = tree_walk.entry_node(step_node, entry.name)
        if node is None or node.remote is not None:
            return MISSING
        return await self._check_ram_file(step_node, step, entry, node,
                                          act=REPAIR if repair else REPORT, force=True)

    async def _check_ram_file(self, step_node: Node, step: StepState, entry: mf.FileEntry,
                              node: Node, *, act: str, force: bool = False) -> str:
        """Hash a resident committed file; a bad one is only reported (REPORT), or quarantined
        (QUARANTINE), or quarantined and then repaired from a verified copy (REPAIR)."""
        while True:
            if node.seal is None:
                return BAD if node.remote is not None else MISSING  # quarantined meanwhile
            ino = node.seal.backing_ino
            pending = self._checking.get(ino)
            if pending is None:
                break
            await pending.wait()  # the scan or an open is hashing it right now
            if not force and ino not in self.unverified:
                return GOOD if node.remote is None else BAD
        done = self._checking[ino] = trio.Event()
        try:
            try:  # removed or deleted since the caller found it: nothing to check
                path = self.tree.backing(node)
                digest = await trio.to_thread.run_sync(mf.hash_file, path,
                                                       limiter=self._threads)
            except (FsError, FileNotFoundError):
                return MISSING
            good = digest.xxh3 == entry.xxh3 and digest.size == entry.size
            # No await from here on: the node is checked and changed in one step.
            if (node.seal is None or node.seal.backing_ino != ino or node.remote is not None
                    or step_node.step is not step or not step.committed
                    or step.manifest.entry(entry.name) is not entry):
                return GOOD if good else BAD  # it changed meanwhile: nothing to quarantine
            if good:
                self.unverified.discard(ino)
                return GOOD
            described = (f"{step.manifest.path}/{entry.name} in this node's RAM has xxh3 "
                         f"{digest.xxh3} ({digest.size} bytes), manifest says {entry.xxh3} "
                         f"({entry.size} bytes)")
            if act == REPORT:
                # Unverified again (if it was not: the scan at start passed it), so that its
                # next open hashes it and takes it out of service: never served again.
                self.unverified.add(ino)
                log.error("checksum mismatch: %s: reported only, nothing changed now; its next "
                          "open takes it out of service", described)
                return BAD
            self.unverified.discard(ino)
            key = (step.manifest.path, step.manifest.version, entry.name)
            self.quarantined.add(key)
            self.scan_counts["bad"] += 1
            self.kept[key] = self._keep_aside(key, path)
            log.error("checksum mismatch: %s: quarantined, reads go to other tiers; its bytes "
                      "are kept in %s", described, os.fsdecode(self.kept[key]))
            gone = self._residents.quarantine(ino, entry.xxh3)
            # The cluster's records stop counting these copies (in the background): the
            # other holders restore them, and none is planned from this node meanwhile.
            by_step: dict[tuple[str, int], tuple[mf.StepManifest, list[str]]] = {}
            for manifest, name in gone:
                by_step.setdefault((manifest.path, manifest.version),
                                   (manifest, []))[1].append(name)
            for manifest, names in by_step.values():
                self._repairs.copies_lost(manifest, names)
        finally:
            del self._checking[ino]
            done.set()
        if act != REPAIR:
            return BAD
        return await self._repair_quarantined(node, step.manifest, entry)

    async def _repair_quarantined(self, node: Node, manifest: mf.StepManifest,
                                  entry: mf.FileEntry) -> str:
        """Bring a quarantined file back into RAM from a good copy elsewhere (verified)."""
        key = (manifest.path, manifest.version, entry.name)
        try:
            if entry.size == 0 and not await self._held_empty_elsewhere(manifest, entry):
                # An empty fetch reads nothing, so it proves nothing: the manifest may be
                # the wrong one (a wrong seal), and the kept bytes the right ones.
                raise FsError(errno.EIO, "no other tier holds it empty")
            await self._bring_back.make_resident(node, empty=False)
        except (FsError, OSError) as exc:
            kept = self.kept.get(key)
            log.error("%s/%s could not be repaired: no good copy reachable (%s); its reads "
                      "fail with EIO%s", manifest.path, entry.name, exc,
                      f"; its bytes are kept in {os.fsdecode(kept)}" if kept else "")
            return BAD
        self.quarantined.discard(key)
        self._drop_kept(key)
        self.scan_counts["repaired"] += 1
        log.warning("%s/%s repaired in RAM from another tier", manifest.path, entry.name)
        return REPAIRED

    async def _held_empty_elsewhere(self, manifest: mf.StepManifest,
                                    entry: mf.FileEntry) -> bool:
        """Whether a peer or the persistent tier confirms it holds this empty file empty."""
        step_node = self.tree.find_step(manifest.path)
        if step_node is None or not self._current(step_node, manifest):
            return False
        for peer in sorted(self._holdings.file_peers(step_node.step, entry.name)):
            with contextlib.suppress(Exception):  # an unreachable peer confirms nothing
                if self.peers is not None and \
                        await self.peers.verify(peer, manifest.path, entry, False) == GOOD:
                    return True
        if step_node.step.persisted and self.persist is not None:
            with contextlib.suppress(Exception):
                return await self.persist.object_size(
                    layout.data_dir(manifest.path, manifest.single_file), entry.name) == 0
        return False

    def _keep_aside(self, key: tuple[str, int, str], path: bytes) -> bytes:
        """A link to a bad RAM copy's bytes outside the tree and the objects, so that taking
        it out of service destroys nothing (a wrong manifest would make them the only copy)."""
        step_path, version, name = key
        kept = os.path.join(os.fsencode(self._store.root), QUARANTINE_DIR.encode(),
                            os.fsencode(step_path), os.fsencode(f"{name}.v{version}"))
        os.makedirs(os.path.dirname(kept), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(kept)  # an older bad copy of the same version: this one is newer
        os.link(path, kept)
        return kept

    def _drop_kept(self, key: tuple[str, int, str]) -> None:
        """A verified copy replaced the bad one: its kept bytes are of no use any more."""
        kept = self.kept.pop(key, None)
        if kept is None:
            return
        try:
            st = os.lstat(kept)
            os.unlink(kept)
        except FileNotFoundError:
            return
        if st.st_nlink == 1:
            self._store.forget_inode(st.st_ino)

    # -- helpers -----------------------------------------------------------------------------

    def _steps_under(self, relpath: str) -> list[Node]:
        node = self.tree.root
        if relpath not in ("", "."):
            for part in relpath.split("/"):
                node = self.tree.child(node, os.fsencode(part))
        if not node.is_dir:
            raise FsError(errno.ENOTDIR, f"{relpath} is not a directory")
        return sorted(self.tree.steps(node), key=lambda n: (
            self.tree.relpath(n.parent), -1 if n.step.number is None else n.step.number))

    def _resident_files(self, under: Node | None
                        ) -> list[tuple[Node, StepState, mf.FileEntry, Node]]:
        found = []
        for step_node in self.tree.steps(under):
            step = step_node.step
            if not step.committed:
                continue
            for rel, node in tree_walk.files_under(step_node):
                entry = step.manifest.entry(rel)
                if entry is not None and node.remote is None and rel in step.resident:
                    found.append((step_node, step, entry, node))
        return found

    def _locate(self, node: Node) -> tuple[Node, StepState, mf.FileEntry, Node] | None:
        step = tree_walk.committed_step_holding(node)
        if step is None or node.remote is not None:
            return None
        for step_node in tree_walk.enclosing_steps(node.parent):
            if step_node.step is step:
                rel = os.path.relpath(self.tree.relpath(node), self.tree.relpath(step_node))
                entry = step.manifest.entry(rel)
                if entry is not None and rel in step.resident:
                    return step_node, step, entry, node
        return None

    def _current(self, step_node: Node, manifest: mf.StepManifest) -> bool:
        return step_node.step is not None and step_node.step.committed and \
            step_node.step.manifest is manifest

    @staticmethod
    def _current_version(step_node: Node, version: int) -> bool:
        step = step_node.step
        return step is not None and step.committed and step.manifest.version == version

    def _advance(self, size: int) -> None:
        if self.progress is not None:
            self.progress["checked_bytes"] += size

    @staticmethod
    def _tally(tier: TierReport, state: str, name: str) -> None:
        if state == GOOD:
            tier.good += 1
            tier.held_good.add(name)
        elif state == REPAIRED:
            tier.repaired.append(name)
            tier.held_good.add(name)
        elif state == MISSING:
            tier.missing.append(name)
        else:
            tier.bad.append(name)


def _same_manifest(data: bytes, manifest: mf.StepManifest) -> bool:
    try:
        stored = mf.decode(data)
    except mf.ManifestError:
        return False
    return stored.version == manifest.version and stored.same_content(manifest)


def describe(tier: TierReport) -> str:
    parts = [f"{tier.good} good"] if tier.good else []
    if tier.repaired:
        parts.append(f"{len(tier.repaired)} repaired ({', '.join(tier.repaired)})")
    if tier.bad:
        parts.append(f"{len(tier.bad)} BAD ({', '.join(tier.bad)})")
    if tier.missing:
        parts.append(f"{len(tier.missing)} MISSING ({', '.join(tier.missing)})")
    if tier.not_held:
        parts.append(f"{len(tier.not_held)} not held there")
    if tier.error:
        parts.append(f"UNCHECKED: {tier.error}")
    if tier.unreachable:
        parts.append(f"UNREACHABLE: {tier.unreachable}")
    return f"{tier.tier}: {', '.join(parts) or 'nothing held'}"


def lost_files(step_path: str, lost: dict[str, list[str]], shown: int = 5) -> str:
    """`2 files of run/step_2 have no reachable copy: a (last held by node1), b (...)`."""
    named = ", ".join(f"{name} (last held by {', '.join(holders) or 'no node'})"
                      for name, holders in sorted(lost.items())[:shown])
    more = f" and {len(lost) - shown} more" if len(lost) > shown else ""
    files = "1 file" if len(lost) == 1 else f"{len(lost)} files"
    verb = "has" if len(lost) == 1 else "have"
    return f"{files} of {step_path} {verb} no reachable copy: {named}{more}"


def short_files(step_path: str, short: dict[str, int], wanted: int, shown: int = 5) -> str:
    """`1 file of run/step_1 has fewer than 2 copies reachable (K + 1, at most one per
    node) and none in the persistent tier: model.pt (1 copy)`."""
    named = ", ".join(f"{name} ({count} cop{'y' if count == 1 else 'ies'})"
                      for name, count in sorted(short.items())[:shown])
    more = f" and {len(short) - shown} more" if len(short) > shown else ""
    files = "1 file" if len(short) == 1 else f"{len(short)} files"
    verb = "has" if len(short) == 1 else "have"
    return (f"{files} of {step_path} {verb} fewer than {wanted} copies reachable (K + 1, at "
            f"most one per node) and none in the persistent tier: {named}{more}")
