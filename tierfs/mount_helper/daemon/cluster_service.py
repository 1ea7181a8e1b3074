"""The node's side of the cluster (with --cluster): its clients of the peers, made before the
namespace (`ClusterLinks`), and the service made after it (`ClusterNode`): the peer port and its
handler table, admission and registration in etcd, the commits it follows, the lost-copies rule
at start, and the copies it plans again when members come and go."""

from __future__ import annotations

import logging
from typing import Any

import trio

from tierfs import manifest as mf
from tierfs.fs.namespace import Core, Namespace
from tierfs.fs.store.ram_store import RamStore
from tierfs.fs.tree.holders import RecordedHolders
from tierfs.mount_helper.config import MountConfig
from tierfs.mount_helper.daemon import admission
from tierfs.mount_helper.daemon.commit_pipeline import (
    PENDING_RETRY,
    delete_targets,
    upload_after_copies,
)
from tierfs.mount_helper.daemon.startup import (
    CATCH_UP_RETRIES,
    CHECK_PATIENCE,
    StartupError,
    first_leaf,
)
from tierfs.observe import Events
from tierfs.replication.coordination import membership as live_members
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import CommitRecords
from tierfs.replication.coordination.etcd import Etcd, EtcdError
from tierfs.replication.coordination.store_record import StoreRecord
from tierfs.replication.peers import tls as peer_tls
from tierfs.replication.peers.channel import SENT_TO
from tierfs.replication.peers.directory import PeerDirectory
from tierfs.replication.peers.peer_delete import PeerDelete, delete_handler
from tierfs.replication.peers.peer_files import PeerFiles, files_handler
from tierfs.replication.peers.peer_manifest import ManifestFetcher, ManifestServer
from tierfs.replication.peers.peer_reader import PeerReader, RangeServer
from tierfs.replication.peers.peer_verify import PeerVerify, verify_handler
from tierfs.replication.peers.receiver import ReplicaReceiver
from tierfs.replication.peers.replicator import Replicator
from tierfs.replication.peers.server import Handler, PeerServer
from tierfs.retry import retry
from tierfs.s3tier.uploader import Uploader

log = logging.getLogger(__name__)


def cluster_members(cfg: MountConfig) -> PeerDirectory:
    """The cluster's members as this node sees them (from etcd), made before the tree: which
    steps can be read whole depends on who is up."""
    assert cfg.cluster is not None and cfg.advertise is not None and cfg.token is not None
    try:
        etcd = Etcd(cfg.cluster.endpoints, security=cfg.cluster.security)
    except EtcdError as exc:  # a TLS file that does not load
        raise StartupError(str(exc)) from None
    try:
        tls = peer_tls.load(cfg.peer_tls) if cfg.peer_tls is not None else None
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return PeerDirectory(live_members.Membership(etcd, cfg.cluster, cfg.node_id, cfg.advertise,
                                                 domain=cfg.failure_domain),
                         cfg.token, tls, connections=cfg.peer_connections)


class ClusterLinks:
    """This node's clients of its peers (with --cluster), made before the namespace, which is
    given them: reads from peers, other nodes' DCP shards, peer verification and deletes, over
    the connections of `directory`. They ask the tree questions only (who holds a step, which
    files are sealed)."""

    def __init__(self, cfg: MountConfig, core: Core, directory: PeerDirectory) -> None:
        tree, view = core.tree, core.view
        assert cfg.cluster is not None
        self.directory = directory
        self.live = directory.live
        self.etcd = self.live.etcd
        self.sealed = ClusterCommits(CommitRecords(self.etcd, cfg.cluster), cfg.node_id,
                                     tree.identity.step_number,
                                     ManifestFetcher(self.directory).fetch,
                                     view.committed_manifest)
        self.tree = tree
        self.view = view
        self.versions = core.versions
        self.reader = PeerReader(self.directory, view.holders_of, self._file_holders)
        self.verify = PeerVerify(self.directory, self.sealed.placements)
        self.delete = PeerDelete(self.directory)
        self.files = PeerFiles(self.directory)  # shards whose records a commit lacks
        self.store_record = StoreRecord(self.etcd, cfg.cluster)
        self.node_id = cfg.node_id
        self.replicas = cfg.replicas

    async def wait_for_copies(self, manifest: mf.StepManifest, deadline: float) -> None:
        """--sync-replicas (`fs.model.ports.CopiesWait`): every file of the committed version has
        K + 1 verified copies on live nodes, or as many as there are live nodes."""
        want = min(self.replicas + 1, len(self.live.ring))
        await self.sealed.wait_for_copies(
            manifest, want, lambda node: node == self.node_id or self.live.is_up(node),
            deadline)

    async def _file_holders(self, data_dir: str, name: str) -> list[str]:
        """Who holds a file now, from its record in etcd (the holders known here failed):
        remembered for the next reads of the file."""
        step_node = self.view.step_of_entry(data_dir, name)
        if step_node is None or not step_node.step.committed:
            return []
        manifest = step_node.step.manifest
        record = await self.sealed.file_record(manifest.path, name)
        entry = manifest.entry(name)
        if record is None or entry is None or record.xxh3 != entry.xxh3:
            return []
        if self.tree.find_step(manifest.path) is step_node:  # not replaced meanwhile
            self.versions.set_file_holders(step_node, {name: set(record.holders)})
        return list(record.holders)


