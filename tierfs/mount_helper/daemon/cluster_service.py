"""The node's side of the cluster (with --cluster), built and connected: its clients of the
peers, made before the namespace (`ClusterLinks`), and the service made after it
(`ClusterNode`): the peer port and its handler table, admission and registration in etcd, and
the workers of `tierfs.replication` started in order (the lost copies corrected before the node
joins, the commits it follows, the copies it plans again when members come and go). What they
decide is theirs; here a refusal becomes the mount's one line."""

from __future__ import annotations

import functools
import logging
from typing import Any

import trio

from tierfs import manifest as mf
from tierfs.fs.namespace import Core, Namespace
from tierfs.fs.store.ram_store import RamStore
from tierfs.fs.tree.holders import RecordedHolders
from tierfs.mount_helper.config import MountConfig
from tierfs.mount_helper.daemon import admission
from tierfs.mount_helper.daemon.commit_pipeline import delete_targets
from tierfs.mount_helper.daemon.startup import CHECK_PATIENCE, StartupError, first_leaf
from tierfs.observe import Events
from tierfs.replication import recorded_copies
from tierfs.replication.catch_up import drop_lost_copies
from tierfs.replication.cluster_steps import ClusterSteps
from tierfs.replication.commit_order import CopyPlans
from tierfs.replication.coordination import membership as live_members
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import CommitRecords
from tierfs.replication.coordination.etcd import Etcd, EtcdError
from tierfs.replication.coordination.placement import copies_wanted, peer_copies_wanted
from tierfs.replication.coordination.shared_links import SharedLinks
from tierfs.replication.coordination.store_record import StoreRecord
from tierfs.replication.peers import tls as peer_tls
from tierfs.replication.peers.channel import SENT_TO
from tierfs.replication.peers.directory import PeerDirectory
from tierfs.replication.peers.peer_delete import PeerDelete, delete_handler
from tierfs.replication.peers.peer_files import PeerFiles, files_handler, written_handler
from tierfs.replication.peers.peer_manifest import ManifestFetcher, ManifestServer
from tierfs.replication.peers.peer_reader import PeerReader, RangeServer
from tierfs.replication.peers.peer_verify import PeerVerify, verify_handler
from tierfs.replication.peers.receiver import ReplicaReceiver
from tierfs.replication.peers.replicator import Replicator
from tierfs.replication.peers.server import Handler, PeerServer
from tierfs.retry import CATCH_UP_RETRIES, retry
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
                                                 ttl=cfg.lease_ttl, domain=cfg.failure_domain),
                         cfg.token, tls, connections=cfg.peer_connections)


class ClusterLinks:
    """This node's clients of its peers (with --cluster), made before the namespace, which is
    given them: reads from peers, other nodes' DCP shards, peer verification and deletes, over
    the connections of `directory`. They ask the tree questions only (who holds a step, which
    files are sealed)."""

    def __init__(self, cfg: MountConfig, core: Core, directory: PeerDirectory) -> None:
        view = core.view
        assert cfg.cluster is not None
        self.directory = directory
        self.live = directory.live
        self.etcd = self.live.etcd
        self.sealed = ClusterCommits(CommitRecords(self.etcd, cfg.cluster), cfg.node_id,
                                     view.step_number,
                                     ManifestFetcher(self.directory).fetch,
                                     view.committed_manifest,
                                     etcd_answers=lambda: self.live.etcd_answers)
        self.view = view
        self.learn_holders = core.learn_holders
        self.reader = PeerReader(self.directory, view.holders_of, self._file_holders)
        self.verify = PeerVerify(self.directory, self.sealed.placements, cfg.replicas)
        self.delete = PeerDelete(self.directory)
        self.files = PeerFiles(self.directory)  # shards whose records a commit lacks
        self.store_record = StoreRecord(self.etcd, cfg.cluster)
        self.node_id = cfg.node_id
        self.replicas = cfg.replicas

    async def wait_for_copies(self, manifest: mf.StepManifest, deadline: float) -> None:
        """--sync-replicas (`fs.model.ports.CopiesWait`): every file of the committed version has
        K + 1 verified copies on live nodes, or as many as there are live nodes."""
        want = copies_wanted(self.replicas, len(self.live.ring))
        await self.sealed.wait_for_copies(
            manifest, want, lambda node: node == self.node_id or self.live.is_up(node),
            deadline)

    async def _file_holders(self, data_dir: str, name: str) -> list[str]:
        """Who holds a file now, from its record in etcd (the holders known here failed):
        remembered for the next reads of the file. Not asked while etcd leaves this node's
        lease keepalives unanswered: cut off from etcd, every read whose holders fail would
        wait out a request's timeout (2 s) before its EIO."""
        step_node = self.view.step_of_entry(data_dir, name)
        if step_node is None or not step_node.step.committed:
            return []
        manifest = step_node.step.manifest
        if not self.live.etcd_answers:
            return []
        try:
            record = await self.sealed.file_record(manifest.path, name)
        except EtcdError as exc:
            log.info("could not ask etcd who holds %s/%s: %s", manifest.path, name, exc)
            return []
        if not recorded_copies.of_content(record, manifest.entry(name)):
            return []
        assert record is not None
        if self.view.find_step(manifest.path) is step_node:  # not replaced meanwhile
            self.learn_holders(step_node, {name: set(record.holders)})
        return list(record.holders)


