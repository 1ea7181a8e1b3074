"""Daemon life cycle: pre-flight checks, the RAM store, the namespace, the FUSE session, the
control socket and clean shutdown on unmount, SIGTERM or SIGINT.

`run()` is what `tierfs mount` executes, in the foreground or in a detached child that reports
"ready" or one error line to its parent through a pipe, so `tierfs mount` returns only once the
file system answers.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.deletes import PERSIST, DeleteWorker, Tombstone, peer_target
from tierfs.fs.holders import RecordedHolders, spread
from tierfs.fs.namespace import Core, Namespace
from tierfs.fs.nodes import FsError, Node, StepState
from tierfs.fs.operations import Operations
from tierfs.fs.passthrough import PassthroughDevice, PassthroughUnavailable
from tierfs.fs.ram_store import RamDirBusy, RamFull, RamStore
from tierfs.fs.tree import Tree
from tierfs.fs.verify import StepReport, Verifier
from tierfs.mount_helper import admission, control
from tierfs.mount_helper.config import MountConfig
from tierfs.mount_helper.mounts import (
    TIERFS_TYPE,
    MountEntry,
    daemon_state,
    describe_daemon,
    filesystem_type,
    is_mounted,
    mount_at,
    mount_source,
    ram_dir_of,
    with_patience,
)
from tierfs.mount_helper.status_view import number_of
from tierfs.observe import Events, Levels, MetricsServer
from tierfs.replication.coordination import membership as live_members
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import CommitRecords
from tierfs.replication.coordination.etcd import Etcd, EtcdError
from tierfs.replication.coordination.store_record import StoreRecord, StoreUse
from tierfs.replication.peers.channel import SENT_TO
from tierfs.replication.peers.directory import PeerDirectory
from tierfs.replication.peers.peer_delete import PeerDelete, delete_handler
from tierfs.replication.peers.peer_manifest import ManifestFetcher, ManifestServer
from tierfs.replication.peers.peer_reader import PeerReader, RangeServer
from tierfs.replication.peers.peer_verify import PeerVerify, verify_handler
from tierfs.replication.peers.receiver import ReplicaReceiver
from tierfs.replication.peers.replicator import Replicator
from tierfs.replication.peers.server import Handler, PeerServer
from tierfs.retry import POLICY, retry
from tierfs.s3tier.backend import Backend, BackendError, open_backend
from tierfs.s3tier.reader import PersistentReader
from tierfs.s3tier.uploader import Uploader
from tierfs.step_names import some_names
from tierfs.step_queue import StepQueue

log = logging.getLogger(__name__)

CHECK_PATIENCE = 10.0  # seconds a mount waits for an unreachable persistent tier
CLUSTER_RECORDS = "etcd"  # the delete target of a step's records in the cluster's etcd
CATCH_UP_RETRIES = POLICY.capped(5.0)  # reading etcd after a start, until it answers
PENDING_RETRY = 0.5  # seconds between tries of pending commits (shards elsewhere, no space)
COPIES_FIRST = 10.0  # seconds at most that an upload waits for the peer copies of its step


class StartupError(Exception):
    """The mount cannot start; the text is the one line the user sees."""


class ReadyPipe:
    """The child's side of the pipe its `tierfs mount` parent waits on (or stderr if none)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def _send(self, line: str) -> None:
        if self._fd is None:
            if not line.startswith("OK"):
                print(f"tierfs: {line.split(' ', 1)[1]}", file=sys.stderr)
            return
        os.write(self._fd, (line.replace("\n", " ") + "\n").encode())

    def warn(self, message: str) -> None:
        self._send("WARN " + message)

    def ok(self) -> None:
        self._send("OK ready")
        self.close()

    def fail(self, message: str) -> None:
        self._send("ERR " + message)
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def preflight(cfg: MountConfig) -> list[str]:
    """Refuse what cannot work with one clear line; return warnings for what works badly."""
    mountpoint = cfg.mountpoint
    warnings = _clear_dead_mounts(mountpoint)
    if not mountpoint.exists():
        raise StartupError(f"mountpoint {mountpoint} does not exist")
    if not mountpoint.is_dir():
        raise StartupError(f"mountpoint {mountpoint} is not a directory")
    if not cfg.allow_non_empty and _has_entries(mountpoint):
        raise StartupError(f"mountpoint {mountpoint} is not empty: tierfs would hide what is "
                           "in it; empty it, choose another directory, or pass "
                           "--allow-non-empty")
    if not os.path.exists("/dev/fuse"):
        raise StartupError("/dev/fuse is missing: load the fuse kernel module or give the "
                           "container the fuse device")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise StartupError("/dev/fuse is not readable and writable by this user")
    try:
        cfg.ram_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = cfg.ram_dir / f"{reserved.PROBE}{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(f"RAM dir {cfg.ram_dir} is not writable: {exc.strerror}") from None
    fstype = filesystem_type(cfg.ram_dir)
    if fstype != "tmpfs":
        warnings.append(f"RAM dir {cfg.ram_dir} is on {fstype}, not tmpfs: writes go to that "
                        "file system, not to memory")
    return warnings


