"""The control API of one mount (what the control socket's requests are answered with):
`tierfs status` (steps, tiers, peers, persist queue, verify progress), `commit`, `prefetch`,
`verify` and `settle`, and the gauges of the metrics endpoint."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierfs import manifest as mf
from tierfs.fs.fuse.passthrough import PassthroughDevice
from tierfs.fs.lifecycle.deletes import PERSIST
from tierfs.fs.lifecycle.verify import StepReport, Verifier
from tierfs.fs.model.nodes import FsError, Node, StepState
from tierfs.fs.namespace import Namespace
from tierfs.fs.store.ram_store import RamFull
from tierfs.fs.tree.holders import RecordedHolders, spread
from tierfs.mount_helper.config import MountConfig
from tierfs.mount_helper.daemon.cluster_service import ClusterNode
from tierfs.mount_helper.status_view import number_of
from tierfs.observe import Events, Levels
from tierfs.replication.commit_order import CommitPipeline
from tierfs.replication.coordination.placement import peer_copies_wanted
from tierfs.replication.peers.channel import SENT_TO
from tierfs.s3tier.uploader import Uploader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Due:
    """A step a tier (the store, or peers) should hold and does not yet: its committed
    manifest, or None while its hashes are being computed (the manifest comes after them)."""

    path: str
    total_bytes: int
    committed_ns: int
    manifest: mf.StepManifest | None = None


class ControlApi:
    """Answers the control socket's requests (`handle`) and the metrics endpoint's scrapes
    (`levels`)."""

    def __init__(self, cfg: MountConfig, namespace: Namespace, uploader: Uploader | None,
                 cluster: ClusterNode | None, verifier: Verifier, pipeline: CommitPipeline,
                 passthrough: PassthroughDevice | None = None, *, events: Events,
                 new_store: bool = False, persist_reads: Callable[[], int] = lambda: 0) -> None:
        self.cfg = cfg
        self.events = events  # bad copies `tierfs verify` found count in the metrics
        self.new_store = new_store  # the persistent tier was empty when this mount began
        self.persist_reads = persist_reads  # requests the read path sent to the store
        self.namespace = namespace
        self.uploader = uploader
        self.cluster = cluster
        self.verifier = verifier
        self.passthrough = passthrough
        self.pipeline = pipeline
        # the records `tierfs status` takes copies, holders and TIERS from, in a cluster
        self.recorded: RecordedHolders | None = cluster.recorded if cluster else None

    def persist_status(self, waiting: list[Due]) -> dict[str, Any] | None:
        """`persist` in `tierfs status --json`; `waiting`: `_persist_waiting`'s list."""
        if self.uploader is None:
            return None
        return {"url": self.uploader.backend.url, "new_store": self.new_store,
                "sent_bytes": self.uploader.bytes_sent,
                "manifest_bytes": self.uploader.manifest_bytes_sent,
                "copied_bytes": self.uploader.bytes_copied,
                "pack_bytes": self.uploader.pack_bytes_sent,
                "read_requests": self.persist_reads(),
                "every": self.cfg.persist_every,
                "keep": self.cfg.keep_persist, "pending_steps": len(waiting),
                "pending_bytes": sum(due.total_bytes for due in waiting),
                # deletes and the old names of renames the store still holds (`tierfs flush`
                # waits for them too: a fresh node would list them)
                "pending_deletes": self.namespace.deletes_pending_in(PERSIST)}

    def _persist_waits(self, waiting: list[Due]) -> dict[str, dict[str, Any]]:
        """Per step due in the store and not there yet (`waiting`: `_persist_waiting`'s
        list): why not, since when, and how many requests of its upload failed
        (`persist_wait` in `tierfs status --json`)."""
        if self.uploader is None:
            return {}
        waits = {}
        view = self.namespace.view
        for due in waiting:
            reason, since_ns, failures = (
                self.uploader.waiting(due.manifest) if due.manifest is not None
                else ("hashing", due.committed_ns, 0))
            blocked = False
            step_node = view.find_step(due.path)
            loss = (view.loss(step_node.step)
                    if step_node is not None and due.manifest is not None else None)
            if loss is not None:  # no upload can make it whole in the store
                reason, since_ns, blocked = (f"cannot be stored: {loss.summary()}",
                                             loss.since_ns, True)
            elif (due.manifest is not None and self.cluster is not None
                  and reason == "queued" and due.path not in self.uploader.queue.pending):
                reason = "uploaded by other nodes"  # its share here is done, or none
            waits[due.path] = {"reason": reason, "since_ns": since_ns, "failures": failures,
                               "blocked": blocked}
        return waits

    def _persist_waiting(self) -> list[Due]:
        """The steps due in the store and not there yet: committed ones the uploader wants
        (in a cluster, every committed step of the cluster: a copy on a peer is not the
        store, and the uploads are shared), and those committed with their hashes still to
        come (`fs.model.pending_commits`) that it will want once they are in (`tierfs flush` and
        `umount` wait for those too)."""
        assert self.uploader is not None
        tiers = self.namespace.copies
        waiting = [Due(m.path, m.total_bytes, m.committed_ns, m)
                   for m in (tiers.not_in_store() if self.cluster is not None
                             else tiers.committed_manifests())
                   if self.uploader.wanted(m)]
        return waiting + self._hashing(self.uploader.due, {due.path for due in waiting})

    def _hashing(self, due: Callable[[int], bool], named: set[str]) -> list[Due]:
        """The steps committed with their hashes still to come (`fs.model.pending_commits`) whose
        number is `due` for a tier and that are not `named` already (an older version is)."""
        view = self.namespace.view
        hashing = []
        for node in view.steps():
            step = node.step
            if step.pending is None or step.pending.superseded or step.number is None:
                continue
            path = view.relpath(node)
            if due(step.number) and path not in named:
                record = step.pending.record
                hashing.append(Due(path, sum(f.size for f in record.files),
                                   record.committed_ns))
        return hashing

    def replicas_wanted(self, *, live_only: bool) -> int:
        """The peer copies each file made here should have: --replicas, or fewer if there are
        fewer other nodes: live ones (what `tierfs flush` can wait for), or every one seen
        since this daemon started (metrics: a copy missing while its node is down counts)."""
        if self.cluster is None:
            return 0
        peers = self.cluster.directory.peers
        return peer_copies_wanted(self.cfg.replicas, sum(1 for peer in peers if peer.up)
                                  if live_only else len(peers))

    def _replicas_waiting(self, wanted: int) -> list[Due]:
        """Steps made here, not in the store, with a file here that has fewer than `wanted`
        verified copies on live peers, and those committed with their hashes still to come
        (nothing of them has left the node)."""
        if wanted == 0:
            return []
        assert self.cluster is not None
        tiers = self.namespace.copies
        waiting = [Due(m.path, m.total_bytes, m.committed_ns, m) for m in tiers.owned_manifests()
                   if tiers.short_of_copies(m, wanted, self.cluster.directory.is_up)]
        return waiting + self._hashing(lambda _number: True, {due.path for due in waiting})

    def replication_status(self) -> dict[str, Any] | None:
        """`replication` in `tierfs status --json` (None outside a cluster): the copies each
        file made here should have on live peers, and the steps that do not have them yet
        (what `tierfs flush` waits for besides the store)."""
        if self.cluster is None:
            return None
        wanted = self.replicas_wanted(live_only=True)
        waiting = self._replicas_waiting(wanted)
        return {"replicas": self.cfg.replicas, "wanted": wanted,
                "pending_steps": len(waiting),
                "pending_bytes": sum(due.total_bytes for due in waiting),
                "pending": {due.path: "hashing" if due.manifest is None else "copying"
                            for due in waiting}}

    def levels(self) -> Levels:
        """The gauges of the metrics endpoint (called in the trio thread at each scrape)."""
        pending = {}
        if self.uploader is not None:
            pending["persist"] = self._persist_waiting()
        if self.cluster is not None:
            pending["replica"] = self._replicas_waiting(self.replicas_wanted(live_only=False))
        peers = self.cluster.directory.peers if self.cluster else []
        view = self.namespace.view
        incomplete = sum(1 for node in view.steps() if view.loss(node.step) is not None)
        return Levels(*self.namespace.ram_bytes(),
                      {tier: (len(steps), sum(m.total_bytes for m in steps))
                       for tier, steps in pending.items()},
                      len(peers), sum(1 for m in peers if m.up), incomplete, dict(SENT_TO))

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        command = request.get("cmd")
        if command == "status":
            return {"ok": True, "status": await self.status()}
        if command == "settle":
            # `tierfs umount`, before it unmounts: commit the quiet steps now (as the unmount
            # would), so that the status it is answered names what stays uncommitted.
            await self.namespace.settle()
            return {"ok": True, "status": await self.status()}
        if command == "hold_hashes":
            # Hashes observably late, for tests: every hash thread taken, or given back.
            if request.get("hold"):
                await self.namespace.hold_hash_threads()
            else:
                self.namespace.release_hash_threads()
            return {"ok": True}
        if command not in ("commit", "commit_waits", "prefetch", "verify"):
            return {"ok": False, "error": f"unknown command {command!r}"}
        path = request.get("path")
        if not isinstance(path, str):
            return {"ok": False, "error": f"{command} needs a path"}
        if command == "commit_waits":  # `tierfs commit` shows it while it waits
            return {"ok": True, "waiting_for": self.namespace.commit_waits(path)}
        try:
            if command == "verify":
                reports = await self.verifier.verify(path, bool(request.get("repair", True)))
                self._count_bad_copies(reports)
                return {"ok": True, "steps": [r.as_dict() for r in reports]}
            if command == "prefetch":
                return {"ok": True, "bytes": await self.namespace.prefetch(path)}
            timeout = request.get("timeout", math.inf)
            if not isinstance(timeout, (int, float)) or timeout < 0:
                return {"ok": False, "error": "commit: timeout must be a number of seconds"}
            manifest = await self.namespace.commit(path, timeout)
        except FsError as exc:
            return {"ok": False, "error": f"{path}: {exc}"}
        except RamFull:
            return {"ok": False, "error": f"{path}: the RAM tier is full"}
        except OSError as exc:
            return {"ok": False, "error": f"{path}: {exc.strerror}"}
        return {"ok": True, "path": manifest.path, "version": manifest.version,
                "files": len(manifest.files), "bytes": manifest.total_bytes}

    def _count_bad_copies(self, reports: list[StepReport]) -> None:
        for report in reports:
            for tier in report.tiers:
                if tier.tier != "any tier":  # the same files again, summed over the tiers
                    self.events.verify_failed(tier.tier.partition(":")[0],
                                              len(tier.bad) + len(tier.repaired))

    def _step_status(self, node: Node, persist_waits: dict[str, dict[str, Any]],
                     recorded: dict[str, set[str]] | None = None,
                     dirs: dict[Node, dict[StepState, str]] | None = None) -> dict[str, Any]:
        """A step's status line, with the times `tierfs status` shows ages from:
        `committed_ns` (when its newest committed version was made; None before the first)
        and, for a step being written, `changed_ns` (its directory's last change); for a
        step due in the store and not there yet, `persist_wait` (else None). In a cluster,
        a committed step's `copies`, `holders` and `tiers` come from the cluster's records
        of its files (`recorded`; this node's view only if they could not be read), the
        same on every node (`fs.tree.holders`), and `only_here` says whether a file of it is in
        no live node's RAM but this one's (and not in the store)."""
        view = self.namespace.view
        step = node.step
        spread = self.cluster is not None and step.committed  # `replicas` from the records
        status = dict(view.step_status(node, dirs, replicas=not spread))
        if spread:
            status.update(self._spread(step, recorded))
        else:
            is_up = self.cluster.directory.is_up if self.cluster else (lambda _peer: False)
            status["copies"] = view.copies(step, is_up)
        manifest = node.step.manifest
        status["committed_ns"] = manifest.committed_ns if manifest is not None else None
        if status["hashing"]:
            status["committed_ns"] = step.pending.record.committed_ns
        status["changed_ns"] = None
        if status["state"] in ("writing", "empty"):
            with contextlib.suppress(FsError, OSError):  # removed meanwhile
                status["changed_ns"] = view.stat(node).st_mtime_ns
        status["commit_outlook"] = (self._outlook(node) if status["state"] == "writing"
                                    else None)
        status["persist_wait"] = persist_waits.get(status["path"])
        # why the step is short of the copies this node owes it (a target with no room...)
        status["copies_wait"] = (self.cluster.replicator.trouble(status["path"])
                                 if self.cluster is not None and step.committed else None)
        return status

    def _outlook(self, node: Node) -> dict[str, Any]:
        """`commit_outlook` of a step being written: when it commits by itself (what
        `tierfs flush` waits for, or gives up on at once), as `fs.lifecycle.quiet_commits.Outlook`,
        its time as `due_ns` (the wall clock; null unless `kind` is `due`)."""
        outlook = self.namespace.commit_outlook(node)
        due_ns = None
        if outlook.due is not None:
            due_ns = time.time_ns() + int(max(0.0, outlook.due - time.monotonic()) * 1e9)
        return {"kind": outlook.kind, "due_ns": due_ns, "reason": outlook.reason,
                "files": outlook.files}

    def _spread(self, step: StepState, recorded: dict[str, set[str]] | None
                ) -> dict[str, Any]:
        """`copies`, `holders`, `replicas`, `tiers` and `only_here` of a committed step in a
        cluster, from the cluster's records of its files and the live members, and `domains`:
        the failure domain of each holder that has one."""
        assert self.cluster is not None
        me = self.cfg.node_id
        if recorded is None:  # etcd did not answer: what this node knows
            recorded = {e.name: self.namespace.view.file_peers(step, e.name)
                        | ({me} if e.name in step.resident else set())
                        for e in step.manifest.files}
        is_up = self.cluster.directory.is_up
        held = spread(recorded, lambda peer: peer == me or is_up(peer))
        alone = not step.persisted and any(
            name in step.resident and not any(h != me and is_up(h) for h in nodes)
            for name, nodes in recorded.items())
        domain_of = self.cluster.directory.domain_of
        domains = {h: d for h in held.holders if (d := domain_of(h)) is not None}
        # `replicas` too: the other live nodes holding every file, from the same records
        # (this node's own view named nodes that were gone, and differed from node to node)
        return {"copies": held.copies, "holders": list(held.holders),
                "replicas": [h for h in held.whole if h != me and is_up(h)],
                "tiers": held.tiers(step.persisted), "only_here": alone,
                **({"domains": domains} if domains else {})}

    def _ram_dir_space(self) -> dict[str, int]:
        """The size and free bytes of the RAM dir's file system (a /dev/shm others share
        fills whatever the RAM tier's own count says); none if it cannot be read."""
        try:
            found = os.statvfs(self.cfg.ram_dir)
        except OSError:
            return {}
        return {"fs_size_bytes": found.f_blocks * found.f_frsize,
                "fs_free_bytes": found.f_bavail * found.f_frsize}

    async def status(self) -> dict[str, Any]:
        ns = self.namespace
        persist_waiting = self._persist_waiting() if self.uploader is not None else []
        persist_waits = self._persist_waits(persist_waiting)
        recorded = await self.recorded.of(ns.copies.listed_manifests()) if self.recorded else {}
        dirs: dict[Node, dict[StepState, str]] = {}  # unfinished steps, per directory
        steps = sorted((self._step_status(node, persist_waits, recorded.get(
                            node.step.manifest.path) if node.step.manifest else None, dirs)
                        for node in ns.view.steps()),
                       key=lambda s: (os.path.dirname(s["path"]), number_of(s), s["path"]))
        used, limit = ns.ram_bytes()
        return {
            "node_id": self.cfg.node_id,
            "mountpoint": str(self.cfg.mountpoint),
            "pid": os.getpid(),
            "ram_dir": str(self.cfg.ram_dir),
            "ram": {"used_bytes": used, "limit_bytes": limit,
                    **self._ram_dir_space()},
            "passthrough": self.passthrough is not None and self.passthrough.enabled,
            "failure_domain": self.cfg.failure_domain,
            "peers": self.cluster.directory.status() if self.cluster else [],
            "served_to_peers": self.cluster.served() if self.cluster else None,
            # committed files brought back into RAM before their open asked for them
            "fetched_ahead": ns.fetched_ahead(),
            # seconds the hashes of committed files paused for a save in progress
            # (fs.tree.sealing: a file open for writing)
            "hashes_yielded_seconds": round(ns.view.hashes_yielded(), 3),
            # in a cluster: what this node missed while it was down is applied
            "caught_up": self.cluster.caught_up.is_set() if self.cluster else None,
            "persist": self.persist_status(persist_waiting),
            "replication": self.replication_status(),
            "commits": self.pipeline.commits,
            "ram_check": dict(self.verifier.scan_counts, done=self.verifier.scan_done.is_set()),
            "verify": self.verifier.progress,
            "deletes": ns.deletes_status(),
            "steps": steps,
            "own_latest": ns.view.own_latest_dirs(),
            "ram_only_links": ns.view.ram_only_links(),
        }
