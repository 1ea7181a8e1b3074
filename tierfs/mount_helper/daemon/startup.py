"""What a mount checks and opens before it serves: the pre-flight checks (one line for each
mistake), the pipe that tells `tierfs mount` "ready" or why not, the log, the mount root's owner
and mode, the persistent tier (reachable, and the right store), the steps it already holds, and
FUSE passthrough when the kernel offers it."""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.fuse.passthrough import PassthroughDevice, PassthroughUnavailable
from tierfs.fs.namespace import Namespace
from tierfs.fs.store.ram_store import RamStore
from tierfs.fs.tree.tree_view import TreeView
from tierfs.mount_helper.config import MountConfig, memory_bytes
from tierfs.mount_helper.mounts import (
    TIERFS_TYPE,
    MountEntry,
    daemon_state,
    describe_daemon,
    filesystem_type,
    mount_at,
    ram_dir_of,
    with_patience,
)
from tierfs.mount_helper.status_view import human_bytes
from tierfs.observe import Events, Levels, MetricsServer
from tierfs.replication.coordination.etcd import EtcdError
from tierfs.replication.coordination.store_record import StoreRecord, StoreUse
from tierfs.retry import CATCH_UP_RETRIES, STORE_CHECK_RETRIES, retry
from tierfs.s3tier import holdings
from tierfs.s3tier.backend import Backend, BackendError, ObjectInfo, open_backend
from tierfs.s3tier.stored_steps import StoredSteps
from tierfs.step_names import some_names

log = logging.getLogger(__name__)

CHECK_PATIENCE = 10.0  # seconds a mount waits for an unreachable persistent tier


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
    warnings += _ram_limit_warnings(cfg)
    return warnings


# A limit this much above what holds it is worth a word (the default, 50% of memory, is the
# size of a default /dev/shm, give or take its rounding).
LIMIT_SLACK = 1.02


def _ram_limit_warnings(cfg: MountConfig) -> list[str]:
    """--ram-limit above the RAM dir's file system's size or the host's memory: one line.
    The mount goes on (the RAM dir may be a small tmpfs on purpose), but the limit does not
    hold: the file system fills first (ENOSPC from it), or the host swaps or kills."""
    limit = cfg.ram_limit
    above = []
    stats = os.statvfs(cfg.ram_dir)
    room = stats.f_blocks * stats.f_frsize
    if limit > room * LIMIT_SLACK:
        above.append(f"the RAM dir's file system ({human_bytes(room)} at {cfg.ram_dir})")
    memory = memory_bytes()
    if limit > memory * LIMIT_SLACK:
        above.append(f"this host's memory ({human_bytes(memory)})")
    if not above:
        return []
    return [f"--ram-limit {human_bytes(limit)} is more than {' and '.join(above)}: the RAM "
            "tier never reaches it (writes fail with ENOSPC once the file system is full, "
            "or the host runs out of memory first)"]


# The open files a daemon asks for when its hard limit is unlimited (the kernel's own cap,
# fs.nr_open, is 1,048,576 by default).
OPEN_FILES_WANTED = 1 << 20


def raise_open_file_limit() -> None:
    """As many open files as this process may have: a service's soft limit is often 1,024
    (systemd's, many container runtimes'), while its hard limit is far higher, and a daemon
    with users' files, uploads and copies open at once needs more than that."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # above fs.nr_open: keep the soft limit given
            log.info("open files stay at %d (raising them to %d failed: %s)", soft, wanted, exc)


def set_root_directory(cfg: MountConfig, store: RamStore) -> None:
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
    fails with ENOTCONN, so nothing can use it); refuse a live tierfs mount there, a dead
    foreign one, and one that does not answer. A live mount of another file system is mounted
    over, as a directory is: a container's volume is a bind mount (what is in it is checked
    as a directory's content is)."""
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
        if entry.fstype != TIERFS_TYPE:
            break
        raise StartupError(f"mountpoint {mountpoint} is busy: tierfs is already mounted there"
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


def first_leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of `kind` inside `exc` and its nested exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := first_leaf(inner, kind)) is not None:
                return found
        return None
    return exc if isinstance(exc, kind) else None