def _set_root_directory(cfg: MountConfig, store: RamStore) -> None:
    """--uid/--gid/--root-mode: the mount root is the RAM store's tree/ directory, so its
    owner and mode are set there (and stay across restarts of the daemon)."""
    try:
        if cfg.root_uid is not None or cfg.root_gid is not None:
            os.chown(store.tree, -1 if cfg.root_uid is None else cfg.root_uid,
                     -1 if cfg.root_gid is None else cfg.root_gid)
        if cfg.root_mode is not None:
            os.chmod(store.tree, cfg.root_mode)
    except OSError as exc:
        raise StartupError(f"cannot set the owner or mode of the mount root: "
                           f"{exc.strerror}") from None


def mount_options(cfg: MountConfig) -> set[str]:
    """FUSE options for both ways of mounting (pyfuse3's, and our own for passthrough)."""
    return set(pyfuse3.default_options) | ({"allow_other"} if cfg.allow_other else set())


def trusted_uids(cfg: MountConfig) -> frozenset[int]:
    """Who may commit, prefetch and verify through the control socket (see control)."""
    return frozenset({0, os.getuid()} | ({cfg.root_uid} if cfg.root_uid is not None else set()))


def _clear_dead_mounts(mountpoint: Path) -> list[str]:
    """Lazily unmount what a killed tierfs daemon left at `mountpoint` (every access to it
    fails with ENOTCONN, so nothing can use it); refuse any live or foreign mount there."""
    warnings = []
    while (entry := mount_at(mountpoint)) is not None:
        ram_dir = ram_dir_of(entry)
        if ram_dir is not None and daemon_state(ram_dir).state == "stopped":
            # Refused without a probe: a probe of a stopped daemon's mount blocks in the kernel
            # until the daemon resumes and keeps the mount busy until this process has exited,
            # so an unmount right after the refusal failed with EBUSY.
            raise _not_answering(mountpoint, entry)
        try:
            # statfs always reaches the daemon; stat may be answered from the kernel's cache
            with_patience(lambda: os.statvfs(mountpoint))
        except TimeoutError:
            raise _not_answering(mountpoint, entry) from None
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise StartupError(f"mountpoint {mountpoint}: {exc.strerror}") from None
            if entry.fstype != TIERFS_TYPE:
                raise StartupError(f"mountpoint {mountpoint} holds a dead {entry.fstype} mount: "
                                   f"`fusermount3 -u -z {mountpoint}` removes it") from None
            done = subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise StartupError(f"cannot remove the dead tierfs mount at {mountpoint}: "
                                   f"{done.stderr.strip() or 'fusermount3 failed'}") from None
            warnings.append(f"removed the dead tierfs mount at {mountpoint} (its daemon was "
                            "gone)")
            continue
        what = "tierfs is" if entry.fstype == TIERFS_TYPE else f"{entry.fstype} is"
        raise StartupError(f"mountpoint {mountpoint} is busy: {what} already mounted there"
                           + _daemon_clause(entry, True))
    return warnings


def _not_answering(mountpoint: Path, entry: MountEntry) -> StartupError:
    return StartupError(f"mountpoint {mountpoint} is busy: the {entry.fstype} mount there does "
                        "not answer" + _daemon_clause(entry, False))


def _daemon_clause(entry: MountEntry, answering: bool) -> str:
    ram_dir = ram_dir_of(entry)
    if ram_dir is None:
        return ""
    if answering:
        pid = daemon_state(ram_dir).pid
        return f" (daemon pid {pid}, RAM dir {ram_dir})" if pid is not None else ""
    return f" ({describe_daemon(ram_dir)})"


def _has_entries(directory: Path) -> bool:
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except OSError as exc:
        raise StartupError(f"cannot read mountpoint {directory}: {exc.strerror}") from None


def _first_leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of `kind` inside `exc` and its nested exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _first_leaf(inner, kind)) is not None:
                return found
        return None
    return exc if isinstance(exc, kind) else None