class ClusterNode:
    """The cluster side of one daemon (with --cluster): the peer port and its handlers, its
    registration in etcd, the commits it follows and the copies of files it sends, wired to
    this node's namespace and store."""

    def __init__(self, cfg: MountConfig, links: ClusterLinks, namespace: Namespace,
                 store: RamStore, events: Events, uploader: Uploader | None = None) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.store = store
        self.live = links.live
        self.directory = links.directory
        self.verifier = namespace.verifier
        self.peer_delete = links.delete
        self.sealed = links.sealed
        self.store_record = links.store_record
        tiers = namespace.copies
        self.replicator = Replicator(self.directory, cfg.replicas,
                                     lambda digest: str(store.object_path(digest)),
                                     is_current=tiers.is_current,
                                     placements=functools.partial(
                                         self.sealed.placements,
                                         holds_copy=namespace.view.holds_copy),
                                     on_placements=tiers.note_placements,
                                     on_held=self._held, may_copy=tiers.may_copy,
                                     named_step=tiers.named_step,
                                     events=events)
        # the records `tierfs status` takes copies, holders and TIERS from
        self.recorded = RecordedHolders(self.recorded_holders, self.records_stamp)
        self.receiver = ReplicaReceiver(store.objects, store, tiers.hold_files)
        self.ranges = RangeServer(store.objects, namespace.view.sealed_path, cfg.node_id,
                                  namespace.chunk_for_peer)
        self.manifests = ManifestServer(namespace.view.committed_manifest)
        # the steps planned again, with this node's share of the uploads of steps committed
        # elsewhere (shared_uploads)
        self.plans = CopyPlans(self.replicator, uploader, namespace.view.find_step,
                               tiers.held_manifests, self._short_of_copies)
        self.steps = ClusterSteps(self.sealed, tiers, self.plans)
        # the links every node keeps (Lightning's last.ckpt), followed from now on
        assert cfg.cluster is not None
        self.shared_links = SharedLinks(links.etcd, cfg.cluster, cfg.node_id,
                                        namespace.link_changes().follow(),
                                        links_of=namespace.view.links_of,
                                        link_dirs=namespace.view.link_dirs,
                                        replace=namespace.replace_links)
        # `caught_up` in `tierfs status`
        self.caught_up = self.steps.caught_up

    async def _held(self, manifest: mf.StepManifest, peer: str, names: list[str]) -> bool:
        """A peer verified copies of these files: counted in etcd's records, then here (only
        those etcd took, for this content). Whether every one was recorded (if not, the
        replicator pauses before it tries again)."""
        found = await self.sealed.add_holders(manifest, peer, names)
        recorded = recorded_copies.recorded_holders_of(manifest, peer, names, found)
        if recorded:
            self.namespace.copies.mark_held(manifest, peer, recorded)
            self.recorded.changed(manifest.path, manifest.version,
                                  recorded_copies.holders_of_recorded(manifest, found))
        return len(recorded) == len(names)

    def handlers(self) -> dict[str, Handler]:
        """The peer port's handler of each request type (PING is the server's own)."""
        return {
            "PUT": self.receiver.put, "PUT_FILES": self.receiver.put_files,
            "HOLD": self.receiver.hold,
            "GET": self.ranges.on_get, "SWARM_GET": self.ranges.on_swarm_get,
            "GET_FILES": self.ranges.on_get_files,
            "MANIFEST": self.manifests.on_manifest,
            "VERIFY": verify_handler(self.verifier.check_held_file),
            "DELETE": delete_handler(self.namespace.copies.delete_from_peer),
            "FILES": files_handler(self.namespace.view.files_written),
            "WRITTEN": written_handler(self.namespace.view.files_being_saved),
        }

    def peer_server(self) -> PeerServer:
        """The peer port: this node's handlers, open to the cluster's admitted members."""
        assert self.cfg.token is not None
        tls = self.directory.tls
        return PeerServer(self.cfg.node_id, self.cfg.token, self.directory.ids,
                          self.handlers(), tls.server if tls else None, streamed={"PUT"})

    async def start(self, nursery: trio.Nursery) -> None:
        self.plans.start(nursery)
        nursery.start_soon(self.recorded.run)
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
        # every step of the cluster, and its links, from the start
        await self.steps.learn_all()
        await self.shared_links.learn_all()
        if self.namespace.recovered.may_have_lost_copies:
            # back without (some of) its copies: a step whose holders as its commit record
            # names them are live may still have lost every copy of a file, here and on
            # another node that came back empty too; the file records say (before `latest`
            # names such a step here)
            self.namespace.copies.want_recheck()
        for worker in (self.directory.run, self.replicator.run, self._restore_copies,
                       self.plans.plan_short_steps,
                       self.steps.follow, self.steps.publish_pending, self._recheck_losses,
                       self.shared_links.follow, self.shared_links.publish):
            nursery.start_soon(worker)
        nursery.start_soon(self.steps.catch_up)

    async def _drop_lost_copies(self) -> None:
        """The records stop counting this node as a holder of the copies it lost
        (`catch_up.drop_lost_copies`), before it is a live member; tried for CHECK_PATIENCE:
        a node that cannot correct them does not join (one line)."""
        namespace = self.namespace
        if not await drop_lost_copies(self.sealed, namespace.recovered,
                                      namespace.view.holds_copy, namespace.copies.in_store,
                                      CHECK_PATIENCE):
            raise self._unreachable("to correct the records of the copies this node lost")

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
        self.namespace.delete_everywhere(delete_targets(self.cfg, self.live.ring))

    async def _restore_copies(self) -> None:
        """When a node goes or comes, deletes go to the new set of peers and every step held
        here is planned again (`CopyPlans.members_changed`)."""
        while True:
            await self.directory.changed.wait()
            self._follow_members()
            self.plans.members_changed()

    def _short_of_copies(self, manifest: mf.StepManifest) -> bool:
        """Whether a file of this version held here has fewer copies on live peers than the
        replica-count rule wants, as the records read here last say
        (`CopyPlans.plan_short_again`)."""
        wanted = peer_copies_wanted(self.cfg.replicas,
                                    sum(1 for peer in self.directory.peers if peer.up))
        return wanted > 0 and self.namespace.copies.short_of_copies(manifest, wanted,
                                                                    self.directory.is_up)

    async def _recheck_losses(self) -> None:
        """Steps that may have lost every copy of a file, judged again from the records when
        members come and go (`recorded_copies.recheck_losses`)."""
        view = self.namespace.view

        def judge_all() -> None:
            for node in view.steps():
                view.loss(node.step, fresh=True)

        await recorded_copies.recheck_losses(self.namespace.copies, self.directory, self.sealed,
                                             judge_all)

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

    async def records_stamp(self, manifest: mf.StepManifest) -> tuple[int, int, int] | None:
        """What names the content of this committed version's file records now (its commit
        time and `step_reads.StepRead.stamp`); None if etcd does not answer or the cluster's
        commit is of another version."""
        records = self.sealed.records
        try:
            commit = await records.commit_of(manifest.path)
            if commit is None or commit.version != manifest.version:
                return None
            return (manifest.committed_ns, *(await records.reads.read(manifest.path)).stamp)
        except EtcdError:
            return None

    async def recorded_holders(self, manifest: mf.StepManifest) -> dict[str, set[str]] | None:
        """Who holds each file of this committed version, as the cluster's records say (a
        record of another content holds nothing of it); None if they cannot be read."""
        records = await self.sealed.placements(manifest)
        return None if records is None else recorded_copies.holders_by_file(manifest, records)

