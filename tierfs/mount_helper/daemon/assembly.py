"""The daemon's entry point, which only assembles: `run()` is what `tierfs mount` executes
(in the foreground, or in a detached child that reports "ready" or one error line to its parent
through a pipe, so `tierfs mount` returns only once the file system answers); `_serve` builds
the parts in dependency order, starts their workers in one nursery and takes them down on
unmount, SIGTERM or SIGINT. What the parts do lives in their modules: `startup` (checks and
the persistent tier), `commit_pipeline` (what follows a commit), `cluster_service` (the node's
side of the cluster) and `control_api` (`tierfs status`, `commit`, `verify`...)."""

from __future__ import annotations

import logging
import os
import signal

import pyfuse3
import trio

from tierfs import manifest as mf
from tierfs.fs.fuse.operations import Operations
from tierfs.fs.namespace import Core, Namespace
from tierfs.fs.store.metered import MeteredSource
from tierfs.fs.store.ram_store import RamDirBusy, RamStore
from tierfs.mount_helper import control
from tierfs.mount_helper.config import MountConfig
from tierfs.mount_helper.daemon.cluster_service import ClusterLinks, ClusterNode, cluster_members
from tierfs.mount_helper.daemon.collection import run_full_collections
from tierfs.mount_helper.daemon.commit_pipeline import (
    delete_targets,
    delete_worker,
    make_uploader,
    upload_again,
    verify_then_send,
)
from tierfs.mount_helper.daemon.control_api import ControlApi
from tierfs.mount_helper.daemon.startup import (
    ReadyPipe,
    StartupError,
    adopt_stored_steps,
    first_leaf,
    mount_options,
    open_passthrough,
    open_persistent_tier,
    preflight,
    raise_open_file_limit,
    serve_metrics,
    set_root_directory,
    setup_logging,
    trusted_uids,
)
from tierfs.mount_helper.mounts import (
    mount_source,
    tierfs_on_top,
)
from tierfs.observe import Events
from tierfs.replication.commit_order import CommitPipeline
from tierfs.replication.coordination.upload_plans import UploadPlans
from tierfs.s3tier.packs import PackedReader
from tierfs.s3tier.reader import PersistentReader
from tierfs.s3tier.stored_links import store_links