def setup_logging(cfg: MountConfig, to_stderr: bool) -> None:
    if not to_stderr:
        # A detached daemon writes everything, tracebacks of last resort included, to its log.
        try:
            cfg.log_file.parent.mkdir(parents=True, exist_ok=True)
            log_fd = os.open(cfg.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot write log file {cfg.log_file}: {exc.strerror}") from None
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def run(cfg: MountConfig, ready_fd: int | None = None) -> int:
    """Mount and serve until unmounted or signalled. Returns the process exit status."""
    ready = ReadyPipe(ready_fd)
    try:
        warnings = preflight(cfg)
        setup_logging(cfg, to_stderr=cfg.foreground)
        for warning in warnings:
            log.warning("%s", warning)
            ready.warn(warning)
        store = RamStore(cfg.ram_dir, cfg.ram_limit)
        store.acquire()
        _set_root_directory(cfg, store)
    except (StartupError, RamDirBusy) as exc:
        ready.fail(str(exc))
        return 1
    # From here on, modes of files under the mount come from the callers' requests, already
    # masked by the kernel with their umask; what tierfs makes for itself has explicit modes.
    os.umask(0)
    try:
        trio.run(_serve, cfg, store, ready)
    except Exception as exc:
        # Trio's nurseries wrap what their tasks raise in exception groups: say the cause.
        cause = _first_leaf(exc, StartupError) or _first_leaf(exc, Exception) or exc
        if isinstance(cause, StartupError):
            log.error("%s", cause)
            ready.fail(str(cause))
        else:
            log.exception("tierfs daemon failed")
            ready.fail(f"daemon failed: {type(cause).__name__}: {cause}")
        return 1
    finally:
        store.release()
    log.info("unmounted %s", cfg.mountpoint)
    return 0


async def _serve(cfg: MountConfig, store: RamStore, ready: ReadyPipe) -> None:
    # Made in dependency order, each given what it calls at construction (fs.ports): the
    # tree (loaded from the RAM store), the clients of the other tiers that serve it, the
    # namespace over both, then what follows its commits and serves the peers.
    commits_send, commits_recv = trio.open_memory_channel[mf.StepManifest](64)
    events = Events()
    members = _members(cfg) if cfg.cluster else None
    core = Core(store, node_id=cfg.node_id, step_pattern=cfg.step_pattern,
                file_step_pattern=cfg.file_step_pattern,
                commit_idle=cfg.commit_idle, delete_targets=_delete_targets(cfg),
                liveness=members)
    links = ClusterLinks(cfg, core.tree, members) if members else None
    backend, new_store = await _persistent_tier(cfg, ready, core.tree,
                                                links.store_record if links else None)
    persist = PersistentReader(backend, trio.CapacityLimiter(8),
                               core.deletes.old_keys) if backend else None
    # Peers come first among the read sources: faster than the persistent tier. Each is
    # metered: read-backs are event lines and metrics.
    sources = []
    if links is not None:
        sources.append(events.metered(links.reader, "peers"))
    if persist is not None and backend is not None:
        sources.append(events.metered(persist, backend.url))
    namespace = Namespace(core, commits_send, read_sources=sources,
                          sealed=links.sealed if links else None, persist=persist,
                          peers=links.verify if links else None, keep_ram=cfg.keep_ram,
                          replicas=cfg.replicas, events=events,
                          commit_timeout=cfg.commit_timeout, append_every=cfg.append_every,
                          copies_wait=links.wait_for_copies if links and cfg.sync_replicas
                          else None)
    verifier = namespace.verifier
    verifier.collect_unverified()
    store_used = trio.Event()  # this node persisted a step, or found the store holding some
    uploader = _uploader(cfg, backend, namespace, events, store_used) if backend else None
    if uploader is not None and await _adopt_stored_steps(namespace, uploader):
        store_used.set()
    source = mount_source(cfg.ram_dir)  # names the RAM dir: the command line finds us by it
    device = _open_passthrough(cfg, source)
    operations = Operations(namespace, cfg.control_socket, device)
    options = mount_options(cfg) | {f"fsname={source}", "subtype=tierfs"}
    try:
        pyfuse3.init(operations, device.library_mountpoint if device else str(cfg.mountpoint),
                     options)
    except RuntimeError as exc:
        if device is not None:
            device.close()
        raise StartupError(f"cannot mount {cfg.mountpoint}: {exc}") from None
    cluster = ClusterNode(cfg, links, namespace, store, events) if links else None
    daemon = Daemon(cfg, namespace, uploader, cluster, verifier, device, new_store=new_store)
    serving = True
    metrics = None
    try:
        if cfg.metrics is not None:
            metrics = _serve_metrics(cfg, events, daemon.levels)
        async with trio.open_nursery() as nursery:
            # Background work (hashes, evictions, read-ahead) is cancelled at unmount.
            await nursery.start(namespace.background.run)
            if device is not None:
                token = trio.lowlevel.current_trio_token()

                def terminate() -> None:
                    if serving:  # not after pyfuse3.close below
                        pyfuse3.terminate()

                device.start(on_unmount=lambda: token.run_sync_soon(terminate))
                nursery.start_soon(_account_direct_writes, namespace)
            if cluster is not None:
                await cluster.start(nursery)
            nursery.start_soon(_run_fuse, nursery.cancel_scope, namespace)
            await nursery.start(control.serve, cfg.control_socket, daemon.handle,
                                trusted_uids(cfg))
            nursery.start_soon(daemon.consume_commits, commits_recv)
            nursery.start_soon(events.run)
            if uploader is not None:
                nursery.start_soon(uploader.run)
                if cluster is not None:
                    nursery.start_soon(cluster.record_store_use, uploader.backend.url,
                                       store_used)
            nursery.start_soon(_verify_then_send, namespace, uploader, cluster)
            nursery.start_soon(_retry_pending_commits, namespace)
            nursery.start_soon(namespace.quiet.run)
            if cfg.append_every:
                nursery.start_soon(namespace.appends.run)
            nursery.start_soon(_delete_worker(namespace, uploader, cluster).run)
            if uploader is not None:
                nursery.start_soon(_store_links, namespace.tree, uploader)
            nursery.start_soon(_terminate_on_signal)
            await trio.to_thread.run_sync(os.stat, cfg.mountpoint)  # the mount answers
            log.info("mounted %s (RAM dir %s, limit %d bytes, pid %d)", cfg.mountpoint,
                     cfg.ram_dir, cfg.ram_limit, os.getpid())
            ready.ok()
    finally:
        serving = False
        pyfuse3.close(unmount=device is None and is_mounted(cfg.mountpoint))
        if device is not None:
            device.close()
        control.remove(cfg.control_socket)
        if metrics is not None:
            with trio.CancelScope(shield=True):
                await metrics.aclose()


def _serve_metrics(cfg: MountConfig, events: Events, levels: Callable[[], Levels]
                   ) -> MetricsServer:
    """--metrics: the HTTP endpoint, or the one line that says why it cannot listen."""
    host, port = cfg.metrics
    try:
        return MetricsServer(events, levels, host, port)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {host}:{port}: "
                           f"{exc.strerror or exc}") from None


