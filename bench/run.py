"""tierfs benchmark: unmodified DCP and torch.save against a tierfs mount, a tmpfs directory (the
machine's physical limit), a local-disk directory, and direct S3 (s3torchconnector), on the same
SeaweedFS endpoint tierfs persists to.

Runs are interleaved (tierfs, tmpfs, disk, s3, tierfs, ...) and repeated; medians are reported,
with each target's ratio to tmpfs computed pair by pair within a repetition, so that machine
noise cancels. Before every timed run, whatever its target, memory as large as the state is
touched and freed (`warm_memory`): a VM that hands freed memory back to its host (free page
reporting) charges its first touch again, and would charge it to whichever run got such pages.
Writes a Markdown table, a JSON file and a PNG chart into --out.

    python bench/run.py --size 2G --reps 3 --compare --out bench/results   # make bench
    python bench/run.py --size 256M --reps 2 --out bench/results-quick     # make bench-quick
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fuse_floor  # beside this script
import loopback_floor  # beside this script
import torch
import torch.distributed.checkpoint as dcp

from tierfs.devtools import certificates
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.free_ports import free_port
from tierfs.devtools.s3_proxy import Fault, S3Proxy
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.mount_helper import control
from tierfs.mount_helper.config import parse_size

TARGETS = ("tierfs", "tmpfs", "disk", "s3")
DAEMON_PATH = "tierfs, no passthrough"  # the same mount's data through the daemon (--compare)
BUCKET = "tierfs-bench"
METADATA_FILES = 1000
STORE_NICE = 19  # the S3 server's nice value (see Bench.__init__)
UNIFORM_SAVE = "DCP save, 16 equal files, 2 threads"
UNIFORM_FILES = 16
LOAD_DURING_UPLOAD = "DCP load, 1 thread, while the previous step uploads"
TORCH_LOAD_SETTLED = "torch.load, the file hashed and in the store"
# The goals of issues 14 and 25, beside each row they apply to.
GOALS = {UNIFORM_SAVE: ">= 0.9x", "torch.save": ">= 0.9x", LOAD_DURING_UPLOAD: ">= 0.8x",
         TORCH_LOAD_SETTLED: ">= 0.9x"}
# A step of many small files (per-tensor savers, sharded optimizer state): its own table, as
# times and their ratio to tmpfs (issue 25's goals).
MANY_FILES, MANY_FILE_BYTES = 10_000, 4096
# A step of small files uploaded to a store this many seconds away (every request held so long
# by a proxy: another zone's, or S3's own first-byte latency), against boto3 putting the same
# files directly through it with s3transfer's default concurrency (`aws s3 cp --recursive`'s)
DISTANT_FILES, DISTANT_DELAY, DIRECT_CONCURRENCY = 2_000, 0.02, 10
# A loose file appended (issue 24): a 1 MiB log, small appends.
APPEND_BASE, APPEND_BYTES, APPENDS = 1 << 20, 200, 20
APPEND_PERIOD, APPEND_SECONDS = 0.05, 5.0
FLOOR = "FUSE floor"  # the many-file rows on bench/fuse_floor.c: no FUSE daemon does better
# ... and on bench/pyfuse3_floor.py: no daemon on pyfuse3 and trio (as tierfs's) does better
PY_FLOOR = "pyfuse3 floor"
# ... and on bench/fuse_floor.c --as-tierfs: the same C file system answering extended
# attributes (`getfattr user.tierfs.*`) and under the kernel's permission checks, as tierfs's
# contract asks of any daemon (a reference beside the goals, which stay against FLOOR)
FLOOR_AS_TIERFS = "FUSE floor as tierfs"
# ... and through bindfs over tmpfs (a Debian package; the row is left out where it is not
# installed): a kernel FUSE passthrough daemon in C as users run it, every request answered
# by system calls on the directory below it
BINDFS = "bindfs over tmpfs"
# The peer data plane (issue 45): the loopback floor's connections (as --peer-connections'
# default), and the pairs of nodes each copy is timed on (label, what, options).
FLOOR_CONNECTIONS = 4
COPY_PAIRS = (("plain", "without --peer-tls", ()),
              ("one", "without --peer-tls, --peer-connections 1", ("--peer-connections", "1")),
              ("tls", "with --peer-tls", None))  # None: certificates made by the bench
LS_UPLOADING, LS_QUIET = "`ls -l`, while the step uploads", "`ls -l`, the step persisted"
READ_BACK = "read back, evicted (a fresh node)"
READ_BACK_PEER = "read back from a peer (a fresh node)"
# Issue 49's goals, set against the FUSE floor measured in the same run (tierfs / floor).
MANY_GOALS = {"save": "<= 4x", LS_UPLOADING: "<= 2x", LS_QUIET: "<= 2x", READ_BACK: "<= 4x"}


def transformer_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """A state dict shaped like a transformer plus Adam: a few large matrices, many small
    vectors, and two moments per parameter."""
    params: dict[str, torch.Tensor] = {}
    hidden = 1024
    layer_bytes = 12 * hidden * hidden * 4 * 3  # weights + Adam exp_avg + exp_avg_sq
    layers = max(1, total_bytes // layer_bytes)
    generator = torch.Generator().manual_seed(0)
    for layer in range(layers):
        for name, shape in (("attn.qkv", (3 * hidden, hidden)), ("attn.out", (hidden, hidden)),
                            ("mlp.up", (4 * hidden, hidden)), ("mlp.down", (hidden, 4 * hidden)),
                            ("ln1", (hidden,)), ("ln2", (hidden,))):
            weight = torch.randn(shape, generator=generator)
            params[f"layers.{layer}.{name}"] = weight
            params[f"optim.{layer}.{name}.exp_avg"] = torch.randn(shape, generator=generator)
            params[f"optim.{layer}.{name}.exp_avg_sq"] = torch.rand(shape, generator=generator)
    return params


def uniform_state(total_bytes: int, files: int = UNIFORM_FILES) -> dict[str, torch.Tensor]:
    """`files` equal tensors: saved with a file per tensor (`single_file_per_rank=False`),
    `files` equal files (the issue's "1 GiB, 16 x 64 MiB" save)."""
    generator = torch.Generator().manual_seed(1)
    return {f"shard.{i}": torch.randn(total_bytes // files // 4, generator=generator)
            for i in range(files)}


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(*pids: int) -> float:
    """User + system CPU seconds of these processes, all their threads (/proc/<pid>/stat)."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def wait_for_quiet(idle_share: float = 0.8, patience: float = 30.0) -> None:
    """Until the machine's CPUs were at least `idle_share` idle over half a second (at most
    `patience` seconds): work left over from the previous run (the S3 server writing out an
    upload, say) must not be charged to the next one."""
    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        idle, total = ticks()
        time.sleep(0.5)
        idle_after, total_after = ticks()
        if (idle_after - idle) >= idle_share * max(1, total_after - total):
            return


WARM_DIR = Path("/dev/shm")


@contextlib.contextmanager
def warm_pages(nbytes: int) -> Iterator[None]:
    """Touch `nbytes` of tmpfs pages, and free them on the way out: what runs next gets memory
    in use a moment ago. This VM returns freed memory to its host, and memory touched for the
    first time since costs about 3 s per GiB (doc/BENCHMARKS.md, "This machine's memory");
    without this the same save varied 1.1-2.9 s, by which pages it happened to get."""
    block = b"\xa5" * (64 << 20)
    fd, path = tempfile.mkstemp(prefix="tierfs-bench-warm-", dir=WARM_DIR)
    try:
        for _ in range(-(-nbytes // len(block))):
            os.write(fd, block)
        yield
    finally:
        os.close(fd)
        os.unlink(path)


def warm_memory(nbytes: int) -> None:
    """`warm_pages` just before a timed run."""
    with warm_pages(nbytes):
        pass


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="tierfs-bench-"))
        self.tmpfs = Path("/dev/shm") / f"tierfs-bench-tmpfs-{os.getpid()}"
        self.disk = self.work / "disk"
        # Room for every run's data. The store runs at a lower priority: on a real node it is
        # another machine, and here it would take the job's cores from a save or load that
        # runs beside an upload; a run with the machine to itself (the direct S3 rows,
        # committed -> persisted) is not slowed by it.
        self.s3 = SeaweedS3(self.work / "seaweed", volumes=2000, nice=STORE_NICE)
        self.mounts: dict[str, tuple[Path, int]] = {}  # name -> (mount point, daemon pid)
        self.floor: Path | None = None  # the FUSE floor's program, once built
        self.log = Path(self.args.out).absolute() / "tierfs.log"

    @property
    def mount(self) -> Path:
        return self.mounts["tierfs"][0]

    @property
    def pid(self) -> int:
        return self.mounts["tierfs"][1]

    @property
    def store_pid(self) -> int:
        assert self.s3.pid is not None, "the S3 server is not running"
        return self.s3.pid

    def __enter__(self) -> Bench:
        self.s3.start()
        try:  # a mount that fails to start leaves no S3 server or mount behind
            self.s3.client().create_bucket(Bucket=BUCKET)
            os.environ.update(AWS_ACCESS_KEY_ID=self.s3.access_key,
                              AWS_SECRET_ACCESS_KEY=self.s3.secret_key,
                              AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=self.s3.endpoint)
            for directory in (self.tmpfs, self.disk):
                directory.mkdir(parents=True)
            self.start_mount("tierfs", "--ram-limit", "16G", "--persist",
                             f"s3://{BUCKET}/tierfs")
            if self.args.compare:
                self.start_mount(DAEMON_PATH, "--ram-limit", "16G", "--no-passthrough")
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_mount(self, name: str, *options: str) -> Path:
        """A tierfs daemon of its own (RAM dir, mount point); its log goes to the results."""
        mountpoint = self.work / f"mnt-{_slug(name)}"
        mountpoint.mkdir(exist_ok=True)
        ram_dir = self._ram_dir(name)
        self.mounts[name] = (mountpoint, 0)
        self._tierfs("mount", str(mountpoint), "--ram-dir", str(ram_dir),
                     "--log-file", str(self.log), "--s3-endpoint", self.s3.endpoint, *options)
        self.mounts[name] = (mountpoint, self.status(name)["pid"])
        return mountpoint

    def stop_mount(self, name: str) -> None:
        mountpoint, pid = self.mounts.pop(name)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        shutil.rmtree(self._ram_dir(name), ignore_errors=True)

    @staticmethod
    def _ram_dir(name: str) -> Path:
        return Path("/dev/shm") / f"tierfs-bench-{os.getpid()}-{_slug(name)}"

    def status(self, name: str = "tierfs") -> dict[str, Any]:
        """The daemon's status through its control socket, in this process: a `tierfs status`
        subprocess every poll would take a core of this 2-core machine from the uploads the
        polls wait for."""
        if self.mounts[name][1]:
            return control.request(str(self._ram_dir(name) / "control.sock"),
                                   {"cmd": "status"})["status"]
        return json.loads(self._tierfs("status", str(self.mounts[name][0]), "--json"))

    def __exit__(self, *exc: object) -> None:
        for name in list(self.mounts):
            self.stop_mount(name)
        self.s3.stop()
        for path in (self.tmpfs, self.work):
            shutil.rmtree(path, ignore_errors=True)

    def _tierfs(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                              text=True)
        if done.returncode != 0:
            tail = self.log.read_text().splitlines()[-15:] if self.log.exists() else []
            raise RuntimeError(f"tierfs {args[0]}: {done.stderr.strip()}\n" + "\n".join(tail))
        return done.stdout

    def location(self, target: str, name: str) -> str:
        if target in self.mounts:
            return str(self.mounts[target][0] / "run" / name)
        return {"tmpfs": str(self.tmpfs / name), "disk": str(self.disk / name),
                "s3": f"s3://{BUCKET}/direct/{name}"}[target]

    def writer(self, target: str, name: str, threads: int, *, file_per_tensor: bool = False
               ) -> Any:
        if target == "s3":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageWriter

            return S3StorageWriter(region="us-east-1", path=self.location(target, name),
                                   s3client_config=S3ClientConfig(force_path_style=True),
                                   thread_count=threads)
        return dcp.FileSystemWriter(self.location(target, name), thread_count=threads,
                                    single_file_per_rank=not file_per_tensor)

    def reader(self, target: str, name: str) -> Any:
        if target == "s3":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader

            return S3StorageReader(region="us-east-1", path=self.location(target, name),
                                   s3client_config=S3ClientConfig(force_path_style=True))
        return dcp.FileSystemReader(self.location(target, name))

    def drop(self, target: str, name: str) -> None:
        """Remove what a run wrote, so the next repetition starts alike (RAM is finite)."""
        path = self.location(target, name)
        if target == "s3":
            client = self.s3.client()
            prefix = f"direct/{name}/"
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                         Prefix=prefix):
                for item in page.get("Contents", []):
                    client.delete_object(Bucket=BUCKET, Key=item["Key"])
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)

    def wait_settled(self, name: str, step: str) -> None:
        """Until run/`step` on mount `name` is what a resume would load: hashed, and in the
        store if that mount persists (the --no-passthrough mount of --compare does not)."""
        if self.status(name)["persist"] is not None:
            self.wait_for(step, lambda entry: entry["persisted"], name=name)
            return
        path = self.location(name, step)
        started = time.monotonic()
        while not _sealed(path):
            if time.monotonic() - started > 600:
                raise TimeoutError(f"run/{step} on {name}: not hashed within 600 s")
            time.sleep(0.02)

    def wait_for(self, step: str, condition: Callable[[dict[str, Any]], bool],
                 name: str = "tierfs") -> float:
        """Seconds until the status entry of run/`step` on mount `name` meets `condition`."""
        started = time.monotonic()
        while time.monotonic() - started < 600:
            entry = next((s for s in self.status(name)["steps"] if s["path"] == f"run/{step}"),
                         None)
            if entry and condition(entry):
                return time.monotonic() - started
            time.sleep(0.02)
        raise TimeoutError(f"run/{step} on {name}: condition not met within 600 s")


def _sealed(path: str) -> bool:
    """Whether tierfs has the file's hash (CONTRACT: `user.tierfs.xxh3` on sealed files)."""
    try:
        os.getxattr(path, "user.tierfs.xxh3")
    except OSError:
        return False
    return True


def _slug(name: str) -> str:
    """A mount's name as a path component."""
    return "".join(c if c.isalnum() else "-" for c in name)


def timed(func: Callable[[], object], warm: int,
          before: Callable[[], object] | None = None) -> float | BaseException:
    """Seconds `func` took (or what it raised), after `warm_memory(warm)` and `before`."""
    warm_memory(warm)
    if before is not None:  # untimed, right before: what it leaves running runs beside func
        before()
    started = time.perf_counter()
    try:
        func()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return exc
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    state = transformer_state(parse_size(args.size))
    size = state_bytes(state)
    fresh = {k: torch.empty_like(v) for k, v in state.items()}
    results: dict[str, dict[str, list[float]]] = {}
    extra: dict[str, list[float]] = {}
    failures: list[str] = []

    def record(workload: str, target: str, seconds: float | BaseException) -> None:
        if isinstance(seconds, BaseException):  # one failed run is reported, not fatal
            failures.append(f"{workload} on {target}: {type(seconds).__name__}: "
                            f"{str(seconds).strip().splitlines()[-1][:200]}")
            print(f"FAILED {failures[-1]}", flush=True)
            return
        results.setdefault(workload, {}).setdefault(target, []).append(seconds)

    uniform = uniform_state(size)
    many: dict[str, dict[str, list[float]]] = {}
    cluster_profiles: dict[str, dict[str, float]] = {}
    with Bench(args) as bench, PeakRss(bench.pid) as rss, \
            Profile(bench, args.profile and not args.cluster_only) as spy:
        targets = [*bench.mounts, *TARGETS[1:]]
        # --torch-only, --uniform-only, --persist-only: those rows alone (each on every target
        # it applies to)
        rows_only = args.torch_only or args.uniform_only or args.persist_only or args.distant_only
        everything = not rows_only
        if everything and not (args.cluster_only or args.appends_only or args.ranged_only):
            bench.floor = fuse_floor.build(bench.work)  # for the many-file rows
        if everything and not args.cluster_only and not args.many_files_only \
                and not args.ranged_only:
            _appended_log(bench, extra, failures)
        for rep in range(0 if args.cluster_only or args.appends_only or args.ranged_only
                         else args.reps):
            for target in [] if args.many_files_only or args.ranged_only or args.distant_only \
                    else targets:
                if args.persist_only and target not in ("tierfs", "s3"):
                    continue
                if target != "s3" and target != "disk" and (
                        everything or args.uniform_only or args.persist_only):
                    name = f"step_{rep * 10 + 2}"
                    previous = f"step_{rep * 10 + 1}"
                    cpu = cpu_seconds(bench.pid)
                    yielded = (bench.status().get("hashes_yielded_seconds", 0.0)
                               if target == "tierfs" else 0.0)
                    record(UNIFORM_SAVE, target, timed(lambda t=target, n=name: dcp.save(
                        uniform, storage_writer=bench.writer(t, n, 2, file_per_tensor=True)),
                        size, before=(lambda t=target, p=previous: dcp.save(
                            uniform, storage_writer=bench.writer(t, p, 2, file_per_tensor=True)))
                        if args.beside_previous else None))  # as in the full run: the
                    # previous step's hashes and upload (on tierfs) run beside the timed save
                    if target == "tierfs":  # the save returns committed, before its hashes
                        extra.setdefault("daemon_cpu_per_gib_uniform_save", []).append(
                            (cpu_seconds(bench.pid) - cpu) / (size / 2**30))
                        extra.setdefault("hashes_yielded_uniform_save", []).append(
                            bench.status().get("hashes_yielded_seconds", 0.0) - yielded)
                    bench.drop(target, name)
                    if args.beside_previous:
                        bench.drop(target, previous)
                for threads in (1, 4) if everything or args.persist_only else ():
                    name = f"step_{rep * 10 + threads}"
                    cpu, store_cpu = cpu_seconds(bench.pid), cpu_seconds(bench.store_pid)
                    seconds = timed(lambda t=target, n=name, th=threads: dcp.save(
                        state, storage_writer=bench.writer(t, n, th)), size)
                    record(f"DCP save, {threads} thread(s)", target, seconds)
                    if target == "tierfs" and threads == 4 and isinstance(seconds, float):
                        _after_tierfs_save(bench, name, extra, failures)
                        extra.setdefault("daemon_cpu_per_gib_saved_persisted", []).append(
                            (cpu_seconds(bench.pid) - cpu) / (size / 2**30))
                    if threads == 4 and target in ("tierfs", "s3"):  # what S3 costs the store
                        extra.setdefault(f"store_cpu_per_gib_{target}", []).append(
                            (cpu_seconds(bench.store_pid) - store_cpu) / (size / 2**30))
                    # After a 1-thread save the load starts while that step uploads (tierfs
                    # persists every step): the "load while the previous step uploads".
                    loaded = timed(lambda t=target, n=name: dcp.load(
                        fresh, storage_reader=bench.reader(t, n)), size)
                    record(LOAD_DURING_UPLOAD if threads == 1 else
                           f"DCP load ({threads}-thread save)", target, loaded)
                    if target == "tierfs" and threads == 1:
                        extra.setdefault("upload_running_after_load", []).append(
                            0.0 if _persisted(bench, name) else 1.0)
                    bench.drop(target, name)
                name = f"step_{rep * 10 + 5}"
                future_holder: list[Any] = []
                if not everything:
                    if args.torch_only and target != "s3":
                        _torch_rows(bench, state, size, target, rep, record)
                    continue
                record("DCP async_save, blocking part", target,
                       timed(lambda t=target, n=name, f=future_holder: f.append(dcp.async_save(
                           state, storage_writer=bench.writer(t, n, 1))), size))
                if future_holder:
                    try:
                        future_holder[0].result()
                    except BaseException as exc:  # noqa: BLE001 - reported like the others
                        record("DCP async_save, blocking part", target, exc)
                bench.drop(target, name)
                if target != "s3":
                    _torch_rows(bench, state, size, target, rep, record)
            if args.distant_only:
                _to_a_distant_store(bench, rep, extra)
            if rows_only:
                continue
            extra.setdefault("metadata_to_committed", []).append(_commit_latency(bench, rep))
            _many_files(bench, rep, many, extra, failures)
            print(f"repetition {rep + 1} of {args.reps} done", flush=True)
        spy.stop()
        try:
            # (with --ranged-only: its row alone)
            if not args.many_files_only and not args.appends_only and everything:
                _cluster(bench, state, fresh, args.reps, extra, cluster_profiles)
        except Exception as exc:  # noqa: BLE001 - the table above is still worth reporting
            failures.append(f"cluster measurements: {type(exc).__name__}: {exc}")
    return {"bytes": size, "reps": args.reps, "targets": targets, "results": results,
            "many_files": many,
            "extra": extra, "failures": failures, "daemon_rss_peak_kib": rss.peak_kib,
            "daemon_profile": spy.functions, "cluster_profiles": cluster_profiles,
            "machine": _machine()}


def _torch_rows(bench: Bench, state: dict[str, torch.Tensor], size: int, target: str,
                rep: int, record: Callable[[str, str, float | BaseException], None]) -> None:
    """torch.save of the state into one file, then torch.load of it at once (on tierfs beside
    that file's hash and upload), and again once tierfs has it in the store (a resume's load)."""
    path = bench.location(target, f"model_{rep}.pt")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    record("torch.save", target, timed(lambda: torch.save(state, path), size))
    record("torch.load", target, timed(lambda: torch.load(path, weights_only=True), size))
    if target in bench.mounts:
        bench.wait_settled(target, f"model_{rep}.pt")
    record(TORCH_LOAD_SETTLED, target,
           timed(lambda: torch.load(path, weights_only=True), size))
    bench.drop(target, f"model_{rep}.pt")


def _persisted(bench: Bench, name: str) -> bool:
    entry = next((s for s in bench.status()["steps"] if s["path"] == f"run/{name}"), None)
    return bool(entry and entry["persisted"])


def _after_tierfs_save(bench: Bench, name: str, extra: dict[str, list[float]],
                       failures: list[str]) -> None:
    """What a save costs beyond its time: RAM tier bytes, and the wait until persisted."""
    status = bench.status()
    entry = next(s for s in status["steps"] if s["path"] == f"run/{name}")
    extra.setdefault("ram_bytes_per_checkpoint_byte", []).append(
        status["ram"]["used_bytes"] / entry["bytes"])
    try:
        extra.setdefault("committed_to_persisted", []).append(
            bench.wait_for(name, lambda e: e["persisted"]))
    except TimeoutError as exc:
        failures.append(str(exc))


def _appended_log(bench: Bench, extra: dict[str, list[float]], failures: list[str]) -> None:
    """Bytes sent to the store per byte appended to a loose file of APPEND_BASE bytes (a log):
    APPENDS appends of APPEND_BYTES, each committed once quiet; then one descriptor appending
    every APPEND_PERIOD seconds for APPEND_SECONDS, committed by --append-every as it grows.
    File bytes, and with the manifests (one per version) too."""
    mount = bench.start_mount("appends", "--persist", f"s3://{BUCKET}/appends",
                              "--commit-idle", "0.2", "--append-every", "1")
    try:
        (mount / "run").mkdir()

        def sent() -> tuple[int, int]:
            persist = bench.status("appends")["persist"]
            return persist["sent_bytes"], persist["sent_bytes"] + persist["manifest_bytes"]

        def record(key: str, before: tuple[int, int], appended: int) -> None:
            after = sent()
            extra.setdefault(key, []).append((after[0] - before[0]) / appended)
            extra.setdefault(key + "_with_manifests", []).append(
                (after[1] - before[1]) / appended)

        log = mount / "run/train.log"
        log.write_bytes(os.urandom(APPEND_BASE))
        bench.wait_for("train.log", lambda e: e["persisted"], "appends")
        before = sent()
        for number in range(APPENDS):
            with open(log, "ab") as f:
                f.write(os.urandom(APPEND_BYTES))
            bench.wait_for("train.log", lambda e, v=number + 2: e["persisted"]
                           and e["version"] == v, "appends")
        record("appended_bytes_sent_per_byte", before, APPENDS * APPEND_BYTES)

        events = mount / "run/events.out.tfevents.1.bench"
        events.write_bytes(os.urandom(APPEND_BASE))
        bench.wait_for(events.name, lambda e: e["persisted"], "appends")
        before, appended = sent(), 0
        with open(events, "ab", buffering=0) as f:
            ends = time.monotonic() + APPEND_SECONDS
            while time.monotonic() < ends:
                appended += f.write(os.urandom(APPEND_BYTES))
                time.sleep(APPEND_PERIOD)
        bench.wait_for(events.name, lambda e: e["persisted"], "appends")
        record("streamed_bytes_sent_per_byte", before, appended)
    except (OSError, TimeoutError, RuntimeError) as exc:
        failures.append(f"appended log: {type(exc).__name__}: {exc}")
    finally:
        bench.stop_mount("appends")


def _commit_latency(bench: Bench, rep: int) -> float:
    """From the start of writing `.metadata` to its close, which commits a 1,000-file step."""
    step = bench.mount / "run" / f"step_{900 + rep}"  # a step name: it commits
    step.mkdir(parents=True)
    payload = os.urandom(16 << 10)
    for i in range(METADATA_FILES):
        (step / f"__{i}_0.distcp").write_bytes(payload)
    started = time.perf_counter()
    (step / ".metadata").write_bytes(payload)
    elapsed = time.perf_counter() - started
    if os.getxattr(step, "user.tierfs.state") != b"committed":
        raise RuntimeError(f"{step} is not committed after .metadata was closed")
    shutil.rmtree(step)
    return elapsed


def _many_files(bench: Bench, rep: int, many: dict[str, dict[str, list[float]]],
                extra: dict[str, list[float]], failures: list[str]) -> None:
    """A step of MANY_FILES files of MANY_FILE_BYTES each, then DCP's `.metadata` (which
    commits it on tierfs), on tierfs, tmpfs and the FUSE floor: the save, `ls -l` of the step,
    and reading every file back; on tierfs the read-back is a fresh node's (an empty RAM dir,
    the same store), once the step is persisted: every byte comes back from the store."""
    name = f"step_{800 + rep}"

    def record(workload: str, target: str, seconds: float | BaseException) -> None:
        if isinstance(seconds, BaseException):
            failures.append(f"{MANY_FILES:,} files, {workload} on {target}: {seconds!r}")
        else:
            many.setdefault(workload, {}).setdefault(target, []).append(seconds)

    with contextlib.ExitStack() as stack:
        steps = {"tierfs": bench.mount / "run" / name, "tmpfs": bench.tmpfs / "many" / name}
        if bench.floor is not None:
            floor = stack.enter_context(fuse_floor.mounted(bench.floor, bench.work / "floor"))
            steps[FLOOR] = floor / name
            as_tierfs = stack.enter_context(fuse_floor.mounted(
                [str(bench.floor), "--as-tierfs"], bench.work / "floor-as-tierfs"))
            steps[FLOOR_AS_TIERFS] = as_tierfs / name
        python_floor = stack.enter_context(fuse_floor.mounted(
            [sys.executable, str(fuse_floor.PYTHON_FLOOR)], bench.work / "pyfuse3-floor"))
        steps[PY_FLOOR] = python_floor / name
        bindfs = _bindfs(bench, stack)
        if bindfs is not None:
            steps[BINDFS] = bindfs / name
        _many_files_on(bench, name, steps, record, extra)
    _to_a_distant_store(bench, rep, extra)


def _to_a_distant_store(bench: Bench, rep: int, extra: dict[str, list[float]]) -> None:
    """committed -> persisted of a step of DISTANT_FILES small files to a store DISTANT_DELAY s
    away, and the same files put by boto3 directly, DIRECT_CONCURRENCY at a time: the requests
    in flight, not the bytes, set both."""
    name = f"step_{900 + rep}"
    with S3Proxy(bench.s3.endpoint) as proxy:
        proxy.plan = lambda _request: Fault("distant", delay=DISTANT_DELAY)
        mount = bench.start_mount("distant store", "--persist", f"s3://{BUCKET}/distant",
                                  "--s3-endpoint", proxy.endpoint)
        try:
            _write_many(mount / "run" / name, DISTANT_FILES)
            extra.setdefault("distant_committed_to_persisted", []).append(
                bench.wait_for(name, lambda entry: entry["persisted"], "distant store"))
        finally:
            bench.stop_mount("distant store")
        source = bench.tmpfs / "distant"
        _write_many(source, DISTANT_FILES)
        client = bench.s3.client(endpoint_url=proxy.endpoint)

        def put(entry: os.DirEntry[str]) -> None:
            with open(entry.path, "rb") as body:
                client.put_object(Bucket=BUCKET, Key=f"distant-direct/{name}/{entry.name}",
                                  Body=body)

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(DIRECT_CONCURRENCY) as pool:
            list(pool.map(put, os.scandir(source)))
        extra.setdefault("distant_direct", []).append(time.monotonic() - started)
        shutil.rmtree(source)


def _bindfs(bench: Bench, stack: contextlib.ExitStack) -> Path | None:
    """A bindfs mount of a tmpfs directory (default options: one thread), unmounted and its
    directory emptied when `stack` closes; None where bindfs is not installed."""
    if shutil.which("bindfs") is None:
        return None
    source, mountpoint = bench.tmpfs / "bindfs-source", bench.work / "bindfs"
    source.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(exist_ok=True)
    stack.callback(shutil.rmtree, source, ignore_errors=True)  # after the unmount below
    try:
        subprocess.run(["bindfs", str(source), str(mountpoint)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:  # a reference row: the rest goes on
        print(f"bindfs row left out: {exc}", flush=True)
        return None
    stack.callback(subprocess.run, ["fusermount3", "-u", "-z", str(mountpoint)],
                   capture_output=True)
    return mountpoint


def _many_files_on(bench: Bench, name: str, steps: dict[str, Path],
                   record: Callable[[str, str, float | BaseException], None],
                   extra: dict[str, list[float]]) -> None:
    for target, step in steps.items():
        def save(step: Path = step, target: str = target) -> None:
            took = _write_many(step)
            if target == "tierfs":
                extra.setdefault("many_files_metadata_to_committed", []).append(took)

        def ls(step: Path = step) -> None:
            subprocess.run(["ls", "-l", str(step)], stdout=subprocess.DEVNULL, check=True)

        for label, func in (("save", save), (LS_UPLOADING, ls)):
            record(label, target, timed(func, 0))
    bench.wait_for(name, lambda entry: entry["persisted"])
    for target, step in steps.items():  # again with nothing beside (tmpfs, the floor: the same)
        record(LS_QUIET, target,
               timed(lambda s=step: subprocess.run(["ls", "-l", str(s)], check=True,
                                                   stdout=subprocess.DEVNULL), 0))
    fresh = bench.start_mount("fresh node", "--persist", f"s3://{BUCKET}/tierfs")
    try:
        for target, step in {**steps, "tierfs": fresh / "run" / name}.items():
            record(READ_BACK, target, timed(lambda s=step: _read_all(s), 0))
    finally:
        bench.stop_mount("fresh node")
    _many_files_from_peer(bench, name, steps, record)
    shutil.rmtree(steps["tmpfs"])
    bench.drop("tierfs", name)


def _write_many(step: Path, files: int = MANY_FILES) -> float:
    """A step of `files` small files, DCP's way: its files, then `.metadata` (which commits it
    on tierfs); the seconds from the start of `.metadata` to its close."""
    step.mkdir(parents=True)
    for i in range(files):
        with open(step / f"t{i:05}.distcp", "wb") as f:
            f.write(i.to_bytes(8, "little") * (MANY_FILE_BYTES // 8))
    started = time.perf_counter()
    (step / ".metadata").write_bytes(b"m" * MANY_FILE_BYTES)
    return time.perf_counter() - started


def _read_all(step: Path) -> None:
    for entry in os.scandir(step):
        with open(entry.path, "rb") as f:
            f.read()


def _many_files_from_peer(bench: Bench, name: str, steps: dict[str, Path],
                          record: Callable[[str, str, float | BaseException], None]) -> None:
    """A fresh node reads the step back from the peer that wrote it (a cluster of two, no
    store: the read-back after a node loss); the other targets read theirs again beside it."""
    token = bench.work / "many-files.token"
    if not token.exists():
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(os.urandom(16).hex())
    with Etcd(bench.work / f"etcd-{name}") as etcd:  # stopped by pid
        def node(node_id: str) -> tuple[str, ...]:
            return ("--node-id", node_id, "--listen", f"127.0.0.1:{free_port()}",
                    "--cluster", etcd.cluster_url(f"many-{name}"), "--token-file", str(token))

        try:
            writer = bench.start_mount("many-files writer", *node("writer"))
            _write_many(writer / "run" / name)
            reader = bench.start_mount("many-files reader", *node("reader"))
            record(READ_BACK_PEER, "tierfs",
                   timed(lambda: _read_all(reader / "run" / name), 0))
        except Exception as exc:  # noqa: BLE001 - reported like the others
            record(READ_BACK_PEER, "tierfs", exc)
        finally:
            for mount in ("many-files reader", "many-files writer"):
                if mount in bench.mounts:
                    bench.stop_mount(mount)
    for target, step in steps.items():
        if target != "tierfs":
            record(READ_BACK_PEER, target, timed(lambda s=step: _read_all(s), 0))


def _cluster(bench: Bench, state: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor],
             reps: int, extra: dict[str, list[float]],
             profiles: dict[str, dict[str, float]]) -> None:
    """Two nodes on loopback: committed -> replicated; then a fresh node restores the step
    from its peers, and a fresh node without peers restores it from S3 (`--profile`: py-spy
    on the daemons of the replication and of the first peer restore, into `profiles`)."""
    token = bench.work / "cluster.token"
    with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(16).hex())  # private from its first byte
    with Etcd(bench.work / "etcd") as etcd:  # membership and commits; stopped by pid
        if not bench.args.ranged_only:
            _cluster_runs(bench, state, fresh, reps, extra, token, etcd.cluster_url("bench"),
                          profiles)
        if not bench.args.restores_only:
            _ranged_readback(bench, state_bytes(state), extra, token,
                             etcd.cluster_url("bench-ranged"))


def _save_before_a_copy(state: dict[str, torch.Tensor], path: Path) -> None:
    """A 4-thread DCP save into warm memory that holds as much again until it returns: the
    copy a peer receives right after gets memory in use a moment ago, too."""
    size = state_bytes(state)
    warm_memory(size)
    with warm_pages(size):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=4))


def _cluster_runs(bench: Bench, state: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor],
                  reps: int, extra: dict[str, list[float]], token: Path, url: str,
                  profiles: dict[str, dict[str, float]]) -> None:
    common = ("--cluster", url, "--token-file", str(token), "--ram-limit", "8G")

    def node(node_id: str) -> tuple[str, ...]:
        return ("--node-id", node_id, "--listen", f"127.0.0.1:{free_port()}", *common)

    floors = FloorSource(bench, state_bytes(state))
    for _ in range(max(2, reps)):  # beside the restores below (and their floors)
        for key in ("1", f"{FLOOR_CONNECTIONS}"):
            floors.measure(key, extra)
    persist = ("--persist", f"s3://{BUCKET}/cluster")
    writer = bench.start_mount("node0", *node("node0"), *persist)
    bench.start_mount("node1", *node("node1"))
    daemons = (bench.mounts["node0"][1], bench.mounts["node1"][1])
    step = "step_7000"
    size = state_bytes(state)
    cpu = cpu_seconds(*daemons)
    _save_before_a_copy(state, writer / "run" / step)
    with contextlib.ExitStack() as stack:
        spies = {f"replication, {role} ({name})": stack.enter_context(
                     Profile(bench, bench.args.profile, bench.mounts[name][1], name))
                 for role, name in (("sender", "node0"), ("receiver", "node1"))}
        extra["committed_to_replicated"] = [bench.wait_for(step, lambda e: bool(e["replicas"]),
                                                           "node0")]
    profiles.update({label: spy.functions for label, spy in spies.items()
                     if spy.functions})
    bench.wait_for(step, lambda e: e["persisted"], "node0")
    extra["daemon_cpu_per_gib_saved_replicated_persisted"] = [
        (cpu_seconds(*daemons) - cpu) / (size / 2**30)]
    # The same copy with no upload beside it: node1 persists nothing, so the copy of its step
    # to node0 has the two cores to itself (the peer path's own speed on this machine).
    wait_for_quiet()
    started = time.perf_counter()
    _save_before_a_copy(state, bench.mounts["node1"][0] / "run" / "step_7001")
    extra["save_async_copies"] = [time.perf_counter() - started]
    extra["committed_to_replicated_alone"] = [
        bench.wait_for("step_7001", lambda e: bool(e["replicas"]), "node1")]
    for tensor in fresh.values():  # its pages touched once, before any timed load
        tensor.zero_()
    copied = bench.tmpfs / "restore-reference"  # the same bytes, for a tmpfs `cp` of them
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(copied / step), thread_count=4))
    # Each timed run below gets warm memory for two copies of the step: a `cp -r` out of the
    # mount puts every byte into new pages twice (the RAM tier's file, then cp's copy), and
    # one warm-up of `size` left the second copy to memory this VM had handed back to its
    # host (0.8 s per 252 MiB shard written by the `cp`, strace -T, against 0.1 s warm).
    two_copies = 2 * size

    def reference_cp(key: str, *wrapper: str) -> None:
        """A timed `cp -r` of the step within tmpfs (run under `wrapper`), its time and its
        CPU-seconds into `extra` under `key`."""
        warm_memory(two_copies)
        children = _children_cpu()
        started = time.perf_counter()
        subprocess.run([*wrapper, "cp", "-r", str(copied / step), str(copied / "copy")],
                       check=True)
        extra.setdefault(key, []).append(time.perf_counter() - started)
        extra.setdefault(f"{key}_cpu", []).append(_children_cpu() - children)
        shutil.rmtree(copied / "copy")

    for rep in range(reps):
        reference_cp("restore_reference_cp")
        if shutil.which("strace"):
            # The same `cp` as out of any FUSE mount: there its copy_file_range gets EXDEV
            # (another file system) and it copies by read and write of 128 KiB, where on
            # tmpfs the kernel copies for it. strace stops it only at that call (seccomp).
            reference_cp("restore_reference_cp_rw", "strace", "-f", "--seccomp-bpf", "-e",
                         "trace=copy_file_range", "-e", "inject=copy_file_range:error=EXDEV",
                         "-o", os.devnull)
        # DCP's own load of those bytes from tmpfs: the most a DCP restore can get near `cp`
        warm_memory(two_copies)
        mine = _own_cpu()
        started = time.perf_counter()
        dcp.load(fresh, storage_reader=dcp.FileSystemReader(str(copied / step)))
        extra.setdefault("restore_reference_dcp_load", []).append(time.perf_counter() - started)
        extra.setdefault("restore_reference_dcp_load_cpu", []).append(_own_cpu() - mine)
        # Each source goes first in every other repetition: the first load of a run pays for
        # memory the machine touches for the first time (expensive on this VM), not its source.
        # "peer cp": a fresh node's `cp -r` of the step out of the mount, as the tmpfs `cp`.
        sources = [("peer", node("node2")), ("s3", persist), ("peer cp", node("node3"))]
        for source, options in sources if rep % 2 == 0 else sources[::-1]:
            name = f"fresh-{source}"
            mountpoint = bench.start_mount(name, *options)
            bench.wait_for(step, lambda e: True, name)
            wait_for_quiet()
            # the first repetition's peer restore is profiled: the fresh node and one holder
            profiled = (name, "node1") if rep == 0 and source == "peer" else ()
            with contextlib.ExitStack() as stack:
                spies = {f"restore from a peer, {who}": stack.enter_context(
                             Profile(bench, bench.args.profile, bench.mounts[who][1], who))
                         for who in profiled}
                warm_memory(two_copies)
                started = time.perf_counter()
                if source == "peer cp":
                    subprocess.run(["cp", "-r", str(mountpoint / "run" / step),
                                    str(copied / "copy")], check=True)
                else:
                    dcp.load(fresh, storage_reader=dcp.FileSystemReader(
                        str(mountpoint / "run" / step)))
                extra.setdefault(f"restore_from_{source.replace(' ', '_')}", []).append(
                    time.perf_counter() - started)
            # files the fresh node fetched ahead of their open (absent from older daemons)
            ahead = bench.status(name).get("fetched_ahead")
            if ahead is not None:
                extra.setdefault(f"restore_from_{source.replace(' ', '_')}_files_ahead",
                                 []).append(ahead["files"])
            shutil.rmtree(copied / "copy", ignore_errors=True)
            profiles.update({label: spy.functions for label, spy in spies.items()
                             if spy.functions})
            bench.stop_mount(name)
    shutil.rmtree(copied)
    if bench.args.restores_only:
        floors.close()
        return
    _sync_replicas_save(bench, state, extra, node)
    try:
        _copy_pairs(bench, state, extra, node, url, reps, floors)
    finally:
        floors.close()