log = logging.getLogger(__name__)


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
        set_root_directory(cfg, store)
    except (StartupError, RamDirBusy) as exc:
        ready.fail(str(exc))
        return 1
    except OSError as exc:  # e.g. no room for the lock's pid: a /dev/shm other processes fill
        ready.fail(f"RAM dir {cfg.ram_dir}: {exc.strerror or exc}")
        return 1
    # From here on, modes of files under the mount come from the callers' requests, already
    # masked by the kernel with their umask; what tierfs makes for itself has explicit modes.
    os.umask(0)
    raise_open_file_limit()
    try:
        trio.run(_serve, cfg, store, ready)
    except Exception as exc:
        # Trio's nurseries wrap what their tasks raise in exception groups: say the cause.
        cause = first_leaf(exc, StartupError) or first_leaf(exc, Exception) or exc
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
    # Made in dependency order, each given what it calls at construction (fs.model.ports): the
    # tree (loaded from the RAM store), the clients of the other tiers that serve it, the
    # namespace over both, then what follows its commits and serves the peers.
    commits_send, commits_recv = trio.open_memory_channel[mf.StepManifest](64)
    events = Events()
    members = cluster_members(cfg) if cfg.cluster else None
    core = Core(store, node_id=cfg.node_id, step_pattern=cfg.step_pattern,
                file_step_pattern=cfg.file_step_pattern,
                commit_idle=cfg.commit_idle, delete_targets=delete_targets(cfg),
                liveness=members)
    links = ClusterLinks(cfg, core, members) if members else None
    backend, new_store = await open_persistent_tier(cfg, ready, core.view,
                                                links.store_record if links else None)
    persist = PersistentReader(backend, trio.CapacityLimiter(8),
                               core.old_keys) if backend else None
    # Peers come first among the read sources: faster than the persistent tier. Each is
    # metered: read-backs are event lines and metrics.
    sources = []
    if links is not None:
        sources.append(MeteredSource(links.reader, "peers", events))
    if persist is not None and backend is not None:  # small files out of packs (s3tier.packs)
        sources.append(MeteredSource(PackedReader(persist), backend.url, events))
    namespace = Namespace(core, commits_send, read_sources=sources,
                          sealed=links.sealed if links else None, persist=persist,
                          peers=links.verify if links else None, keep_ram=cfg.keep_ram,
                          replicas=cfg.replicas, events=events,
                          commit_timeout=cfg.commit_timeout, append_every=cfg.append_every,
                          copies_wait=links.wait_for_copies if links and cfg.sync_replicas
                          else None, store_check=persist,
                          shards=links.files if links else None)
    verifier = namespace.verifier
    verifier.collect_unverified()
    store_used = trio.Event()  # this node persisted a step, or found the store holding some
    shares = UploadPlans(links.sealed, cfg.node_id, links.directory.is_up) if links else None
    uploader = make_uploader(cfg, backend, namespace, events, store_used,
                             shares) if backend else None
    if uploader is not None and await adopt_stored_steps(namespace, uploader.stored):
        store_used.set()
    source = mount_source(cfg.ram_dir)  # names the RAM dir: the command line finds us by it
    device = open_passthrough(cfg, source)
    operations = Operations(namespace, cfg.control_socket, device)
    options = mount_options(cfg) | {f"fsname={source}", "subtype=tierfs"}
    try:
        pyfuse3.init(operations, device.library_mountpoint if device else str(cfg.mountpoint),
                     options)
    except RuntimeError as exc:
        if device is not None:
            device.close()
        raise StartupError(f"cannot mount {cfg.mountpoint}: {exc}") from None
    namespace.session_started()  # invalidations can go
    cluster = ClusterNode(cfg, links, namespace, store, events, uploader) if links else None
    replicator = cluster.replicator if cluster else None
    pipeline = CommitPipeline(uploader, replicator)
    api = ControlApi(cfg, namespace, uploader, cluster, verifier, pipeline, device,
                     events=events, new_store=new_store,
                     persist_reads=(lambda: persist.requests) if persist else lambda: 0)
    metrics = None
    try:
        if cfg.metrics is not None:
            metrics = serve_metrics(cfg, events, api.levels)
        async with trio.open_nursery() as nursery:
            # Background work (hashes, evictions, read-ahead) is cancelled at unmount.
            await nursery.start(namespace.background.run)
            if device is not None:
                nursery.start_soon(device.run, pyfuse3.terminate)
                nursery.start_soon(namespace.keep_accounting_direct_writes)
            if cluster is not None:
                await cluster.start(nursery)
            nursery.start_soon(_run_fuse, nursery.cancel_scope, namespace)
            await nursery.start(control.serve, cfg.control_socket, api.handle,
                                trusted_uids(cfg))
            nursery.start_soon(pipeline.run, commits_recv)
            nursery.start_soon(events.run)
            nursery.start_soon(run_full_collections)
            if uploader is not None:
                nursery.start_soon(uploader.run)
                nursery.start_soon(upload_again, namespace, uploader)
                if cluster is not None:
                    nursery.start_soon(cluster.record_store_use, uploader.backend.url,
                                       store_used)
            nursery.start_soon(verify_then_send, namespace, uploader, replicator)
            nursery.start_soon(namespace.keep_committing)
            nursery.start_soon(delete_worker(namespace, uploader,
                                             cluster.peer_delete if cluster else None,
                                             cluster.sealed if cluster else None).run)
            if uploader is not None:
                nursery.start_soon(store_links, namespace.link_changes().follow(),
                                   namespace.view.link_dirs,
                                   namespace.view.links_of, uploader)
            nursery.start_soon(_terminate_on_signal)
            await trio.to_thread.run_sync(os.stat, cfg.mountpoint)  # the mount answers
            log.info("mounted %s (RAM dir %s, limit %d bytes, pid %d)", cfg.mountpoint,
                     cfg.ram_dir, cfg.ram_limit, os.getpid())
            ready.ok()
    finally:
        namespace.session_ending()  # before the session it sends on is gone
        # Not once unmounted (`tierfs umount`): what is left at the mount point (a
        # container's volume, a bind mount) stays.
        pyfuse3.close(unmount=device is None and tierfs_on_top(cfg.mountpoint, cfg.ram_dir))
        if device is not None:
            device.close()
        control.remove(cfg.control_socket)
        with trio.CancelScope(shield=True):
            if metrics is not None:
                await metrics.aclose()
            if members is not None:
                await members.live.etcd.aclose()


async def _run_fuse(cancel_scope: trio.CancelScope, namespace: Namespace) -> None:
    await pyfuse3.main()
    namespace.release_hash_threads()  # those a test took (`hold_hashes`)
    # A clean unmount (umount, SIGTERM): steps whose savers are done commit now, not later.
    await namespace.settle()
    cancel_scope.cancel()  # unmounted or terminated: stop the other workers


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return