async def _retry_pending_commits(namespace: Namespace) -> None:
    """Commits that wait for other nodes' shards, or failed (a full RAM dir), try again."""
    while True:
        await trio.sleep(PENDING_RETRY)
        await namespace.commits.retry_pending_commits()


def _delete_targets(cfg: MountConfig, peers: list[str] | None = None) -> list[str]:
    """What a delete made on this node must clean: the persistent tier, the cluster's records
    and every live peer (`ClusterNode` keeps the list current as members come and go)."""
    return ([PERSIST] if cfg.persist else []) + ([CLUSTER_RECORDS] if cfg.cluster else []) + [
        peer_target(node_id) for node_id in sorted(peers or []) if node_id != cfg.node_id]


async def _persistent_tier(cfg: MountConfig, ready: ReadyPipe, tree: Tree,
                           store_record: StoreRecord | None) -> tuple[Backend | None, bool]:
    """Open and check the persistent tier, and whether it is a new store; a user's mistake
    there stops the mount, and so does a new (empty) store where the RAM dir or the cluster
    says steps were persisted: its volume is not mounted, or it is the wrong store."""
    if cfg.persist is None:
        warning = "no --persist given: committed steps live only in this node's RAM"
        log.warning("%s", warning)
        ready.warn(warning)
        return None, False
    try:
        backend = open_backend(cfg.persist, cfg.s3_endpoint)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    with trio.move_on_after(CHECK_PATIENCE) as patience:
        while True:
            try:
                new = await trio.to_thread.run_sync(backend.check)
                break
            except BackendError as exc:
                if not exc.temporary:
                    raise StartupError(f"persistent tier: {exc}") from None
                log.info("persistent tier not reachable yet: %s", exc)
                await trio.sleep(1)
    if patience.cancelled_caught:
        raise StartupError(f"persistent tier {cfg.persist} is unreachable (tried for "
                           f"{CHECK_PATIENCE:.0f} s): check --s3-endpoint and the network")
    if new:
        persisted = [tree.relpath(node) for node in tree.steps() if node.step.persisted]
        if persisted:
            raise StartupError(
                f"persistent tier {backend.url} is empty, but RAM dir {cfg.ram_dir} records "
                f"{len(persisted)} step{'s' if len(persisted) != 1 else ''} as persisted "
                f"({some_names(persisted)}): is the store's volume mounted? (a new store "
                "needs a new --ram-dir)")
        used = await _cluster_store_use(cfg, store_record) if store_record else None
        if used is not None:
            raise StartupError(
                f"persistent tier {backend.url} is empty, but the cluster {cfg.cluster} "
                f"persisted steps to {used.url} (node {used.node} first): is the store's "
                "volume mounted on this node?")
        log.info("persistent tier %s is a new store", backend.url)
    try:
        await trio.to_thread.run_sync(backend.claim)
    except BackendError as exc:
        raise StartupError(f"persistent tier: {exc}") from None
    return backend, new


async def _cluster_store_use(cfg: MountConfig, record: StoreRecord) -> StoreUse | None:
    """Whether the cluster persisted steps to a store (read for CHECK_PATIENCE at most)."""
    with trio.move_on_after(CHECK_PATIENCE):
        return await retry(record.read, "reading the cluster's store record",
                           retryable=lambda exc: isinstance(exc, EtcdError),
                           policy=CATCH_UP_RETRIES)
    raise StartupError(f"etcd of --cluster {cfg.cluster} does not answer (tried for "
                       f"{CHECK_PATIENCE:.0f} s to read whether the cluster's steps went to a "
                       "store)")


def _uploader(cfg: MountConfig, backend: Backend, namespace: Namespace,
              events: Events, store_used: trio.Event) -> Uploader:
    """Uploads of committed steps; it tells the namespace's other tiers what it persisted."""
    tiers = namespace.tiers

    def persisted(manifest: mf.StepManifest) -> None:
        tiers.mark_persisted(manifest)
        store_used.set()
        namespace.deletes.poke()  # a rename's old name may leave the store now

    return Uploader(
        backend, lambda digest: str(namespace.store.object_path(digest)),
        persist_every=cfg.persist_every, keep_persist=cfg.keep_persist,
        step_number=namespace.tree.step_number,
        file_step_number=lambda name: namespace.tree.step_number(name,
                                                                 namespace.tree.file_pattern),
        is_current=tiers.is_current,
        on_persisted=persisted, on_retired=tiers.mark_retired,
        tracked_step=tiers.tracked_step, copy_sources=tiers.copy_sources,
        events=events,
    )