class ClusterNode:
    """The cluster side of one daemon (with --cluster): the peer port and its handlers, its
    registration in etcd, the commits it follows and the copies of files it sends, wired to
    this node's namespace and store."""

    def __init__(self, cfg: MountConfig, links: ClusterLinks, namespace: Namespace,
                 store: RamStore, events: Events, uploader: Uploader | None = None) -> None:
        self.cfg = cfg
        # this node's share of the uploads of steps committed elsewhere (shared_uploads)
        self.uploader = uploader
        self._nursery: trio.Nursery | None = None  # the service's, from `start`
        self.namespace = namespace
        self.store = store
        self.live = links.live
        self.directory = links.directory
        self.verifier = namespace.verifier
        self.peer_delete = links.delete
        self.sealed = links.sealed
        self.store_record = links.store_record
        tiers = namespace.tiers
        self.replicator = Replicator(self.directory, cfg.replicas,
                                     lambda digest: str(store.object_path(digest)),
                                     is_current=tiers.is_current,
                                     placements=self.sealed.placements,
                                     on_placements=tiers.note_placements,
                                     on_held=self._held, may_copy=tiers.may_copy,
                                     events=events)
        # the records `tierfs status` takes copies, holders and TIERS from
        self.recorded = RecordedHolders(self.recorded_holders)
        self.receiver = ReplicaReceiver(store.objects, store, tiers.hold_files)
        self.ranges = RangeServer(store.objects, namespace.view.sealed_path, cfg.node_id,
                                  namespace.residency.chunk_for_peer)
        self.manifests = ManifestServer(namespace.view.committed_manifest)
        # Set once what this node missed while it was down is applied and the commit records
        # it found missing were written (or tried, if etcd refused them: they are retried
        # every PENDING_RETRY); `caught_up` in `tierfs status`.
        self.caught_up = trio.Event()
        self._missed_taken = False  # `_catch_up` listed what this node missed
        # Steps of the cluster not listed here for want of room for their records: path ->
        # (manifest, holders), listed again each PENDING_RETRY.
        self._unlearned: dict[str, tuple[mf.StepManifest, list[str]]] = {}

    async def _held(self, manifest: mf.StepManifest, peer: str, names: list[str]) -> bool:
        """A peer verified copies of these files: counted in etcd's records, then here (only
        those etcd took, for this content). Whether every one was recorded (if not, the
        replicator pauses before it tries again)."""
        found = await self.sealed.add_holders(manifest, peer, names)
        recorded = [name for name in names
                    if name in found and peer in found[name].holders
                    and (entry := manifest.entry(name)) is not None
                    and found[name].xxh3 == entry.xxh3]
        if recorded:
            self.namespace.tiers.mark_held(manifest, peer, recorded)
            self.recorded.changed(manifest.path, manifest.version)
        return len(recorded) == len(names)

    def handlers(self) -> dict[str, Handler]:
        """The peer port's handler of each request type (PING is the server's own)."""
        return {
            "PUT": self.receiver.put, "HOLD": self.receiver.hold,
            "GET": self.ranges.on_get, "SWARM_GET": self.ranges.on_swarm_get,
            "MANIFEST": self.manifests.on_manifest,
            "VERIFY": verify_handler(self.verifier.check_held_file),
            "DELETE": delete_handler(self.namespace.tiers.delete_from_peer),
            "FILES": files_handler(self.namespace.view.files_written),
        }

    def peer_server(self) -> PeerServer:
        """The peer port: this node's handlers, open to the cluster's admitted members."""
        assert self.cfg.token is not None
        tls = self.directory.tls
        return PeerServer(self.cfg.node_id, self.cfg.token, self.directory.ids,
                          self.handlers(), tls.server if tls else None, streamed={"PUT"})

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        server = self.peer_server()
        assert self.cfg.listen is not None
        host, port = self.cfg.listen
        try:
            await nursery.start(server.run, host, port)
        except Exception as exc:  # an OSError, perhaps inside an exception group
            error = first_leaf(exc, OSError)
            if error is None:
                raise
            raise StartupError(f"cannot listen for peers on {host}:{port}: "
                               f"{error.strerror or error}") from None
        await self._admit()
        # Before this node is a live member: a peer may evict its own copy of a file on the
        # strength of the copy the records name here (`leave_files` needs K live holders).
        await self._drop_lost_copies()
        await self._register(nursery)
        log.info("node %s listening for peers on %s:%d (advertised as %s); live members: %s",
                 self.cfg.node_id, host, port, self.cfg.advertise, ", ".join(self.live.ring))
        self._follow_members()
        # every step of the cluster, from the start
        await self.sealed.learn_all(self._learn, self.namespace.tiers.store_state)
        if self.namespace.recovered.may_have_lost_copies:
            # back without (some of) its copies: a step whose holders as its commit record
            # names them are live may still have lost every copy of a file, here and on
            # another node that came back empty too; the file records say (before `latest`
            # names such a step here)
            self.namespace.tiers.want_recheck()
        for worker in (self.directory.run, self.replicator.run, self._restore_copies,
                       self._follow_commits, self._publish_pending, self._recheck_losses):
            nursery.start_soon(worker)
        nursery.start_soon(self._catch_up)

    async def _catch_up(self) -> None:
        """What this node missed while it was down, once etcd answers (tried until it does):
        deletes made meanwhile are applied here, and the steps it committed whose commit
        record never reached etcd are published (by `_publish_pending`)."""
        tiers = self.namespace.tiers
        failures = 0
        while True:
            try:
                unpublished, deleted = await self.sealed.missed(tiers.owned_manifests(),
                                                                tiers.listed_manifests())
                break
            except EtcdError as exc:
                failures += 1
                log.info("could not compare this node's steps with etcd yet (attempt %d): %s",
                         failures, exc)
                await CATCH_UP_RETRIES.pause(failures)
        for deletion in deleted:
            failures = 0
            while True:
                try:
                    tiers.delete_from_peer(deletion.step, deletion.version,
                                           deletion.committed_ns,
                                           "another node (a tombstone in etcd)")
                    break
                except OSError as exc:
                    # No room for its record (the RAM dir's file system full: a /dev/shm
                    # other processes fill): nothing was changed; tried again, never given
                    # up (an error here would end the daemon).
                    failures += 1
                    if failures == 1:
                        log.warning("delete of %s made while this node was down is not "
                                    "applied here yet: %s", deletion.step,
                                    exc.strerror or exc)
                    await trio.sleep(PENDING_RETRY)
        for manifest in unpublished:
            tiers.publish_later(manifest)
        self._missed_taken = True

    async def _drop_lost_copies(self) -> None:
        """The records stop counting this node as a holder of files it does not hold in RAM
        (`TreeView.holds_copy`: it was replaced with an empty RAM dir, or lost files): the
        survivors restore those copies (`ClusterCommits.drop_lost_copies`). At start, before
        the node is a live member, and only if start-up found this node may have lost copies
        (an empty RAM dir, steps set aside, objects removed: `RecoveryReport`), since it reads
        every step listing this node: from then on a copy of a step not persisted leaves RAM
        only after it left the records (`Residency._leave`), and a bad one leaves them when
        it is quarantined. Tried for CHECK_PATIENCE: a node that cannot correct the records
        does not join (peers would count the copies it lost)."""
        recovered = self.namespace.recovered
        if not recovered.may_have_lost_copies:
            log.info("the RAM store holds every copy it held (%d committed steps): the "
                     "cluster's records are not read for lost copies", recovered.steps)
            return
        failures = 0
        with trio.move_on_after(CHECK_PATIENCE) as patience:
            while True:
                try:
                    dropped = await self.sealed.drop_lost_copies(
                        self.namespace.view.holds_copy, self.namespace.tiers.in_store)
                    break
                except EtcdError as exc:
                    failures += 1
                    log.info("could not compare the cluster's records with the copies here "
                             "(attempt %d): %s", failures, exc)
                    await CATCH_UP_RETRIES.pause(failures)
        if patience.cancelled_caught:
            raise self._unreachable("to correct the records of the copies this node lost")
        if dropped:
            log.warning("%d copies the cluster's records listed here are not in RAM: the other "
                        "holders restore them", dropped)
    def _learn(self, manifest: mf.StepManifest, holders: list[str]) -> None:
        """A step committed in the cluster is listed here; if this node holds files of that
        version (it wrote some, or holds copies), the step is planned again: copies may be
        due, and the records (touched when holders are added) say who holds each file now."""
        try:
            self.namespace.tiers.learn(manifest, holders)
        except OSError as exc:
            # No room for its records (the RAM dir's file system full: a /dev/shm other
            # processes fill): listed by a retry once there is (`_publish_pending`'s round);
            # an error here would end the watch of the commits, and the daemon with it.
            if manifest.path not in self._unlearned:
                log.warning("%s v%d is not listed here yet: %s", manifest.path,
                            manifest.version, exc.strerror or exc)
            self._unlearned[manifest.path] = (manifest, holders)
            return
        self._unlearned.pop(manifest.path, None)
        node = self.namespace.tree.find_step(manifest.path)
        if node is not None and node.step.committed and node.step.resident and \
                node.step.manifest.version == manifest.version:
            self.replicator.submit(node.step.manifest)
            self._upload_share(node.step.manifest)

    def _upload_share(self, manifest: mf.StepManifest) -> None:
        """This node's share of a step's upload (it holds files of it: it may be the one to
        send some to the store), after its copies (`shared_uploads`)."""
        step = self.namespace.tree.find_step(manifest.path)
        if (self.uploader is None or self._nursery is None or step is None
                or step.step.persisted or not self.uploader.wanted(manifest)):
            return
        self._nursery.start_soon(upload_after_copies, manifest, self.uploader,
                                 self.replicator.queue)

    async def _follow_commits(self) -> None:
        """Every commit of the other nodes is listed here within a watch event, and what the
        store holds of each step, whoever uploaded it."""
        await self.sealed.follow(self._learn, self.namespace.tiers.unlisted,
                                 self.namespace.tiers.store_state)

    async def _publish_pending(self) -> None:
        """Commit records etcd could not take (it was down) are written once it is back; steps
        of the cluster this node had no room to list are listed once it has."""
        while True:
            await trio.sleep(PENDING_RETRY)
            caught_up = self._missed_taken  # this round writes what the catch-up found
            await self.namespace.tiers.publish_pending()
            for manifest, holders in list(self._unlearned.values()):
                self._learn(manifest, holders)
            if caught_up:
                self.caught_up.set()

    async def _admit(self) -> None:
        """Refuse, with one line, a node that could not work as a member (`admission`)."""
        assert self.cfg.advertise is not None and self.cfg.token is not None
        tls = self.directory.tls.client if self.directory.tls else None
        try:
            await admission.check_reaches_itself(self.cfg.advertise, self.cfg.token,
                                                 self.cfg.node_id, tls)
            with trio.move_on_after(CHECK_PATIENCE) as patience:
                await admission.check_cluster_token(self.live.etcd, self.cfg.cluster,
                                                    self.cfg.token)
                await admission.check_transport(self.live.etcd, self.cfg.cluster, tls,
                                                self.cfg.node_id)
        except admission.AdmissionRefused as exc:
            raise StartupError(str(exc)) from None
        except EtcdError as exc:
            raise StartupError(f"cannot check the token of the cluster {self.cfg.cluster}: "
                               f"{exc}") from None
        if patience.cancelled_caught:
            raise self._unreachable("to check the cluster's token")

    async def _register(self, nursery: trio.Nursery) -> None:
        """Join the cluster in etcd (a key under this node's lease); one line if it cannot."""
        with trio.move_on_after(CHECK_PATIENCE) as patience:
            try:
                await nursery.start(self.live.run)
            except Exception as exc:  # NodeIdInUse, perhaps inside an exception group
                error = first_leaf(exc, EtcdError)
                if error is None:
                    raise
                raise StartupError(f"cannot join the cluster {self.cfg.cluster}: "
                                   f"{error}") from None
        if patience.cancelled_caught:
            raise self._unreachable("to join the cluster")

    def _unreachable(self, why: str) -> StartupError:
        """The one line of a mount that etcd does not answer: at which endpoint, and how."""
        where = self.live.etcd.last_failure or ", ".join(map(str, self.live.etcd.endpoints))
        return StartupError(f"etcd is unreachable at {where} (tried for "
                            f"{CHECK_PATIENCE:.0f} s {why}; --cluster {self.cfg.cluster})")

    def _follow_members(self) -> None:
        """Deletes made here go to the live peers."""
        self.namespace.deletes.targets = delete_targets(self.cfg, self.live.ring)

    async def _restore_copies(self) -> None:
        """When a node goes or comes, every node re-plans the copies of the files it holds
        from fresh records (lost copies are restored; a node joining moves nothing)."""
        while True:
            await self.directory.changed.wait()
            self._follow_members()
            for manifest in self.namespace.tiers.held_manifests():
                self.replicator.submit(manifest)
                self._upload_share(manifest)  # a sender of its files may be gone

    async def _recheck_losses(self) -> None:
        """When a node goes or comes (or its grace ends), the steps that may have lost every
        copy of a file have their records read again, so that every node, also one holding
        nothing of a step, calls it incomplete (and `latest` skips it) or whole on what the
        records say now; then every step is judged (the daemon logs a step that became
        incomplete or whole again)."""
        tiers = self.namespace.tiers
        tree = self.namespace.tree
        while True:
            changed = self.directory.changed
            generation = self.directory.generation
            for manifest in tiers.doubtful_steps(self.directory.may_be_up):
                records = await self.sealed.placements(manifest)
                if records is not None:
                    tiers.note_placements(manifest, {n: set(r.holders) for n, r in records.items()},
                                          {n: r.node for n, r in records.items()})
            for node in list(tree.steps()):
                tree.recoverable.loss(node.step, fresh=True)
            if self.directory.generation == generation:
                await _either(changed, tiers.recheck_wanted)

    async def record_store_use(self, url: str, used: trio.Event) -> None:
        """Once this node persisted a step, or found the store holding some, the cluster
        records that its steps go to a store (`cluster.store_record`), tried until etcd
        takes it: a fresh node given an empty store is then refused."""
        await used.wait()
        await retry(lambda: self.store_record.write(url, self.cfg.node_id),
                    "recording in etcd that the cluster's steps go to a store",
                    retryable=lambda exc: isinstance(exc, EtcdError), policy=CATCH_UP_RETRIES)

    def served(self) -> dict[str, Any]:
        """What this node sent to peers: ranges served (`relayed`: from a file it was
        fetching itself; `routed`: readers sent to another reader instead) and the bytes of
        every frame to each peer (replicas, reads, requests)."""
        ranges = self.ranges
        return {"requests": ranges.served_requests, "bytes": ranges.served_bytes,
                "relayed": ranges.relayed_requests, "routed": ranges.routed_requests,
                "sent_bytes": dict(sorted(SENT_TO.items()))}

    async def recorded_holders(self, manifest: mf.StepManifest) -> dict[str, set[str]] | None:
        """Who holds each file of this committed version, as the cluster's records say (a
        record of another content holds nothing of it); None if they cannot be read."""
        records = await self.sealed.placements(manifest)
        if records is None:
            return None
        return {entry.name: set(record.holders) if record is not None
                and record.xxh3 == entry.xxh3 else set()
                for entry in manifest.files
                for record in (records.get(entry.name),)}


async def _either(*events: trio.Event) -> None:
    """Until one of `events` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:
            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)