def setup_logging(cfg: MountConfig, to_stderr: bool) -> None:
    if not to_stderr:
        # A detached daemon writes everything, tracebacks of last resort included, to its log.
        try:
            cfg.log_file.parent.mkdir(parents=True, exist_ok=True)
            log_fd = os.open(cfg.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            st = os.fstat(log_fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
                # A log that was there already is the daemon's file from now on: 0600 like
                # every other (never a device or a pipe given as the log: /dev/null stays).
                os.fchmod(log_fd, 0o600)
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
    logging.getLogger("tierfs").setLevel(cfg.log_level)  # the libraries' (boto3's) stay at INFO


def serve_metrics(cfg: MountConfig, events: Events, levels: Callable[[], Levels]
                   ) -> MetricsServer:
    """--metrics: the HTTP endpoint, or the one line that says why it cannot listen."""
    host, port = cfg.metrics
    try:
        return MetricsServer(events, levels, host, port)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {host}:{port}: "
                           f"{exc.strerror or exc}") from None


async def open_persistent_tier(cfg: MountConfig, ready: ReadyPipe, view: TreeView,
                           store_record: StoreRecord | None) -> tuple[Backend | None, bool]:
    """Open and check the persistent tier, and whether it is a new store; a user's mistake
    there stops the mount, and so does a new (empty) store where the RAM dir or the cluster
    says steps were persisted: its volume is not mounted, or it is the wrong store."""
    if cfg.persist is None:
        stored_only = [view.relpath(node) for node in view.steps()
                       if node.step.persisted and not node.step.in_ram]
        if stored_only:
            raise StartupError(
                f"RAM dir {cfg.ram_dir} records {len(stored_only)} "
                f"step{'s' if len(stored_only) != 1 else ''} whose files are only in a "
                f"persistent tier ({some_names(stored_only)}): mount with --persist and the "
                "store they went to")
        warning = "no --persist given: committed steps live only in this node's RAM"
        log.warning("%s", warning)
        ready.warn(warning)
        return None, False
    try:
        backend = open_backend(cfg.persist, cfg.s3_endpoint)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    async def check() -> bool:
        return await trio.to_thread.run_sync(backend.check)

    with trio.move_on_after(CHECK_PATIENCE) as patience:
        try:
            new = await retry(check, "reaching the persistent tier",
                              retryable=lambda exc: isinstance(exc, BackendError)
                              and exc.temporary, policy=STORE_CHECK_RETRIES)
        except BackendError as exc:
            raise StartupError(f"persistent tier: {exc}") from None
    if patience.cancelled_caught:
        raise StartupError(f"persistent tier {cfg.persist} is unreachable (tried for "
                           f"{CHECK_PATIENCE:.0f} s): check --s3-endpoint and the network")
    if new:
        persisted = [view.relpath(node) for node in view.steps() if node.step.persisted]
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


async def adopt_stored_steps(namespace: Namespace, stored: StoredSteps) -> int:
    """List what the persistent tier holds, so a fresh node sees the job's history at once.
    The number of steps it holds."""
    try:
        objects = await stored.listing()
        manifests = await stored.complete_steps(objects)
    except BackendError as exc:
        log.warning("could not list the persistent tier yet: %s", exc)
        return 0
    added = sum(namespace.copies.adopt_persisted(m) for m in manifests)
    _check_persisted(namespace, manifests, objects)
    log.info("persistent tier %s holds %d steps; %d of them not in RAM here",
             stored.backend.url, len(manifests), added)
    stored_links = await stored.links(objects)  # each unreadable one is logged
    made = sum(namespace.adopt_links(d, links) for d, links in stored_links.items())
    if made:
        log.info("made %d symbolic links the persistent tier keeps", made)
    namespace.keep_ram()
    return len(manifests)


def _check_persisted(namespace: Namespace, manifests: list[mf.StepManifest],
                     objects: list[ObjectInfo]) -> None:
    """The steps the RAM dir records as persisted, checked against what the store holds now
    (its listing at this mount): one it lacks is no longer counted as persisted, and goes up
    again if it is in RAM, or is listed as lost if not (`Eviction.store_lacks`)."""
    stored = {m.path: m for m in manifests}
    for step_node in namespace.view.steps():
        step = step_node.step
        if not step.persisted:
            continue
        manifest = step.manifest
        there = stored.get(manifest.path)
        held = holdings.held_in(manifest, objects)
        if there is not None and there.same_content(manifest) and held.whole(manifest):
            continue
        namespace.store_lacks(step_node, held.lacking(manifest) if there is not None
                              else [e.name for e in manifest.files], "at this mount")


def open_passthrough(cfg: MountConfig, source: str) -> PassthroughDevice | None:
    """Mount /dev/fuse ourselves when FUSE passthrough can be had; None: pyfuse3 mounts."""
    if not cfg.passthrough:
        return None
    try:
        return PassthroughDevice(str(cfg.mountpoint), sorted(mount_options(cfg)), source)
    except PassthroughUnavailable as exc:
        log.info("FUSE passthrough unavailable (%s): file data goes through the daemon", exc)
        return None