async def _adopt_stored_steps(namespace: Namespace, uploader: Uploader) -> int:
    """List what the persistent tier holds, so a fresh node sees the job's history at once.
    The number of steps it holds."""
    try:
        objects = await uploader.listing()
        manifests = await uploader.stored_manifests(objects)
    except BackendError as exc:
        log.warning("could not list the persistent tier yet: %s", exc)
        return 0
    added = sum(namespace.tiers.adopt_persisted(m) for m in manifests)
    log.info("persistent tier %s holds %d steps; %d of them not in RAM here",
             uploader.backend.url, len(manifests), added)
    stored_links = await uploader.stored_links(objects)  # each unreadable one is logged
    made = sum(namespace.tree.adopt_links(d, links) for d, links in stored_links.items())
    if made:
        log.info("made %d symbolic links the persistent tier keeps", made)
    namespace.residency.enforce_keep_ram()
    return len(manifests)


def _open_passthrough(cfg: MountConfig, source: str) -> PassthroughDevice | None:
    """Mount /dev/fuse ourselves when FUSE passthrough can be had; None: pyfuse3 mounts."""
    if not cfg.passthrough:
        return None
    try:
        return PassthroughDevice(str(cfg.mountpoint), sorted(mount_options(cfg)), source)
    except PassthroughUnavailable as exc:
        log.info("FUSE passthrough unavailable (%s): file data goes through the daemon", exc)
        return None


async def _account_direct_writes(namespace: Namespace) -> None:
    """Passthrough writes bypass the daemon: keep the RAM tier's usage figures current."""
    while True:
        await trio.sleep(0.5)
        namespace.account_direct_writes()


async def _verify_then_send(namespace: Namespace, uploader: Uploader | None,
                            cluster: ClusterNode | None) -> None:
    """Hash the RAM objects found at start, then upload and replicate what is due since before
    the restart: a copy that changed while no daemon watched is never sent anywhere."""
    await namespace.verifier.scan_at_start()
    if uploader is not None:
        for manifest in namespace.tiers.committed_manifests():
            uploader.submit(manifest)  # committed before a restart, not yet uploaded
    if cluster is not None:
        for manifest in namespace.tiers.held_manifests():
            cluster.replicator.submit(manifest)  # copies due since before a restart


async def _store_links(tree: Tree, uploader: Uploader) -> None:
    """The store learns the links of each directory whose links changed (fs.links); every
    directory holding links once after a start. Retried while the store cannot."""
    for directory in tree.link_dirs():
        tree.links.note(directory)
    failures = 0
    while True:
        changed = tree.links.changed
        for directory in sorted(tree.links.take()):
            try:
                await uploader.put_links(directory, tree.links_of(directory))
                failures = 0
            except BackendError as exc:
                failures += 1
                log.log(POLICY.level(failures), "the links of %s could not be stored yet: %s",
                        directory or ".", exc)
                tree.links.dirs.add(directory)  # again after the pause
        if tree.links.dirs:
            with trio.move_on_after(POLICY.delay(failures)):
                await tree.links.changed.wait()
        else:
            await changed.wait()


def _delete_worker(namespace: Namespace, uploader: Uploader | None,
                   cluster: ClusterNode | None) -> DeleteWorker:
    """Deleted steps leave the persistent tier and the peers (retried until they have)."""
    cleaners = {}
    if uploader is not None:
        async def from_store(tomb: Tombstone, _where: str) -> None:
            await uploader.delete_step(tomb.path, tomb.committed_ns)

        cleaners[PERSIST] = from_store
    if cluster is not None:
        cleaners["peer"] = cluster.peer_delete.delete

        async def from_etcd(tomb: Tombstone, _where: str) -> None:
            await cluster.sealed.forget(tomb.path, tomb.version, tomb.committed_ns)

        cleaners[CLUSTER_RECORDS] = from_etcd
    wanted = uploader.wanted if uploader is not None else None
    return DeleteWorker(namespace.deletes, cleaners,
                        lambda tomb: namespace.tiers.move_done(tomb, wanted))


async def _run_fuse(cancel_scope: trio.CancelScope, namespace: Namespace) -> None:
    await pyfuse3.main()
    # A clean unmount (umount, SIGTERM): steps whose savers are done commit now, not later.
    await namespace.quiet.commit_quiet_steps()
    cancel_scope.cancel()  # unmounted or terminated: stop the other workers


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def _members(cfg: MountConfig) -> PeerDirectory:
    """The cluster's members as this node sees them (from etcd), made before the tree: which
    steps can be read whole depends on who is up."""
    assert cfg.cluster is not None and cfg.advertise is not None and cfg.token is not None
    try:
        etcd = Etcd(cfg.cluster.endpoints, security=cfg.cluster.security)
    except EtcdError as exc:  # a TLS file that does not load
        raise StartupError(str(exc)) from None
    return PeerDirectory(live_members.Membership(etcd, cfg.cluster, cfg.node_id, cfg.advertise),
                      cfg.token)


