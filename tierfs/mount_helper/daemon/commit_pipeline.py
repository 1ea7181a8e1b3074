"""The parts that follow a commit on this node, built and connected: the uploader over the
namespace (`make_uploader`); what was due before a restart, once the RAM objects are checked
(`verify_then_send`); and deletes, which leave every tier they
reached (`delete_worker`). In what order a step's copies and upload go is
`tierfs.replication.commit_order`'s; when pending commits try again, the core's
(`Commits.keep_retrying`)."""

from __future__ import annotations

import logging

import trio

from tierfs import manifest as mf
from tierfs.fs.lifecycle.deletes import (
    CLUSTER_RECORDS,
    PERSIST,
    DeleteWorker,
    Tombstone,
    peer_target,
)
from tierfs.fs.namespace import Namespace
from tierfs.mount_helper.config import MountConfig
from tierfs.observe import Events
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.peers.peer_delete import PeerDelete
from tierfs.replication.peers.replicator import Replicator
from tierfs.s3tier.backend import Backend
from tierfs.s3tier.uploader import Uploader
from tierfs.shared_uploads import SharedUploads

log = logging.getLogger(__name__)


def delete_targets(cfg: MountConfig, peers: list[str] | None = None) -> list[str]:
    """What a delete made on this node must clean: the persistent tier, the cluster's records
    and every live peer (`ClusterNode` keeps the list current as members come and go)."""
    return ([PERSIST] if cfg.persist else []) + ([CLUSTER_RECORDS] if cfg.cluster else []) + [
        peer_target(node_id) for node_id in sorted(peers or []) if node_id != cfg.node_id]


class NamespaceSteps:
    """The uploader's side of the namespace (`s3tier.uploader.UploadedSteps`): what it asks of
    the steps it uploads and tells of them, as the namespace's tree and other tiers answer."""

    def __init__(self, namespace: Namespace, store_used: trio.Event) -> None:
        self._namespace = namespace
        self._tiers = namespace.copies
        self._store_used = store_used  # set once a step reached the store
        self.is_current = self._tiers.is_current
        self.retired = self._tiers.mark_retired
        self.tracked_step = self._tiers.tracked_step
        self.copy_sources = self._tiers.copy_sources
        self.single_writer = self._tiers.single_writer
        self.users_quiet = namespace.foreground.wait_quiet
        self.step_number = namespace.view.step_number
        self.file_step_number = namespace.view.file_step_number

    def object_path(self, xxh3: str) -> str:
        return self._namespace.object_path(xxh3)

    def persisted(self, manifest: mf.StepManifest) -> None:
        self._namespace.persisted(manifest)
        self._store_used.set()


def make_uploader(cfg: MountConfig, backend: Backend, namespace: Namespace,
                  events: Events, store_used: trio.Event,
                  shares: SharedUploads | None = None) -> Uploader:
    """Uploads of committed steps (in a cluster, each node's share of them: `shares`); it
    tells the namespace's other tiers what it persisted."""
    return Uploader(backend, NamespaceSteps(namespace, store_used),
                    persist_every=cfg.persist_every, keep_persist=cfg.keep_persist,
                    events=events, shares=shares)


async def verify_then_send(namespace: Namespace, uploader: Uploader | None,
                            replicator: Replicator | None) -> None:
    """Hash the RAM objects found at start, then upload and replicate what is due since before
    the restart: a copy that changed while no daemon watched is never sent anywhere."""
    await namespace.verifier.scan_at_start()
    if uploader is not None:
        for manifest in namespace.copies.committed_manifests():
            uploader.submit(manifest)  # committed before a restart, not yet uploaded
    if replicator is not None:
        for manifest in namespace.copies.held_manifests():
            replicator.submit(manifest)  # copies due since before a restart


async def upload_again(namespace: Namespace, uploader: Uploader) -> None:
    """Steps the store was found to lack, though they had reached it (a bucket deleted and
    made again, a prefix emptied: `Eviction.store_lacks`), go up again from RAM."""
    async for manifest in namespace.lost_from_store():
        uploader.submit(manifest)


def delete_worker(namespace: Namespace, uploader: Uploader | None,
                   peer_delete: PeerDelete | None, records: ClusterCommits | None
                   ) -> DeleteWorker:
    """Deleted steps leave the persistent tier and the peers (retried until they have)."""
    cleaners = {}
    if uploader is not None:
        async def from_store(tomb: Tombstone, _where: str) -> None:
            await uploader.delete_step(tomb.path, tomb.committed_ns)

        cleaners[PERSIST] = from_store
    if peer_delete is not None:
        cleaners["peer"] = peer_delete.delete
    if records is not None:

        async def from_etcd(tomb: Tombstone, _where: str) -> None:
            await records.forget(tomb.path, tomb.version, tomb.committed_ns)

        cleaners[CLUSTER_RECORDS] = from_etcd
    wanted = uploader.wanted if uploader is not None else None
    return namespace.delete_worker(cleaners, wanted)