def _own_cpu() -> float:
    """User + system CPU seconds of this process (every thread: a DCP load's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for children (a `cp`, say)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class FloorSource:
    """A tmpfs file of `size` bytes for the loopback floor (`loopback_floor.py`), and the
    certificates of a CA made here for its TLS runs."""

    def __init__(self, bench: Bench, size: int) -> None:
        self.size = size
        self.certs = bench.work / "floor-certs"
        self.certs.mkdir(exist_ok=True)
        certificates.make_ca(self.certs, "ca")
        certificates.make_cert(self.certs, "ca", "node", ip="127.0.0.1")
        self.path = bench.tmpfs / "floor-source"
        self.dest = bench.tmpfs
        block = os.urandom(64 << 20)
        with open(self.path, "wb") as f:
            for start in range(0, size, len(block)):
                f.write(block[:size - start])

    def measure(self, key: str, extra: dict[str, list[float]]) -> float:
        """One run of the floor `key` (`1`, FLOOR_CONNECTIONS or `tls`) in warm memory on a
        quiet machine: its seconds, also recorded with its CPU-seconds per GiB."""
        connections = 1 if key == "1" else FLOOR_CONNECTIONS
        warm_memory(self.size)
        wait_for_quiet()
        floor = loopback_floor.measure(self.path, self.dest, connections,
                                       self.certs if key == "tls" else None)
        extra.setdefault(f"loopback_floor_{key}", []).append(floor.seconds)
        extra.setdefault(f"loopback_floor_cpu_per_gib_{key}", []).append(
            floor.cpu_seconds / (self.size / 2**30))
        return floor.seconds

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _copy_seconds(bench: Bench, step: str, target: str) -> float | None:
    """The copy's own time from the daemons' log ("replicated to TARGET in S s"): from the
    replicator's start on the step's files to their copies verified and recorded."""
    pattern = re.compile(rf"Step run/{re.escape(step)}: replicated to {re.escape(target)} "
                         rf"in ([0-9.]+) (ms|s)")
    found = pattern.findall(bench.log.read_text(errors="replace")) if bench.log.exists() else []
    if not found:
        return None
    value, unit = found[-1]
    return float(value) / (1000 if unit == "ms" else 1)


def _copy_pairs(bench: Bench, state: dict[str, torch.Tensor], extra: dict[str, list[float]],
                node: Callable[[str], tuple[str, ...]], url: str, reps: int,
                floors: FloorSource) -> None:
    """The peer copy on a fresh pair of nodes for each of COPY_PAIRS (with the default 4
    connections, with 1, and with --peer-tls, certificates of a CA made here), `reps` times
    (at least 3), each right after a run of the loopback floor it is set against (the plain
    one with FLOOR_CONNECTIONS, or the TLS one), so that each ratio is taken pair by pair: the
    same save, timed from its return to its verified copy on the other node (and the copy
    alone, from the log), both daemons' CPU-seconds per GiB for the save and the copy, and
    each one's for the copy alone (from the save's return); the step is deleted after. Each
    pair is a cluster of its own (a cluster runs with TLS or without it)."""
    certs = bench.work / "peer-certs"
    certs.mkdir(exist_ok=True)
    certificates.make_ca(certs, "ca")

    def tls(name: str) -> tuple[str, ...]:
        certificates.make_cert(certs, "ca", name, ip="127.0.0.1")
        return ("--peer-tls", "--peer-cacert", str(certs / "ca.crt"), "--peer-cert",
                str(certs / f"{name}.crt"), "--peer-key", str(certs / f"{name}.key"))

    size = state_bytes(state)
    gib = size / 2**30
    for number, (label, _what, options) in enumerate(COPY_PAIRS):
        names = (f"{label}0", f"{label}1")
        for name in names:
            bench.start_mount(name, *(f"{url}-{label}" if arg == url else arg
                                      for arg in node(name)),
                              *(tls(name) if options is None else options))
        writer = bench.mounts[names[0]][0]
        daemons = [bench.mounts[name][1] for name in names]
        for rep in range(max(3, reps)):
            floor = floors.measure("tls" if label == "tls" else f"{FLOOR_CONNECTIONS}", extra)
            wait_for_quiet()
            step = f"step_{7100 + 10 * number + rep}"
            cpu = cpu_seconds(*daemons)
            _save_before_a_copy(state, writer / "run" / step)
            returned = [cpu_seconds(daemon) for daemon in daemons]
            seconds = bench.wait_for(step, lambda e: bool(e["replicas"]), names[0])
            extra.setdefault(f"committed_to_replicated_peer_{label}", []).append(seconds)
            extra.setdefault(f"floor_ratio_peer_{label}", []).append(floor / seconds)
            extra.setdefault(f"daemon_cpu_per_gib_saved_replicated_peer_{label}", []).append(
                (cpu_seconds(*daemons) - cpu) / gib)
            for role, daemon, before in zip(("sender", "receiver"), daemons, returned,
                                            strict=True):
                extra.setdefault(f"{role}_cpu_per_gib_copy_peer_{label}", []).append(
                    (cpu_seconds(daemon) - before) / gib)
            copy = _copy_seconds(bench, step, names[1])
            if copy is not None:
                extra.setdefault(f"copy_alone_peer_{label}", []).append(copy)
            shutil.rmtree(writer / "run" / step)  # from both nodes: RAM is finite
        for name in names:
            bench.stop_mount(name)


def _ranged_readback(bench: Bench, size: int, extra: dict[str, list[float]], token: Path,
                     url: str) -> None:
    """A safetensors shard of `size` bytes (2 MiB tensors) on one node, read from another
    that does not hold it (a fresh node; the same as a file evicted from its RAM): the first
    byte of an open + read in the middle of the shard, then `safe_open` + one tensor, with
    the bytes the holder sent for it (its `served_to_peers`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    common = ("--cluster", url, "--token-file", str(token), "--replicas", "0",
              "--ram-limit", "8G")
    holder = bench.start_mount("ranged0", "--node-id", "ranged0",
                               "--listen", f"127.0.0.1:{free_port()}", *common)
    reader = bench.start_mount("ranged1", "--node-id", "ranged1",
                               "--listen", f"127.0.0.1:{free_port()}", *common)
    shape = (512, 1024)  # float32: 2 MiB
    count = max(8, size // (2 << 20))
    step = "step_9000"
    (holder / "run" / step).mkdir(parents=True)
    save_file({f"layer{i}.weight": torch.randn(shape) for i in range(count)},
              str(holder / "run" / step / "model.safetensors"))
    bench._tierfs("commit", str(holder / "run" / step))
    bench.wait_for(step, lambda e: e["state"] == "committed", "ranged1")
    shard = reader / "run" / step / "model.safetensors"

    def sent() -> int:
        return int(bench.status("ranged0")["served_to_peers"]["sent_bytes"].get("ranged1", 0))

    started = time.perf_counter()
    with open(shard, "rb") as f:
        f.seek(shard.stat().st_size // 2)
        f.read(1)
    extra["ranged_first_byte"] = [time.perf_counter() - started]
    before = sent()
    with safe_open(str(shard), "pt") as f:
        tensor = f.get_tensor(f"layer{count * 3 // 4}.weight")
    moved = sent() - before
    extra["ranged_tensor_extra_mib"] = [(moved - tensor.numel() * tensor.element_size()) / 2**20]
    extra["ranged_shard_mib"] = [shard.stat().st_size / 2**20]
    for name in ("ranged0", "ranged1"):
        bench.stop_mount(name)


def _sync_replicas_save(bench: Bench, state: dict[str, torch.Tensor],
                        extra: dict[str, list[float]],
                        node: Callable[[str], tuple[str, ...]]) -> None:
    """The cost of --sync-replicas on the save: two fresh nodes with it, the same save as the
    one timed on node1 (which returns at the commit), returning once the copy is verified."""
    mountpoint = bench.start_mount("sync0", *node("sync0"), "--sync-replicas")
    bench.start_mount("sync1", *node("sync1"), "--sync-replicas")
    wait_for_quiet()
    started = time.perf_counter()
    _save_before_a_copy(state, mountpoint / "run" / "step_7002")
    extra["save_sync_replicas"] = [time.perf_counter() - started]
    for name in ("sync0", "sync1"):
        bench.stop_mount(name)


class Profile:
    """py-spy on one tierfs daemon while it runs (`--profile`): the share of its busy samples
    per innermost Python function, idle threads left out."""

    def __init__(self, bench: Bench, enabled: bool, pid: int | None = None,
                 name: str = "daemon") -> None:
        self.out = bench.work / f"{_slug(name)}.spy"
        self.functions: dict[str, float] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if enabled and spy:
            self._proc = subprocess.Popen([spy, "record", "--nonblocking",
                                           "-p", str(pid or bench.pid),
                                           "-f", "raw", "-r", "100", "-o", str(self.out)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # still attaching: no samples to report
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        if not self.out.exists():
            return
        from data_path_profile import _functions  # bench/ is this script's directory

        self.functions = _functions(self.out)


class PeakRss:
    """The highest resident set size of a process, sampled every 50 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    rss = int(next(line for line in f if line.startswith("VmRSS")).split()[1])
            except (FileNotFoundError, StopIteration):
                return
            self.peak_kib = max(self.peak_kib, rss)


def _machine() -> str:
    cpus = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpus} cores, {memory:.0f} GiB RAM, Linux {os.uname().release}, "
            f"torch {torch.__version__}")


def report(data: dict[str, Any], out: Path) -> str:
    size = data["bytes"]
    targets = data["targets"]
    lines = [f"Checkpoint: {size / 2**30:.2f} GiB, {data['reps']} interleaved repetitions; "
             f"machine: {data['machine']}.", "",
             "| workload | " + " | ".join(targets) + " | tierfs / tmpfs | goal |",
             "|---|" + "---|" * (len(targets) + 2)]
    for workload, by_target in data["results"].items():
        cells = []
        for target in targets:
            times = by_target.get(target)
            if not times:
                cells.append("-")
                continue
            median = statistics.median(times)
            cells.append(f"{median:.2f} s ({size / median / 2**30:.2f} GiB/s)")
        tier, tmp = by_target.get("tierfs"), by_target.get("tmpfs")
        ratio = "-"
        if tier and tmp:
            # throughput ratio per repetition, then the median: noise common to a pair cancels
            ratio = f"{statistics.median(b / a for a, b in zip(tier, tmp, strict=False)):.2f}x"
        lines.append(f"| {workload} | " + " | ".join(cells)
                     + f" | {ratio} | {GOALS.get(workload, '-')} |")
    many = data.get("many_files", {})
    if many:
        lines += ["", f"A step of {MANY_FILES:,} files x {MANY_FILE_BYTES // 1024} KiB "
                  "(seconds, median; a ratio is a time over tmpfs's, pair by pair; the FUSE "
                  "floor is a FUSE file system in C that only keeps the files in memory, "
                  "bench/fuse_floor.c: no FUSE daemon's ratio can be below its own; the "
                  "pyfuse3 floor the same file system on pyfuse3 and trio, as tierfs's daemon "
                  "is, bench/pyfuse3_floor.py; the FUSE floor as tierfs the C one answering "
                  "extended attributes under the kernel's permission checks, as tierfs's "
                  "contract asks; the goals are tierfs / FUSE floor):", "",
                  f"| workload | tierfs | tmpfs | {FLOOR} | {FLOOR_AS_TIERFS} | {PY_FLOOR} "
                  f"| {BINDFS} | tierfs / tmpfs | {FLOOR} / tmpfs | {PY_FLOOR} / {FLOOR} "
                  f"| {BINDFS} / {FLOOR} | {FLOOR_AS_TIERFS} / {FLOOR} "
                  f"| tierfs / {FLOOR_AS_TIERFS} | tierfs / {FLOOR} | goal |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for workload, by_target in many.items():
            tier, tmp, floor, as_tierfs, python_floor, bindfs = (
                by_target.get(t, []) for t in ("tierfs", "tmpfs", FLOOR, FLOOR_AS_TIERFS,
                                               PY_FLOOR, BINDFS))
            ratios = [f"{statistics.median(a / b for a, b in zip(x, y, strict=False)):.1f}x"
                      if x and y else "-" for x, y in ((tier, tmp), (floor, tmp),
                                                       (python_floor, floor), (bindfs, floor),
                                                       (as_tierfs, floor), (tier, as_tierfs),
                                                       (tier, floor))]
            cells = [f"{statistics.median(t):.2f} s" if t else "-"
                     for t in (tier, tmp, floor, as_tierfs, python_floor, bindfs)]
            lines.append(f"| {workload} | {' | '.join(cells)} | {' | '.join(ratios)} | "
                         f"{MANY_GOALS.get(workload, '-')} |")
    lines += ["", "| measurement | median | target |", "|---|---|---|"]
    lines += [f"| {label} | {value} | {target} |" for label, value, target in _extras(data)]
    if data.get("daemon_profile"):
        lines += ["", "Daemon profile (py-spy, busy samples of the single-node runs): "
                  + ", ".join(f"{k} {v}%" for k, v in data["daemon_profile"].items())]
    for label, functions in data.get("cluster_profiles", {}).items():
        lines += ["", f"Daemon profile, {label} (py-spy, busy samples): "
                  + ", ".join(f"{k} {v}%" for k, v in functions.items())]
    if data["failures"]:
        lines += ["", "Failed runs (left out of the medians):"]
        lines += [f"- {failure}" for failure in data["failures"]]
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(data, indent=2))
    _chart(data, out / "results.png")
    return table


def _extras(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    extra = {k: statistics.median(v) for k, v in data["extra"].items() if v}
    direct_s3 = data["results"].get("DCP save, 4 thread(s)", {}).get("s3")
    rows = []

    def row(key: str, label: str, unit: str, target: str) -> None:
        if key in extra:
            value = extra[key] * 1000 if unit == "ms" else extra[key]
            rows.append((label, f"{value:.{0 if unit == 'ms' else 2}f} {unit}".strip(), target))

    row("metadata_to_committed", f"`.metadata` -> committed, {METADATA_FILES:,}-file step", "ms",
        "< 50 ms")
    row("daemon_cpu_per_gib_uniform_save",
        f"daemon CPU-seconds per GiB of the {UNIFORM_FILES}-file save, until it returned "
        "(committed; its files are hashed after)", "s", "-")
    row("hashes_yielded_uniform_save",
        f"seconds the hashes paused for the {UNIFORM_FILES}-file save while it ran "
        "(`hashes_yielded_seconds`; with --beside-previous, the previous step's)", "s", "-")
    gb = data["bytes"] / 1e9
    row("many_files_metadata_to_committed",
        f"`.metadata` -> committed, {MANY_FILES:,}-file step (the close that commits it)", "ms",
        "< 100 ms")
    row("distant_committed_to_persisted",
        f"committed -> persisted, {DISTANT_FILES:,} x {MANY_FILE_BYTES // 1024} KiB, a store "
        f"{DISTANT_DELAY * 1000:.0f} ms away", "s",
        f"{extra['distant_committed_to_persisted'] / extra['distant_direct']:.2f}x boto3 putting "
        f"them directly, {DIRECT_CONCURRENCY} at a time ({extra['distant_direct']:.2f} s); goal "
        "<= 1.0x" if "distant_direct" in extra else "<= direct")
    floor = extra.get(f"loopback_floor_{FLOOR_CONNECTIONS}")

    def to_floor(key: str, goal: str = "") -> str:
        """A copy's rate, and its ratio to the loopback floor with FLOOR_CONNECTIONS."""
        if key not in extra:
            return "-"
        rate = f"{gb / extra[key]:.2f} GB/s"
        if floor is None:
            return rate
        return f"{rate}, {floor / extra[key]:.2f}x the floor{'; goal ' + goal if goal else ''}"

    for key, what in (("1", "1 connection"), (f"{FLOOR_CONNECTIONS}",
                                               f"{FLOOR_CONNECTIONS} connections")):
        row(f"loopback_floor_{key}", f"loopback floor, {what}: two plain processes, "
            "`sendfile` -> `recv_into` + `pwrite`, tmpfs to fresh tmpfs pages", "s",
            f"{gb / extra[f'loopback_floor_{key}']:.2f} GB/s; "
            f"{extra[f'loopback_floor_cpu_per_gib_{key}']:.2f} CPU-s/GiB"
            if f"loopback_floor_{key}" in extra else "-")
    row("loopback_floor_tls", f"loopback floor in TLS, {FLOOR_CONNECTIONS} connections: the "
        "same through Python's `ssl` (read into a buffer and written through OpenSSL; read "
        "through it and `pwrite`)", "s",
        f"{gb / extra['loopback_floor_tls']:.2f} GB/s, {floor / extra['loopback_floor_tls']:.2f}x "
        f"the plain floor; {extra['loopback_floor_cpu_per_gib_tls']:.2f} CPU-s/GiB"
        if "loopback_floor_tls" in extra and floor else "-")
    row("committed_to_replicated",
        "committed -> replicated (2 nodes, loopback; the writer persists after the copy)", "s",
        to_floor("committed_to_replicated"))
    row("committed_to_replicated_alone",
        "committed -> replicated, the other way (its writer persists nothing)", "s",
        to_floor("committed_to_replicated_alone"))
    row("committed_to_persisted", "committed -> persisted (after the 4-thread save returned)",
        "s", f"{extra['committed_to_persisted'] / statistics.median(direct_s3):.2f}x the direct "
        f"S3 save ({statistics.median(direct_s3):.2f} s); goal <= 1.0x"
        if direct_s3 and "committed_to_persisted" in extra else "<= direct S3 save")
    row("store_cpu_per_gib_tierfs",
        "the S3 server's CPU-seconds per GiB: the 4-thread save, committed and persisted", "s",
        "-")
    row("store_cpu_per_gib_s3", "the S3 server's CPU-seconds per GiB: the direct 4-thread save",
        "s", "-")
    row("save_sync_replicas",
        "4-thread DCP save with --sync-replicas (returns once its copy is verified; 2 nodes)",
        "s", f"{extra['save_sync_replicas'] - extra['save_async_copies']:+.2f} s against the "
        f"save that returns at the commit ({extra['save_async_copies']:.2f} s, another save)"
        if "save_async_copies" in extra and "save_sync_replicas" in extra else "-")
    goals = {"plain": ">= 0.7x", "tls": ">= 0.5x"}
    for label, what, _options in COPY_PAIRS:
        key = f"committed_to_replicated_peer_{label}"
        pairwise = extra.get(f"floor_ratio_peer_{label}")
        against = "the TLS floor" if label == "tls" else "the floor"
        target = to_floor(key, goals.get(label, ""))
        if key in extra and pairwise is not None:
            target = (f"{gb / extra[key]:.2f} GB/s, {pairwise:.2f}x {against} run just before "
                      "it (median of the pairs)")
            if label == "tls" and floor:
                target += f"; {floor / extra[key]:.2f}x the plain floor (medians)"
            if label in goals:
                target += f"; goal {goals[label]} the plain floor"
        row(key, f"committed -> replicated {what} (a fresh pair of nodes; nothing persisted; "
            "each copy right after a run of the floor it is set against)", "s", target)
        row(f"copy_alone_peer_{label}", f"the copy alone {what} (its \"replicated to\" log "
            "line: from the first chunk sent to the copy verified and recorded)", "s",
            to_floor(f"copy_alone_peer_{label}"))
        row(f"daemon_cpu_per_gib_saved_replicated_peer_{label}",
            f"daemon CPU-seconds per GiB saved + replicated {what} (both daemons)", "s",
            "goal <= 1.55 s (halved)" if label == "plain" else "-")
        for role in ("sender", "receiver"):
            row(f"{role}_cpu_per_gib_copy_peer_{label}",
                f"the {role}'s CPU-seconds per GiB from the save's return to the copy "
                f"verified, {what}", "s", "-")
    row("restore_from_peer", "restore into a fresh node from a peer (DCP load)", "s",
        f"{extra['restore_reference_cp'] / extra['restore_from_peer']:.2f}x a tmpfs `cp` of "
        f"the same bytes ({extra['restore_reference_cp']:.2f} s); DCP's own load from tmpfs "
        f"{extra['restore_reference_cp'] / extra['restore_reference_dcp_load']:.2f}x "
        f"({extra['restore_reference_dcp_load']:.2f} s)"
        if {"restore_reference_cp", "restore_from_peer", "restore_reference_dcp_load"} <= set(
            extra) else "-")
    row("restore_from_peer_cp", "restore into a fresh node from a peer (`cp -r` of the step)",
        "s", f"{extra['restore_reference_cp'] / extra['restore_from_peer_cp']:.2f}x a tmpfs "
        "`cp -r` of the same bytes; goal >= 0.7x"
        + (f"; {extra['restore_from_peer_cp_files_ahead']:.0f} files fetched ahead of their "
           "open" if "restore_from_peer_cp_files_ahead" in extra else "")
        if "restore_reference_cp" in extra and "restore_from_peer_cp" in extra else "-")
    if {"restore_reference_cp", "restore_reference_cp_cpu", f"loopback_floor_{FLOOR_CONNECTIONS}",
            f"loopback_floor_cpu_per_gib_{FLOOR_CONNECTIONS}"} <= set(extra):
        # Any restore by `cp` moves the bytes into this node's RAM (at best the floor's work)
        # and copies them out (the tmpfs `cp`'s; out of a FUSE mount by read and write, the
        # `cp` with EXDEV, where measured): on 2 cores it takes at least the longer of the
        # two, and at least their CPU-seconds over 2.
        cp = extra["restore_reference_cp"]
        rw = "restore_reference_cp_rw" in extra  # with its _cpu (`reference_cp`)
        out, out_cpu = (extra["restore_reference_cp_rw"], extra["restore_reference_cp_rw_cpu"]) \
            if rw else (cp, extra["restore_reference_cp_cpu"])
        move_cpu = extra[f"loopback_floor_cpu_per_gib_{FLOOR_CONNECTIONS}"] * gb / 1.073741824
        bound = max(floor or 0.0, out, (move_cpu + out_cpu) / 2)
        extra["restore_cp_floor"] = bound
        how = "`cp` by read and write, as out of a FUSE mount" if rw else "the tmpfs `cp`"
        row("restore_cp_floor", f"the floor of a restore by `cp -r` here: the loopback floor "
            f"and {how}, on 2 cores", "s", f"{cp / bound:.2f}x a tmpfs `cp -r`: the "
            f"most any peer restore by `cp` reaches here (floor {floor:.2f} s and "
            f"{move_cpu:.2f} CPU-s, `cp` {out:.2f} s and {out_cpu:.2f} CPU-s; the tmpfs "
            f"`cp` {cp:.2f} s)")
    row("restore_from_s3", "restore into a fresh node from S3 (DCP load)", "s",
        f"peer {extra['restore_from_s3'] / extra['restore_from_peer']:.1f}x faster "
        "(goal >= 2x)"
        if "restore_from_peer" in extra and "restore_from_s3" in extra else "-")
    if {"restore_from_s3", "restore_reference_dcp_load", "restore_reference_dcp_load_cpu",
            f"loopback_floor_cpu_per_gib_{FLOOR_CONNECTIONS}"} <= set(extra) and floor:
        # A DCP restore from a peer moves the bytes into this node's RAM (the floor's work at
        # best) and loads them (DCP's own load from tmpfs): the same bound as for `cp`.
        load, load_cpu = extra["restore_reference_dcp_load"], extra[
            "restore_reference_dcp_load_cpu"]
        move_cpu = extra[f"loopback_floor_cpu_per_gib_{FLOOR_CONNECTIONS}"] * gb / 1.073741824
        bound = max(floor, load, (move_cpu + load_cpu) / 2)
        extra["restore_dcp_floor"] = bound
        row("restore_dcp_floor", "the floor of a DCP restore from a peer here: the loopback "
            "floor and DCP's own load from tmpfs, on 2 cores", "s",
            f"{extra['restore_from_s3'] / bound:.1f}x faster than the S3 restore: the most any "
            f"peer restore reaches here (floor {floor:.2f} s and {move_cpu:.2f} CPU-s, the "
            f"load {load:.2f} s and {load_cpu:.2f} CPU-s)")
    shard = f"{extra['ranged_shard_mib']:.0f} MiB" if "ranged_shard_mib" in extra else "a"
    row("ranged_first_byte", f"first byte of a read in the middle of a {shard} file on a peer "
        "(open + read, a fresh node)", "ms", "< 50 ms")
    row("ranged_tensor_extra_mib", f"`safe_open` + one 2 MiB tensor of a {shard} safetensors "
        "shard on a peer: MiB moved beyond the tensor", "MiB", "a few MiB (not the shard)")
    row("daemon_cpu_per_gib_saved_replicated_persisted",
        "daemon CPU-seconds per GiB saved + replicated + persisted (both daemons)", "s",
        "measured; halved")
    row("daemon_cpu_per_gib_saved_persisted",
        "daemon CPU-seconds per GiB saved + persisted (one node, 4-thread save)", "s", "-")
    row("upload_running_after_load",
        "share of the loads during upload that ended before the upload did", "x", "1.00")
    row("ram_bytes_per_checkpoint_byte", "RAM tier bytes per checkpoint byte", "x", "<= 1.05")
    for key, how in (("appended", f"{APPENDS} appends of {APPEND_BYTES} B, each committed once "
                      "quiet"),
                     ("streamed", f"appended every {APPEND_PERIOD * 1000:.0f} ms for "
                      f"{APPEND_SECONDS:.0f} s, --append-every 1")):
        row(f"{key}_bytes_sent_per_byte", f"bytes uploaded per byte appended ({APPEND_BASE >> 20} "
            f"MiB log, {how})", "x", "~1")
        row(f"{key}_bytes_sent_per_byte_with_manifests", f"the same, with the manifests ({how})",
            "x", "-")
    rows.append(("daemon RSS, peak during the runs (stored data lives in tmpfs files)",
                 f"{data['daemon_rss_peak_kib'] / 1024:.0f} MiB", "< 300 MiB"))
    return rows


def _chart(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = list(data["results"])
    targets = data["targets"]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        speeds = [data["bytes"] / statistics.median(data["results"][w][target]) / 2**30
                  if data["results"][w].get(target) else 0 for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], speeds, width, label=target)
    ax.set_xticks([x + (len(targets) - 1) / 2 * width for x in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"tierfs vs tmpfs, disk and direct S3: {data['bytes'] / 2**30:.2f} GiB checkpoint")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2G", help="checkpoint size (default 2G)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--out", default="bench/results", help="where results go")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy (if installed) on the daemon during the single-node runs, "
                             "and on the daemons of the replication and of a peer restore")
    parser.add_argument("--cluster-only", action="store_true",
                        help="only the cluster measurements (replication, restores)")
    parser.add_argument("--restores-only", action="store_true",
                        help="of the cluster measurements, the floors, the first pair's "
                             "replication and the restores into fresh nodes only")
    parser.add_argument("--many-files-only", action="store_true",
                        help=f"only the {MANY_FILES:,}-file step (save, ls -l, read back)")
    parser.add_argument("--ranged-only", action="store_true",
                        help="only the ranged read-back from a peer (first byte, one tensor)")
    parser.add_argument("--appends-only", action="store_true",
                        help="only the appended log (bytes uploaded per byte appended)")
    parser.add_argument("--torch-only", action="store_true",
                        help="only the torch.save and torch.load rows")
    parser.add_argument("--uniform-only", action="store_true",
                        help=f"only the row {UNIFORM_SAVE!r}")
    parser.add_argument("--persist-only", action="store_true",
                        help="only tierfs and direct S3, and of their rows those the full "
                             "run has up to committed -> persisted (the 16-file save, the "
                             "1- and 4-thread saves and their loads): the uploads of the "
                             "steps before it are as in the full run")
    parser.add_argument("--distant-only", action="store_true",
                        help=f"only the row of a step of {DISTANT_FILES:,} small files "
                             f"uploaded to a store {DISTANT_DELAY * 1000:.0f} ms away, against "
                             "boto3 putting them directly")
    parser.add_argument("--beside-previous", action="store_true",
                        help=f"with --uniform-only: save a previous step just before each "
                             f"{UNIFORM_SAVE!r}, whose hashes and upload run beside it, as "
                             "in the full run")
    parser.add_argument("--compare", action="store_true",
                        help=f"also run a mount with --no-passthrough (column {DAEMON_PATH!r})")
    args = parser.parse_args()
    args.cluster_only = args.cluster_only or args.restores_only
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(report(run(args), out))


if __name__ == "__main__":
    main()