class ClusterLinks:
    """This node's clients of its peers (with --cluster), made before the namespace, which is
    given them: reads from peers, other nodes' DCP shards, peer verification and deletes, over
    the connections of `directory`. They ask the tree questions only (who holds a step, which
    files are sealed)."""

    def __init__(self, cfg: MountConfig, tree: Tree, directory: PeerDirectory) -> None:
        assert cfg.cluster is not None
        self.directory = directory
        self.live = directory.live
        self.etcd = self.live.etcd
        self.sealed = ClusterCommits(CommitRecords(self.etcd, cfg.cluster), cfg.node_id,
                                     tree.step_number, ManifestFetcher(self.directory).fetch,
                                     tree.committed_manifest)
        self.tree = tree
        self.reader = PeerReader(self.directory, tree.holders_of, self._file_holders)
        self.verify = PeerVerify(self.directory, self.sealed.placements)
        self.delete = PeerDelete(self.directory)
        self.store_record = StoreRecord(self.etcd, cfg.cluster)
        self.node_id = cfg.node_id
        self.replicas = cfg.replicas

    async def wait_for_copies(self, manifest: mf.StepManifest, deadline: float) -> None:
        """--sync-replicas (`fs.ports.CopiesWait`): every file of the committed version has
        K + 1 verified copies on live nodes, or as many as there are live nodes."""
        want = min(self.replicas + 1, len(self.live.ring))
        await self.sealed.wait_for_copies(
            manifest, want, lambda node: node == self.node_id or self.live.is_up(node),
            deadline)

    async def _file_holders(self, data_dir: str, name: str) -> list[str]:
        """Who holds a file now, from its record in etcd (the holders known here failed):
        remembered for the next reads of the file."""
        step_node = self.tree.step_of_entry(data_dir, name)
        if step_node is None or not step_node.step.committed:
            return []
        manifest = step_node.step.manifest
        record = await self.sealed.file_record(manifest.path, name)
        entry = manifest.entry(name)
        if record is None or entry is None or record.xxh3 != entry.xxh3:
            return []
        if self.tree.find_step(manifest.path) is step_node:  # not replaced meanwhile
            self.tree.set_file_holders(step_node, {name: set(record.holders)})
        return list(record.holders)


class ClusterNode:
    """The cluster side of one daemon (with --cluster): the peer port and its handlers, its
    registration in etcd, the commits it follows and the copies of files it sends, wired to
    this node's namespace and store."""

    def __init__(self, cfg: MountConfig, links: ClusterLinks, namespace: Namespace,
                 store: RamStore, events: Events) -> None:
        self.cfg = cfg
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
        self.receiver = ReplicaReceiver(store.objects, store, tiers.hold_files)
        self.ranges = RangeServer(store.objects, namespace.tree.sealed_path, cfg.node_id,
                                  namespace.residency.chunk_for_peer)
        self.manifests = ManifestServer(namespace.tree.committed_manifest)

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
        return len(recorded) == len(names)

    async def start(self, nursery: trio.Nursery) -> None:
        handlers: dict[str, Handler] = {
            "PUT": self.receiver.put, "HOLD": self.receiver.hold,
            "GET": self.ranges.on_get, "SWARM_GET": self.ranges.on_swarm_get,
            "MANIFEST": self.manifests.on_manifest,
            "VERIFY": verify_handler(self.verifier.check_held_file),
            "DELETE": delete_handler(self.namespace.tiers.delete_from_peer),
        }
        server = PeerServer(self.cfg.node_id, self.cfg.token, self.directory.ids, handlers)
        assert self.cfg.listen is not None
        host, port = self.cfg.listen
        try:
            await nursery.start(server.run, host, port)
        except Exception as exc:  # an OSError, perhaps inside an exception group
            error = _first_leaf(exc, OSError)
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
        await self.sealed.learn_all(self._learn)  # every step of the cluster, from the start
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
            tiers.delete_from_peer(deletion.step, deletion.version, deletion.committed_ns,
                                   "another node (a tombstone in etcd)")
        for manifest in unpublished:
            tiers.publish_later(manifest)

    async def _drop_lost_copies(self) -> None:
        """The records stop counting this node as a holder of files it does not hold in RAM
        (`Tree.holds_copy`: it was replaced with an empty RAM dir, or lost files): the
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
                        self.namespace.tree.holds_copy, self.namespace.tiers.in_store)
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
        self.namespace.tiers.learn(manifest, holders)
        node = self.namespace.tree.find_step(manifest.path)
        if node is not None and node.step.committed and node.step.resident and \
                node.step.manifest.version == manifest.version:
            self.replicator.submit(node.step.manifest)

    async def _follow_commits(self) -> None:
        """Every commit of the other nodes is listed here within a watch event."""
        await self.sealed.follow(self._learn, self.namespace.tiers.unlisted)

    async def _publish_pending(self) -> None:
        """Commit records etcd could not take (it was down) are written once it is back."""
        while True:
            await trio.sleep(PENDING_RETRY)
            await self.namespace.tiers.publish_pending()

    async def _admit(self) -> None:
        """Refuse, with one line, a node that could not work as a member (`admission`)."""
        assert self.cfg.advertise is not None and self.cfg.token is not None
        try:
            await admission.check_reaches_itself(self.cfg.advertise, self.cfg.token,
                                                 self.cfg.node_id)
            with trio.move_on_after(CHECK_PATIENCE) as patience:
                await admission.check_cluster_token(self.live.etcd, self.cfg.cluster,
                                                    self.cfg.token)
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
                error = _first_leaf(exc, EtcdError)
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
        self.namespace.deletes.targets = _delete_targets(self.cfg, self.live.ring)

    async def _restore_copies(self) -> None:
        """When a node goes or comes, every node re-plans the copies of the files it holds
        from fresh records (lost copies are restored; a node joining moves nothing)."""
        while True:
            await self.directory.changed.wait()
            self._follow_members()
            for manifest in self.namespace.tiers.held_manifests():
                self.replicator.submit(manifest)

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
                tree.recoverable.loss(node.step)
            if self.directory.generation == generation:
                await changed.wait()

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


class Daemon:
    """Answers control requests and follows commit events."""

    def __init__(self, cfg: MountConfig, namespace: Namespace, uploader: Uploader | None,
                 cluster: ClusterNode | None, verifier: Verifier,
                 passthrough: PassthroughDevice | None = None, *, new_store: bool = False
                 ) -> None:
        self.cfg = cfg
        self.new_store = new_store  # the persistent tier was empty when this mount began
        self.namespace = namespace
        self.uploader = uploader
        self.cluster = cluster
        self.verifier = verifier
        self.passthrough = passthrough
        self.commits = 0
        # the records `tierfs status` takes copies, holders and TIERS from, in a cluster
        self.recorded = RecordedHolders(cluster.recorded_holders) if cluster else None

    async def consume_commits(self, events: trio.MemoryReceiveChannel[mf.StepManifest]) -> None:
        async with trio.open_nursery() as nursery:
            async for manifest in events:
                self.commits += 1
                if self.cluster is not None:
                    self.cluster.replicator.submit(manifest)
                if self.uploader is None:
                    continue
                if self.cluster is None:
                    self.uploader.submit(manifest)
                else:
                    nursery.start_soon(self._upload_after_copies, manifest, self.uploader,
                                       self.cluster.replicator.queue)

    @staticmethod
    async def _upload_after_copies(manifest: mf.StepManifest, uploader: Uploader,
                                   copies: StepQueue) -> None:
        """Peer copies go first: they end the single-copy window within seconds, and an upload
        beside them takes the network and CPU they need (1 GiB on loopback took 5.3 s to
        replicate beside its upload, 0.34 s alone). The upload waits until this node made its
        copies of the step, or gave up for now (no live peer: the store is then the only other
        tier), at most COPIES_FIRST seconds."""
        with trio.move_on_after(COPIES_FIRST):
            await copies.settled(manifest.path)
        uploader.submit(manifest)

    def persist_status(self) -> dict[str, Any] | None:
        if self.uploader is None:
            return None
        waiting = self._persist_waiting()
        return {"url": self.uploader.backend.url, "new_store": self.new_store,
                "sent_bytes": self.uploader.bytes_sent,
                "manifest_bytes": self.uploader.manifest_bytes_sent,
                "copied_bytes": self.uploader.bytes_copied,
                "every": self.cfg.persist_every,
                "keep": self.cfg.keep_persist, "pending_steps": len(waiting),
                "pending_bytes": sum(m.total_bytes for m in waiting)}

    def _persist_waits(self) -> dict[str, dict[str, Any]]:
        """Per step due in the store and not there yet: why not, since when, and how many
        requests of its upload failed (`persist_wait` in `tierfs status --json`)."""
        if self.uploader is None:
            return {}
        waits = {}
        for manifest in self._persist_waiting():
            reason, since_ns, failures = self.uploader.waiting(manifest)
            waits[manifest.path] = {"reason": reason, "since_ns": since_ns,
                                    "failures": failures}
        return waits

    def _persist_waiting(self) -> list[mf.StepManifest]:
        assert self.uploader is not None
        return [m for m in self.namespace.tiers.committed_manifests()
                if self.uploader.wanted(m)]

    def _replicas_waiting(self) -> list[mf.StepManifest]:
        """Steps made here that have fewer peer copies than --replicas."""
        return [m for m in self.namespace.tiers.owned_manifests()
                if self.namespace.tiers.short_of_copies(m, self.cfg.replicas)]

    def levels(self) -> Levels:
        """The gauges of the metrics endpoint (called in the trio thread at each scrape)."""
        pending = {}
        if self.uploader is not None:
            pending["persist"] = self._persist_waiting()
        if self.cluster is not None:
            pending["replica"] = self._replicas_waiting()
        peers = self.cluster.directory.peers if self.cluster else []
        store = self.namespace.store
        tree = self.namespace.tree
        incomplete = sum(1 for node in tree.steps()
                         if tree.recoverable.loss(node.step) is not None)
        return Levels(store.used_bytes, store.limit_bytes,
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
            await self.namespace.quiet.commit_quiet_steps()
            return {"ok": True, "status": await self.status()}
        if command not in ("commit", "commit_waits", "prefetch", "verify"):
            return {"ok": False, "error": f"unknown command {command!r}"}
        path = request.get("path")
        if not isinstance(path, str):
            return {"ok": False, "error": f"{command} needs a path"}
        if command == "commit_waits":  # `tierfs commit` shows it while it waits
            return {"ok": True, "waiting_for": self.namespace.commits.waiting_for(path)}
        try:
            if command == "verify":
                reports = await self.verifier.verify(path, bool(request.get("repair", True)))
                self._count_bad_copies(reports)
                return {"ok": True, "steps": [r.as_dict() for r in reports]}
            if command == "prefetch":
                return {"ok": True, "bytes": await self.namespace.residency.prefetch(path)}
            timeout = request.get("timeout", math.inf)
            if not isinstance(timeout, (int, float)) or timeout < 0:
                return {"ok": False, "error": "commit: timeout must be a number of seconds"}
            manifest = await self.namespace.commits.commit_path(path, timeout)
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
                    self.namespace.events.verify_failed(tier.tier.partition(":")[0],
                                                        len(tier.bad) + len(tier.repaired))

    def _step_status(self, node: Node, persist_waits: dict[str, dict[str, Any]],
                     recorded: dict[str, set[str]] | None = None) -> dict[str, Any]:
        """A step's status line, with the times `tierfs status` shows ages from:
        `committed_ns` (when its newest committed version was made; None before the first)
        and, for a step being written, `changed_ns` (its directory's last change); for a
        step due in the store and not there yet, `persist_wait` (else None). In a cluster,
        a committed step's `copies`, `holders` and `tiers` come from the cluster's records
        of its files (`recorded`; this node's view only if they could not be read), the
        same on every node (`fs.holders`), and `only_here` says whether a file of it is in
        no live node's RAM but this one's (and not in the store)."""
        tree = self.namespace.tree
        step = node.step
        status = dict(tree.step_status(node))
        if self.cluster is not None and step.committed:
            status.update(self._spread(step, recorded))
        else:
            is_up = self.cluster.directory.is_up if self.cluster else (lambda _peer: False)
            status["copies"] = tree.copies(step, is_up)
        manifest = node.step.manifest
        status["committed_ns"] = manifest.committed_ns if manifest is not None else None
        status["changed_ns"] = None
        if status["state"] == "writing":
            with contextlib.suppress(FsError, OSError):  # removed meanwhile
                status["changed_ns"] = tree.stat(node).st_mtime_ns
        status["persist_wait"] = persist_waits.get(status["path"])
        return status

    def _spread(self, step: StepState, recorded: dict[str, set[str]] | None
                ) -> dict[str, Any]:
        """`copies`, `holders`, `tiers` and `only_here` of a committed step in a cluster."""
        assert self.cluster is not None
        me = self.cfg.node_id
        tree = self.namespace.tree
        if recorded is None:  # etcd did not answer: what this node knows
            recorded = {e.name: tree.file_peers(step, e.name)
                        | ({me} if e.name in step.resident else set())
                        for e in step.manifest.files}
        is_up = self.cluster.directory.is_up
        held = spread(recorded, lambda peer: peer == me or is_up(peer))
        alone = not step.persisted and any(
            name in step.resident and not any(h != me and is_up(h) for h in nodes)
            for name, nodes in recorded.items())
        return {"copies": held.copies, "holders": list(held.holders),
                "tiers": held.tiers(step.persisted), "only_here": alone}

    async def status(self) -> dict[str, Any]:
        ns = self.namespace
        persist_waits = self._persist_waits()
        recorded = await self.recorded.of(ns.tiers.listed_manifests()) if self.recorded else {}
        steps = sorted((self._step_status(node, persist_waits, recorded.get(
                            node.step.manifest.path) if node.step.manifest else None)
                        for node in ns.tree.steps()),
                       key=lambda s: (os.path.dirname(s["path"]), number_of(s), s["path"]))
        return {
            "node_id": self.cfg.node_id,
            "mountpoint": str(self.cfg.mountpoint),
            "pid": os.getpid(),
            "ram_dir": str(self.cfg.ram_dir),
            "ram": {"used_bytes": ns.store.used_bytes, "limit_bytes": ns.store.limit_bytes},
            "passthrough": self.passthrough is not None and self.passthrough.enabled,
            "peers": self.cluster.directory.status() if self.cluster else [],
            "served_to_peers": self.cluster.served() if self.cluster else None,
            "persist": self.persist_status(),
            "commits": self.commits,
            "ram_check": dict(self.verifier.scan_counts, done=self.verifier.scan_done.is_set()),
            "verify": self.verifier.progress,
            "deletes": ns.deletes.status(),
            "steps": steps,
            "own_latest": ns.tree.own_latest_dirs(),
            "ram_only_links": ns.tree.ram_only_links(),
        }
