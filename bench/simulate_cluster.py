"""Discrete-event simulation of one checkpoint of a large tierfs cluster, of a node lost, of a
DDP restart and of S3 request limits.

It drives the real cluster logic, not a copy of it:

- who sends what where: `tierfs.replication.coordination.placement` (`ring`,
  `replica_targets`, `restore_plan`);
- every etcd request: the real client code (`tierfs.replication.coordination.etcd.Etcd`:
  `put_all`'s chunking into transactions of MAX_TXN_OPS, `get_prefix`'s pages of PAGE_SIZE,
  compare-version transactions) called by the real callers (`CommitRecords.record_files`,
  `add_holder`, `ClusterCommits.collect` / `publish`, and what each node does when the commit's
  watch event reaches it, `ClusterCommits._manifest`: read the step's file records (`--follow
  records`, before) or fetch the manifest from the committer (`peer`, now: a flow of the
  network model carrying the real encoding), against `TraceEtcd`, an in-memory key-value store
  behind `Etcd._call` that records each request (path, keys, value bytes) instead of sending
  it. Value sizes are the real `FileRecord` / `CommitRecord` encodings of real manifest entries
  (reported as the MB etcd moved; the time model counts keys).

What is modelled (all parameters are command-line options, defaults in `Params`):

- etcd: one FIFO server; a request costs 1/etcd_rps plus etcd_key_us per key it reads or
  writes beyond the first; writes answer etcd_write_ms later (raft + fsync, pipelined: it does
  not occupy the server); each watch event delivered costs watch_event_us of server time.
  Every node keeps its lease alive every ttl/3 s throughout.
- network: each node's NIC is full duplex at link_gbps each way, shared fairly among its
  concurrent flows (a flow gets min(sender's up / its flows out, receiver's down / its flows
  in)); one kept-alive connection per (sender, receiver) carries that pair's files in turn.
  A node's daemon moves peer bytes at node_gbps each way at most (its data plane: the CPU it
  spends per byte sent and received, `--node-rates`; 0: it keeps up with the link).
  Receivers verify each file (xxh3) at verify_gbps before it counts.
- S3: uploads start at the commit; the store holds the step after
  max(total / s3_gbps, per node / min(link, s3_node_gbps)) (a fluid bound, not flows).

Two more parts (`--parts`): a data-parallel restart, every node loading the file one node
wrote, with the chunk sources chosen by the real `tierfs.replication.peers.sources` (`ddp_restore`);
and S3's request limits per prefix (GET and PUT rates, 503 SlowDown, the real retry policy's
pause) for the checkpoint's upload and a whole cluster's restore (`s3_transfer`).

Run: `make simulate` (or `python bench/simulate_cluster.py --help`).
"""

from __future__ import annotations

import argparse
import base64
import bisect
import heapq
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierfs import manifest as mf  # noqa: E402
from tierfs.replication.coordination import placement  # noqa: E402
from tierfs.replication.coordination.cluster_commit import ClusterCommits  # noqa: E402
from tierfs.replication.coordination.commit_records import CommitRecord, CommitRecords, FileRecord  # noqa: E402
from tierfs.replication.coordination.etcd import Etcd, parse_cluster_url  # noqa: E402
from tierfs.replication.peers import peer_manifest, sources  # noqa: E402
from tierfs.retry import POLICY as retry_policy  # noqa: E402
from tierfs.s3tier import s3_backend  # noqa: E402

GB = 1e9
STEP = "run/step_1000"
MANIFEST_FILE = "(manifest)"  # the manifest's transfer, as a file of the network model
KEEPALIVE_SLOTS = 100


@dataclass(frozen=True)
class Params:
    nodes: int = 2000
    ranks: int = 8  # ranks (GPUs) per node, one DCP shard file each
    params_b: float = 70.0  # model parameters, billions
    # bf16 weights (2) + fp32 master weights (4) + fp32 Adam m and v (8): 14 bytes a parameter
    bytes_per_param: float = 14.0
    metadata_mb: float = 8.0  # the step's .metadata, written by rank 0's node
    link_gbps: float = 100.0
    # the peer data plane's rate one daemon sustains each way, Gb/s (0: the link's)
    node_gbps: float = 0.0
    replicas: int = 1  # K: copies on other nodes
    etcd_rps: float = 15_000.0  # one-key requests a second
    etcd_key_us: float = 2.0  # each further key read or written by a request
    etcd_write_ms: float = 2.0  # raft commit + fsync before a write answers
    watch_event_us: float = 2.0  # server time per watch event delivered
    rtt_ms: float = 0.2  # node <-> etcd round trip
    ttl: float = 3.0  # lease ttl; keepalive every ttl/3
    seal_spread_s: float = 0.5  # ranks close their shards within this before .metadata
    verify_gbps: float = 80.0  # xxh3-128 at the receiver (~10 GB/s)
    s3_gbps: float = 400.0  # S3 aggregate throughput
    s3_node_gbps: float = 50.0  # S3 throughput one node reaches (many parallel streams)
    holder_updates: str = "cas"  # cas: add_holder per copy; batch: put_all per receiver
    # records: each node reads the step's records on the commit event; peer: it fetches the
    # manifest from the committer (today's code); event: the commit event alone (a bound)
    follow: str = "records"
    # failure domains: the nodes in this many racks of consecutive ids (0: none); placement
    # `domains` spreads copies over them (--failure-domain), `ring` ignores them (before)
    racks: int = 0
    placement: str = "domains"
    seed: int = 1

    @property
    def total_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def shard_bytes(self) -> int:
        return int(self.total_bytes / (self.nodes * self.ranks))

    @property
    def link_bytes(self) -> float:
        return self.link_gbps * GB / 8

    @property
    def peer_bytes(self) -> float:
        """Bytes a second a node moves to or from its peers, each way: its link's, or less if
        its daemon's data plane cannot keep up (`node_gbps`)."""
        if self.node_gbps <= 0:
            return self.link_bytes
        return min(self.link_bytes, self.node_gbps * GB / 8)


# The peer data plane as bench/run.py measured it on this project's machine (2 cores shared by
# both daemons, the saver and the S3 server; doc/BENCHMARKS.md, "The peer data plane"): committed
# -> replicated of a 1 GiB step, and the daemons' CPU-seconds per GiB copied (the sender's and
# the receiver's, from the save's return to the verified copy).
MEASURED_GBPS = 7.4  # 0.93 GB/s x 8: the copy's rate here, Gb/s
MEASURED_CPU_PER_GIB = 1.83  # sender 0.61 + receiver 1.22 CPU-seconds per GiB
DAEMON_CORES = 8  # cores a training node's daemon may use for the data plane (projection)


def projected_gbps(cpu_per_gib: float, cores: int) -> float:
    """Gb/s each way a daemon with `cores` moves, sending and receiving at once as every node
    does in a checkpoint: a GiB out and a GiB in cost `cpu_per_gib` CPU-seconds."""
    return cores / cpu_per_gib * 2**30 * 8 / GB


# --- the real etcd client against an in-memory store that records requests ----------------


@dataclass(frozen=True)
class Request:
    path: str
    keys: int  # keys written or read
    size: int  # bytes of the values written or read
    write: bool


@dataclass
class _Kv:
    value: bytes
    version: int
    mod: int
    create: int


class TraceEtcd(Etcd):
    """`Etcd` whose `_call` answers from an in-memory store (the subset of etcd's JSON gateway
    the cluster code uses) and appends each request to `trace`."""

    def __init__(self) -> None:  # no endpoints, no HTTP session: nothing leaves the process
        self.endpoints = ()
        self.timeout = 2.0
        self._preferred = 0
        self._data: dict[bytes, _Kv] = {}
        self._keys: list[bytes] = []  # sorted
        self._revision = 1
        self._lease = 0
        self.trace: list[Request] = []

    async def _watch_once(self, prefix: str, start_revision: int, deliver: Any) -> None:
        """No watch events: every record a node waits for is in before it waits (`collect`
        reads them first, then cancels its watch)."""
        await trio.sleep_forever()

    def take(self) -> list[Request]:
        trace, self.trace = self.trace, []
        return trace

    async def _txns(self, txns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The transactions the real client built, one after the other: `drive` runs no trio
        to send them at once, and the order changes nothing the simulation counts."""
        return [await self._call("kv/txn", txn) for txn in txns]

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        reply, keys, write = self._answer(path, payload)
        size = sum(len(kv.get("value", "")) * 3 // 4 for kv in reply.get("kvs", ())) + sum(
            len(op["request_put"]["value"]) * 3 // 4 for op in payload.get("success", ())
            if "request_put" in op) + len(payload.get("value", "")) * 3 // 4
        self.trace.append(Request(path, keys, size, write))
        return reply

    def _answer(self, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], int, bool]:
        header = {"header": {"revision": str(self._revision)}}
        if path == "kv/range":
            kvs, more = self._range(payload)
            return {**header, "kvs": kvs, "more": more, "count": str(len(kvs))}, len(kvs), False
        if path == "kv/put":
            self._put(payload)
            return header, 1, True
        if path == "kv/txn":
            ok = all(self._compare(c) for c in payload.get("compare", []))
            ops = payload["success"] if ok else payload.get("failure", [])
            for op in ops:
                self._put(op["request_put"])
            return {**header, "succeeded": ok}, max(1, len(ops)), True
        if path == "kv/deleterange":
            key = base64.b64decode(payload["key"])
            deleted = int(self._data.pop(key, None) is not None)
            if deleted:
                self._keys.remove(key)
            return {**header, "deleted": str(deleted)}, 1, True
        if path == "lease/grant":
            self._lease += 1
            return {"ID": str(self._lease), "TTL": str(payload["TTL"])}, 1, True
        if path == "lease/keepalive":
            return {"result": {"ID": str(payload["ID"]), "TTL": "3"}}, 1, False
        raise ValueError(f"TraceEtcd does not model {path}")

    def _put(self, fields: dict[str, Any]) -> None:
        key = base64.b64decode(fields["key"])
        self._revision += 1
        old = self._data.get(key)
        if old is None:
            bisect.insort(self._keys, key)
        self._data[key] = _Kv(base64.b64decode(fields["value"]), old.version + 1 if old else 1,
                              self._revision, old.create if old else self._revision)

    def _compare(self, compare: dict[str, Any]) -> bool:
        kv = self._data.get(base64.b64decode(compare["key"]))
        return (kv.version if kv else 0) == int(compare["version"])

    def _range(self, payload: dict[str, Any]) -> tuple[list[dict[str, str]], bool]:
        start = base64.b64decode(payload["key"])
        if "range_end" not in payload:
            kv = self._data.get(start)
            return ([self._json(start, kv)] if kv else []), False
        end = base64.b64decode(payload["range_end"])
        limit = int(payload.get("limit", 0)) or len(self._keys)
        i = bisect.bisect_left(self._keys, start)
        j = bisect.bisect_left(self._keys, end)
        keys = self._keys[i:min(j, i + limit)]
        return [self._json(k, self._data[k]) for k in keys], j > i + limit

    @staticmethod
    def _json(key: bytes, kv: _Kv) -> dict[str, str]:
        return {"key": base64.b64encode(key).decode(),
                "value": base64.b64encode(kv.value).decode(),
                "version": str(kv.version), "mod_revision": str(kv.mod),
                "create_revision": str(kv.create)}


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never waits on anything but TraceEtcd (no trio primitives)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the traced call waited on something TraceEtcd does not answer")


# --- the discrete-event core ------------------------------------------------------------------


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, action))

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()


class EtcdServer:
    """One FIFO server: requests in arrival order, each for its cost; writes answer after the
    raft commit; watch events take server time as they are sent."""

    def __init__(self, sim: Sim, p: Params) -> None:
        self.sim = sim
        self.p = p
        self.free = float("-inf")  # idle since ever
        self.served: list[float] = []  # when each request finished, for the rates
        self.requests = 0  # requests served other than keepalives
        self.bytes = 0  # their values' bytes

    def submit(self, request: Request, done: Callable[[], None] | None) -> None:
        p = self.p
        arrive = self.sim.now + p.rtt_ms / 2e3
        cost = 1 / p.etcd_rps + (request.keys - 1) * p.etcd_key_us / 1e6
        self.free = max(arrive, self.free) + cost
        self.served.append(self.free)
        if request.path != "lease/keepalive":
            self.requests += 1
            self.bytes += request.size
        if done is not None:  # else nobody waits for the answer
            answer = self.free + (p.etcd_write_ms / 1e3 if request.write else 0) + p.rtt_ms / 2e3
            self.sim.at(answer, done)

    def chain(self, requests: list[Request], done: Callable[[], None]) -> None:
        """Send requests one after another (each after the previous answer), then done()."""
        pending = iter(requests)

        def next_one() -> None:
            request = next(pending, None)
            if request is None:
                done()
            else:
                self.submit(request, next_one)
        next_one()

    def fan_out(self, applied: float, watchers: list[str],
                deliver: Callable[[str], None]) -> None:
        """A change applied at `applied` reaches each watcher in turn."""
        start = max(applied, self.free)
        cost = self.p.watch_event_us / 1e6
        self.free = start + cost * len(watchers)
        for i, node in enumerate(watchers):
            self.sim.at(start + (i + 1) * cost + self.p.rtt_ms / 2e3, lambda n=node: deliver(n))


@dataclass
class _Pair:
    """One kept-alive connection: its files in turn, at the rate the two NICs give it."""

    src: str
    dst: str
    files: list[tuple[str, int]]
    on_file: Callable[[str, str, str], None]
    remaining: float = 0.0
    rate: float = 0.0
    since: float = 0.0
    stamp: int = 0


class Network:
    def __init__(self, sim: Sim, p: Params) -> None:
        self.sim = sim
        self.capacity = p.peer_bytes
        self.out: dict[str, set[int]] = defaultdict(set)
        self.into: dict[str, set[int]] = defaultdict(set)
        self.pairs: dict[int, _Pair] = {}
        self._ids = 0
        self.sent: set[tuple[str, str]] = set()  # (file, receiver): no copy made twice

    def send(self, src: str, dst: str, files: list[tuple[str, int]],
             on_file: Callable[[str, str, str], None]) -> None:
        for name, _ in files:
            if (name, dst) in self.sent:
                raise AssertionError(f"{name} sent to {dst} twice")
            self.sent.add((name, dst))
        self._ids += 1
        pair = _Pair(src, dst, list(reversed(files)), on_file, float(files[0][1]))
        self.pairs[self._ids] = pair
        self.out[src].add(self._ids)
        self.into[dst].add(self._ids)
        self._rerate(src, dst)

    def _rerate(self, src: str, dst: str) -> None:
        for pid in self.out[src] | self.into[dst]:
            self._set_rate(pid)

    def _set_rate(self, pid: int) -> None:
        pair = self.pairs[pid]
        now = self.sim.now
        pair.remaining -= pair.rate * (now - pair.since)
        pair.since = now
        pair.rate = min(self.capacity / len(self.out[pair.src]),
                        self.capacity / len(self.into[pair.dst]))
        pair.stamp += 1
        stamp = pair.stamp
        self.sim.at(now + max(pair.remaining, 0) / pair.rate,
                    lambda: self._file_done(pid, stamp))

    def _file_done(self, pid: int, stamp: int) -> None:
        pair = self.pairs.get(pid)
        if pair is None or pair.stamp != stamp:
            return  # re-rated since: a later event stands for this one
        name, _ = pair.files.pop()
        pair.on_file(name, pair.src, pair.dst)
        if pair.files:
            pair.remaining, pair.rate = float(pair.files[-1][1]), 0.0
            self._set_rate(pid)
            return
        del self.pairs[pid]
        self.out[pair.src].discard(pid)
        self.into[pair.dst].discard(pid)
        self._rerate(pair.src, pair.dst)


# --- the cluster ------------------------------------------------------------------------------


@dataclass
class Result:
    params: Params
    committed: float = 0.0  # .metadata -> its close returns (commit record written)
    visible_all: float = 0.0  # -> every node lists the step committed
    copies_ram: float = 0.0  # -> every file verified on its K replica targets
    copies_recorded: float = 0.0  # -> ... and every holder recorded in etcd
    stored: float = 0.0  # -> the step in S3
    etcd_peak: float = 0.0  # requests/s, the busiest 100 ms
    etcd_mean: float = 0.0  # requests/s, over the checkpoint (first record -> last holder)
    etcd_idle: float = 0.0  # requests/s with nothing happening (keepalives)
    requests: int = 0  # etcd requests the checkpoint made (without keepalives)
    etcd_mb: float = 0.0  # MB of values they wrote or read
    detect: float = 0.0  # a node lost -> survivors see it gone
    restore_peers: float = 0.0  # seen gone -> its files back to K + 1 copies, recorded
    restore_s3: float = 0.0  # seen gone -> a replacement refilled from S3
    restore_bytes: float = 0.0
    holders: dict[str, frozenset[str]] = field(default_factory=dict)  # after the restore
    lost_node: str = ""
    manifest_mb: float = 0.0  # the encoded manifest each node fetches (follow=peer)


class Cluster:
    def __init__(self, p: Params) -> None:
        self.p = p
        self.rng = random.Random(p.seed)
        self.sim = Sim()
        self.etcd = EtcdServer(self.sim, p)
        self.net = Network(self.sim, p)
        self.store = TraceEtcd()
        self.url = parse_cluster_url("etcd://sim:2379/tierfs/sim")
        self.records = CommitRecords(self.store, self.url)
        self.nodes = [f"n{i:05d}" for i in range(p.nodes)]
        # rack r holds the nodes r * N / racks .. (r + 1) * N / racks - 1
        self.racks = {node: f"rack{i * p.racks // p.nodes:03d}"
                      for i, node in enumerate(self.nodes)} if p.racks else {}
        self.domains = self.racks if p.placement == "domains" else {}
        self.ring = placement.ring(self.nodes, self.domains)
        self.files = self._files()  # name -> (writer, entry)
        self.by_node: dict[str, list[str]] = defaultdict(list)
        for name, (writer, _) in self.files.items():
            self.by_node[writer].append(name)
        self.committer = self.nodes[0]
        self.targets = {node: placement.replica_targets(self.ring, node, p.replicas,
                                                        self.domains)
                        for node in self.by_node}
        self.quiet = False  # keepalives stop once everything is done
        self.result = Result(p)

    def _files(self) -> dict[str, tuple[str, mf.FileEntry]]:
        p = self.p
        files = {}
        for rank in range(p.nodes * p.ranks):
            name = f"__{rank}_0.distcp"
            files[name] = (self.nodes[rank // p.ranks], self._entry(name, p.shard_bytes))
        files[".metadata"] = (self.nodes[0], self._entry(".metadata", int(p.metadata_mb * 1e6)))
        return files

    def _entry(self, name: str, size: int) -> mf.FileEntry:
        chunks = tuple(f"{self.rng.getrandbits(64):016x}" for _ in range(mf.chunk_count(size)))
        return mf.FileEntry(name, size, f"{self.rng.getrandbits(128):032x}",
                            1_700_000_000_000_000_000, 0o644, chunks, 1000, 1000)

    def sealed_record(self, name: str) -> FileRecord:
        """The record a writer makes of a file it sealed (as ClusterCommits does)."""
        writer, entry = self.files[name]
        return FileRecord.sealed(writer, entry.size, entry.xxh3, tuple(mf.entry_fields(entry)))

    def _size(self, name: str) -> int:
        return self.files[name][1].size

    # -- keepalives: every node, every ttl/3, all along

    def start_keepalives(self) -> None:
        """Each node's keepalive every ttl/3, the nodes spread evenly over that period (in
        KEEPALIVE_SLOTS slots, each one event: 2,000 timers would be most of the events)."""
        (request,) = self.traced(self.store.keepalive(1))
        period = self.p.ttl / 3
        for slot in range(KEEPALIVE_SLOTS):
            count = len(range(slot, len(self.nodes), KEEPALIVE_SLOTS))
            self.sim.at(self.sim.now + slot * period / KEEPALIVE_SLOTS,
                        lambda c=count: self._keepalives(request, c, period))

    def _keepalives(self, request: Request, count: int, period: float) -> None:
        if self.quiet:
            return
        for _ in range(count):
            self.etcd.submit(request, None)
        self.sim.at(self.sim.now + period, lambda: self._keepalives(request, count, period))

    def traced(self, coro: Coroutine[Any, Any, Any]) -> list[Request]:
        self.store.take()
        drive(coro)
        return self.store.take()

    # -- the checkpoint

    def checkpoint(self) -> None:
        p = self.p
        self.recorded = 0
        self.writers = [n for n in self.nodes if self.by_node[n]]
        sealed = {node: self.traced(self.records.record_files(STEP, {
            name: self.sealed_record(name) for name in self.by_node[node]
            if name != ".metadata"})) for node in self.writers}
        for trace in sealed.values():
            self.sim.at(self.rng.uniform(-p.seal_spread_s, 0),
                        lambda t=trace: self.etcd.chain(t, self._one_recorded))
        self.sim.at(0.0, self._metadata)

    def _one_recorded(self) -> None:
        self.recorded += 1
        if self.recorded == len(self.writers):
            self.all_recorded = self.sim.now

    def _metadata(self) -> None:
        """.metadata reaches the committer: collect the other nodes' records, commit locally,
        publish (its own records, stale ones dropped, the commit record), then close returns."""
        names = set(self.files)
        commits = ClusterCommits(self.records, self.committer, lambda _: 1000)
        # no deadline: every record is in by now (after_collect waits for the last one)
        collect = self._trace_trio(commits.collect, STEP, names - {".metadata"}, math.inf)
        manifest = mf.StepManifest(STEP, 1000, 1, self.committer, 1,
                                   tuple(self.files[n][1] for n in sorted(names)))
        publish = self._trace_trio(commits.publish, manifest, {".metadata"})
        if self.p.follow == "records":  # what follow() reads on each commit event
            self.manifest_read = self.traced(commits._manifest(
                CommitRecord(STEP, self.committer, len(names), 0.0, 1, 1,
                             digest=manifest.content_digest)))
        elif self.p.follow == "peer":  # the manifest from the committer, in chunks
            self._peer_follow(manifest)

        def after_collect() -> None:
            # collect watches until every record is in: wait for the last one if need be
            if self.recorded < len(self.writers):
                self.sim.at(self.sim.now + 0.01, after_collect)
                return
            self.etcd.chain(publish, self._committed)
        self.etcd.chain(collect, after_collect)

    def _peer_follow(self, manifest: mf.StepManifest) -> None:
        """What follow() does on the commit event now: the real `_manifest` of the commit
        record publish writes (naming the holders), its peer fetch answered with the
        manifest; every etcd request it makes is traced (none, as a rule). The manifest's
        real encoding is what each node then fetches from the committer over the network."""
        record = CommitRecord(STEP, self.committer, len(manifest.files), 0.0, 1, 1,
                              tuple(sorted(self.writers)))

        async def fetch(_node: str, _path: str, _version: int) -> mf.StepManifest:
            return manifest
        follower = ClusterCommits(self.records, "follower", lambda _: 1000, fetch)
        self.manifest_read = self.traced(follower._manifest(record))
        self.manifest_bytes = len(mf.encode(manifest))
        self.result.manifest_mb = self.manifest_bytes / 1e6

    def _trace_trio(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any
                    ) -> list[Request]:
        self.store.take()
        trio.run(fn, *args)
        return self.store.take()

    def _committed(self) -> None:
        r = self.result
        r.committed = self.sim.now
        self.visible: set[str] = set()
        self._visible(self.committer)
        self.etcd.fan_out(self.sim.now, self.nodes, self._commit_event)
        self.stored_at = self.sim.now + self._store_time()

    def _store_time(self) -> float:
        p = self.p
        per_node = max(len(v) for v in self.by_node.values()) * p.shard_bytes
        return max(p.total_bytes / (p.s3_gbps * GB / 8),
                   per_node / (min(p.link_gbps, p.s3_node_gbps) * GB / 8))

    def _commit_event(self, node: str) -> None:
        """Every node follows commits/, the committer too (it reads, but knows already)."""
        seen = (lambda: None) if node == self.committer else (lambda: self._visible(node))
        if self.p.follow == "records":
            self.etcd.chain(self.manifest_read, seen)
        elif self.p.follow == "peer" and node != self.committer:
            # the etcd requests (none) and the manifest over the committer's uplink, shared
            # with its replication flows; one round trip per MANIFEST_PART
            parts = -(-self.manifest_bytes // peer_manifest.CHUNK)
            latency = parts * self.p.rtt_ms / 1e3

            def fetched(_name: str, _src: str, _dst: str) -> None:
                self.sim.at(self.sim.now + latency, seen)
            self.etcd.chain(self.manifest_read, lambda: self.net.send(
                self.committer, node, [(MANIFEST_FILE, self.manifest_bytes)], fetched))
        else:
            seen()

    def _visible(self, node: str) -> None:
        self.visible.add(node)
        if len(self.visible) == len(self.nodes):
            self.result.visible_all = self.sim.now
        self._replicate(node)

    # -- replication: each writer to its K replica targets

    def _replicate(self, node: str) -> None:
        if not self.by_node.get(node):
            return  # wrote nothing of this step
        files = [(n, self._size(n)) for n in sorted(self.by_node[node])]
        for target in self.targets[node]:
            self.net.send(node, target, files, self._arrived)

    def _arrived(self, name: str, src: str, dst: str) -> None:
        verify = self._size(name) / (self.p.verify_gbps * GB / 8)
        self.sim.at(self.sim.now + verify, lambda: self._verified(name, src, dst))

    def _verified(self, name: str, src: str, dst: str) -> None:
        self.in_ram += 1
        if self.in_ram == self.pending_copies_total:
            self.phase_ram = self.sim.now
        if self.p.holder_updates == "cas":
            trace = self.traced(self.records.add_holder(STEP, name, dst))
            self.etcd.chain(trace, self._holder_recorded)
            return
        batch = self.batches[(src, dst)]
        batch.append(name)
        if len(batch) == self.batch_size[(src, dst)]:
            self.etcd.chain(self._batch_trace(batch, dst), self._holders_recorded(len(batch)))

    def _batch_trace(self, names: list[str], node: str) -> list[Request]:
        """The batched holder update: the files' records with `node` added, in put_all's
        transactions (what per-receiver batching sends)."""
        updated = []
        for name in names:  # read here, not sent: the receiver knows the records already
            key = self.records.file_key(STEP, name)
            kv = drive(self.store.get(key))
            record = FileRecord.decode(kv.value)
            updated.append((key, replace(record, holders=tuple(sorted({*record.holders, node})))
                            .encode()))
        return self.traced(self.store.put_all(updated))

    def _holders_recorded(self, count: int) -> Callable[[], None]:
        def done() -> None:
            for _ in range(count):
                self._holder_recorded()
        return done

    def _holder_recorded(self) -> None:
        self.holders_done += 1
        if self.holders_done == self.pending_copies_total:
            self.phase_recorded = self.sim.now
            self.quiet = True

    def run_checkpoint(self) -> Result:
        p = self.p
        self.pending_copies_total = sum(len(self.by_node[n]) * len(self.targets[n])
                                        for n in self.writers_all())
        self.in_ram = self.holders_done = 0
        self.phase_ram = self.phase_recorded = 0.0
        self.batches: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.batch_size = {(n, t): len(self.by_node[n]) for n in self.writers_all()
                           for t in self.targets[n]}
        self.sim.now = -p.seal_spread_s  # the ranks start closing their shards
        self.start_keepalives()
        self.checkpoint()
        self.sim.run()
        r = self.result
        r.copies_ram, r.copies_recorded = self.phase_ram, self.phase_recorded
        r.stored = self.stored_at
        r.requests = self.etcd.requests
        r.etcd_mb = self.etcd.bytes / 1e6
        r.etcd_peak, r.etcd_mean = self._rates(self.etcd.served, -p.seal_spread_s,
                                               r.copies_recorded)
        r.etcd_idle = len(self.nodes) / (p.ttl / 3)
        return r

    def writers_all(self) -> list[str]:
        return [n for n in self.nodes if self.by_node[n]]

    @staticmethod
    def _rates(served: list[float], start: float, end: float) -> tuple[float, float]:
        bins: dict[int, int] = defaultdict(int)
        for t in served:
            if start <= t <= end:
                bins[int((t - start) / 0.1)] += 1
        total = sum(bins.values())
        return max(bins.values(), default=0) * 10, total / max(end - start, 1e-9)

    # -- a node lost after the checkpoint

    def lose(self, victim: str) -> Result:
        """`victim` dies: its lease ends, every survivor sees it gone, each sends its part of
        the same restore_plan; done when every copy is verified and recorded."""
        p, r = self.p, self.result
        r.lost_node = victim
        held = drive(self.records.files(STEP))
        survivors = [n for n in self.nodes if n != victim]
        live = placement.ring(survivors, self.domains)
        plan = placement.restore_plan(
            {name: placement.Placement(rec.node, frozenset(rec.holders))
             for name, rec in held.items()}, live, p.replicas,
            {n: d for n, d in self.domains.items() if n != victim})
        if plan.lost:
            raise AssertionError(f"files with no live holder: {plan.lost[:3]}")
        self.sim = Sim()
        self.etcd = EtcdServer(self.sim, p)
        self.net = Network(self.sim, p)
        self.quiet = True
        r.detect = p.ttl + p.watch_event_us / 1e6 * len(live) + p.rtt_ms / 1e3
        self.sim.now = 0.0
        self.restoring = len(plan.copies)
        by_pair: dict[tuple[str, str], list[tuple[str, int]]] = defaultdict(list)
        for copy in plan.copies:
            by_pair[(copy.source, copy.target)].append((copy.file, self._size(copy.file)))
        r.restore_bytes = sum(self._size(c.file) for c in plan.copies)
        self.restored_at = 0.0
        for (src, dst), files in sorted(by_pair.items()):
            self.net.send(src, dst, files, self._restored_file)
        self.sim.run()
        r.restore_peers = self.restored_at
        lost_bytes = sum(self._size(n) for n, rec in held.items() if victim in rec.holders)
        r.restore_s3 = lost_bytes / (min(p.link_gbps, p.s3_node_gbps) * GB / 8)
        survivors = frozenset(live)
        r.holders = {n: frozenset(rec.holders) & survivors
                     for n, rec in drive(self.records.files(STEP)).items()}
        return r

    def lose_rack(self, rack: str) -> RackResult:
        """Every node of `rack` lost at once (its switch, its power) after the checkpoint:
        which files lost every copy, and how long the survivors take to bring the others
        back to K + 1 copies (their part of the same restore_plan, as for one node)."""
        p = self.p
        held = drive(self.records.files(STEP))
        gone = {n for n, r in self.racks.items() if r == rack}
        survivors = [n for n in self.nodes if n not in gone]
        domains = {n: d for n, d in self.domains.items() if n not in gone}
        plan = placement.restore_plan(
            {name: placement.Placement(rec.node, frozenset(rec.holders))
             for name, rec in held.items()}, placement.ring(survivors, domains), p.replicas,
            domains)
        self.sim = Sim()
        self.etcd = EtcdServer(self.sim, p)
        self.net = Network(self.sim, p)
        self.quiet = True
        self.restoring = len(plan.copies)
        self.restored_at = 0.0
        by_pair: dict[tuple[str, str], list[tuple[str, int]]] = defaultdict(list)
        for copy in plan.copies:
            by_pair[(copy.source, copy.target)].append((copy.file, self._size(copy.file)))
        for (src, dst), files in sorted(by_pair.items()):
            self.net.send(src, dst, files, self._restored_file)
        self.sim.run()
        return RackResult(p, len(gone), len(plan.lost),
                          sum(self._size(n) for n in plan.lost),
                          sum(self._size(c.file) for c in plan.copies),
                          self.restored_at if plan.copies else 0.0,
                          min((len({self.racks[h] for h in rec.holders})
                               for rec in held.values()), default=0))

    def _restored_file(self, name: str, src: str, dst: str) -> None:
        verify = self._size(name) / (self.p.verify_gbps * GB / 8)

        def verified() -> None:
            trace = self.traced(self.records.add_holder(STEP, name, dst))

            def recorded() -> None:
                self.restoring -= 1
                if not self.restoring:
                    self.restored_at = self.sim.now
            self.etcd.chain(trace, recorded)
        self.sim.at(self.sim.now + verify, verified)


@dataclass(frozen=True)
class RackResult:
    """A whole rack (failure domain) lost after a checkpoint."""

    params: Params
    nodes_lost: int
    files_lost: int  # files with no copy left outside the rack
    bytes_lost: int
    restore_bytes: int  # copies the survivors make to get back to K + 1
    restore_peers: float  # seconds for them (from the loss seen)
    min_racks: int  # the fewest racks any file's copies were in before the loss


def rack_loss(p: Params) -> RackResult:
    """One checkpoint, then the rack in the middle of the node ids lost."""
    cluster = Cluster(p)
    cluster.run_checkpoint()
    return cluster.lose_rack(cluster.racks[cluster.nodes[len(cluster.nodes) // 2]])


def simulate(p: Params) -> Result:
    cluster = Cluster(p)
    cluster.run_checkpoint()
    return cluster.lose(cluster.nodes[len(cluster.nodes) // 2])


# --- one writer, many readers: a data-parallel restart --------------------------------------


@dataclass(frozen=True)
class DdpResult:
    """Every node loads the file rank 0's node wrote (K copies on peers): how long until the
    last node has it, against one node alone at the same link speed."""

    nodes: int
    ranks: int
    link_gbps: float
    node_gbps: float
    file_gb: float
    swarm: bool
    seconds: float
    one_node: float
    holder_sent: float  # the busiest holder's uplink, in files
    relay_sent: float  # the busiest reader's uplink, in files
    depth: int  # the longest chain of relays a chunk went through


def ddp_restore(p: Params, file_gb: float, swarm: bool, sample_chunks: int = 256
                ) -> DdpResult:
    """Node 0 wrote a `file_gb` file (one DDP checkpoint, rank 0's); its K replica targets
    (`placement.replica_targets`) hold it too; every other node reads it at once. The ranks of
    a node share one fetch, so a node is one reader whatever `p.ranks`. Each chunk request goes
    to the holder `sources.holder_order` names; with `swarm` the holder's real
    `sources.ChunkRoutes` sends it to an earlier reader instead (today: the holder serves it).
    Readers reach each chunk in a random order (a new one per chunk). Only `sample_chunks` of
    the file's chunks are routed (the rest behave alike), and the bytes scaled up.

    Time is a fluid bound: the busiest NIC direction (full duplex at `link_gbps`) over the
    whole transfer, plus the deepest relay chain's store-and-forward of one chunk per hop."""
    rng = random.Random(p.seed)
    nodes = [f"n{i:05d}" for i in range(p.nodes)]
    writer = nodes[0]
    holders = [writer, *placement.replica_targets(placement.ring(nodes), writer, p.replicas)]
    readers = [n for n in nodes if n not in holders]
    size = int(file_gb * GB)
    chunks = mf.chunk_count(size)
    routed = min(chunks, sample_chunks)
    xxh3 = f"{rng.getrandbits(128):032x}"
    books = {h: sources.ChunkRoutes(h) for h in holders}
    sent: dict[str, int] = defaultdict(int)
    depth = 1
    for chunk in range(routed):
        order = readers[:]
        rng.shuffle(order)
        holder = sources.holder_order(holders, xxh3, chunk * mf.CHUNK_SIZE)[0]
        for reader in order:
            source = books[holder].route(reader, chunk) if swarm else holder
            sent[source] += 1
        if swarm:
            depth = max(depth, max(books[holder]._chunks[chunk].depth.values(), default=1))
    scale = chunks / routed * mf.CHUNK_SIZE  # bytes per routed chunk
    link = p.peer_bytes
    busiest = max(max(sent.values()) * scale, size)  # a reader receives the file once
    one_node = size / link
    return DdpResult(p.nodes, p.ranks, p.link_gbps, p.node_gbps, file_gb, swarm,
                     busiest / link + depth * mf.CHUNK_SIZE / link, one_node,
                     max(sent[h] for h in holders) * scale / size,
                     max((sent[r] for r in readers), default=0) * scale / size,
                     depth if swarm else 1)


DDP_COLUMNS = [("sources", 16), ("link Gb/s", 9), ("node Gb/s", 9), ("file GB", 7),
               ("every rank has it", 17), ("one node", 8), ("ratio", 7), ("writer sends", 12),
               ("a reader sends", 14), ("relay depth", 11)]


def ddp_row(r: DdpResult) -> str:
    cells = ["swarm (now)" if r.swarm else "holders (before)", f"{r.link_gbps:g}",
             "link" if r.node_gbps <= 0 else f"{r.node_gbps:.0f}", f"{r.file_gb:g}",
             f"{r.seconds:,.1f} s", f"{r.one_node:.2f} s",
             f"{r.seconds / r.one_node:,.2f}", f"{r.holder_sent:,.2f} x",
             f"{r.relay_sent:.2f} x", str(r.depth)]
    return " | ".join(c.rjust(w) for c, (_, w) in zip(cells, DDP_COLUMNS, strict=True))


# --- S3 request limits ------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Limits:
    """S3's documented request rates per partitioned prefix (a step's objects share one
    prefix until S3 splits it, which takes minutes): past them it answers 503 SlowDown."""

    get_rps: float = 5500.0
    put_rps: float = 3500.0
    burst_s: float = 0.1  # a prefix's rate is enforced over windows this long
    latency_ms: float = 30.0  # a request's first byte (and a SlowDown's answer)
    streams: int = 8  # requests a node has in flight


@dataclass(frozen=True)
class S3Result:
    what: str
    requests: int  # accepted requests
    slowdowns: int  # 503 SlowDown answers
    seconds: float


def s3_transfer(what: str, per_node: list[list[int]], rps: float, p: Params,
                limits: S3Limits, seed: int = 1) -> S3Result:
    """Each node sends its requests (sizes in bytes: a PUT's or a GET's payload; 0 for a
    multipart create/complete) `limits.streams` at a time to one prefix that accepts `rps`
    (token bucket, `burst_s` deep); a refused request pays a round trip, then the daemons'
    one retry policy's pause (`tierfs.retry.POLICY`, jittered exponential) before it is sent
    again. A request's bytes move at the node's S3 share (min(link, s3_node_gbps) over its
    streams); the whole transfer takes at least the bytes over `s3_gbps` aggregate."""
    random.seed(seed)  # POLICY.delay's jitter
    sim = Sim()
    stream_rate = min(p.link_gbps, p.s3_node_gbps) * GB / 8 / limits.streams
    latency = limits.latency_ms / 1e3
    tokens, stamp = rps * limits.burst_s, 0.0
    counts = {"ok": 0, "slow": 0}
    done_at = 0.0

    def admit() -> bool:
        nonlocal tokens, stamp
        tokens = min(rps * limits.burst_s, tokens + (sim.now - stamp) * rps)
        stamp = sim.now
        if tokens >= 1:
            tokens -= 1
            return True
        return False

    def start(queue: list[int], attempt: int) -> None:
        nonlocal done_at
        if not queue:
            done_at = max(done_at, sim.now)
            return
        if admit():
            counts["ok"] += 1
            size = queue.pop()
            sim.at(sim.now + latency + size / stream_rate, lambda: start(queue, 0))
        else:
            counts["slow"] += 1
            sim.at(sim.now + latency + retry_policy.delay(attempt + 1),
                   lambda: start(queue, attempt + 1))

    total = 0
    for requests in per_node:
        total += sum(requests)
        lanes: list[list[int]] = [requests[i::limits.streams] for i in range(limits.streams)]
        for lane in lanes:
            sim.at(0.0, lambda q=lane: start(q, 0))
    sim.run()
    return S3Result(what, counts["ok"], counts["slow"],
                    max(done_at, total / (p.s3_gbps * GB / 8)))


def put_requests(size: int, part_size: int) -> list[int]:
    """The requests that upload one object: one PUT if it fits a part, else create, the
    parts and complete (as `s3tier.sending` does)."""
    if size <= part_size:
        return [size]
    return [0] + [min(part_size, size - o) for o in range(0, size, part_size)] + [0]


def get_requests(size: int, range_size: int) -> list[int]:
    return [min(range_size, size - o) for o in range(0, size, range_size)]


def s3_table(p: Params, limits: S3Limits, ddp_gb: float) -> list[S3Result]:
    """The 70B checkpoint's upload and a whole cluster's restore from S3 under the limits,
    with today's sizes and larger ones; and a DDP restore read from S3 by every node (a
    bound: its requests over the GET rate)."""
    shard = p.shard_bytes
    per_node = p.ranks
    results = []
    for part in (s3_backend.PART_SIZE, 64 << 20):
        results.append(s3_transfer(
            f"upload: {p.nodes * p.ranks:,} shards, parts of {part >> 20} MiB",
            [put_requests(shard, part) * per_node for _ in range(p.nodes)],
            limits.put_rps, p, limits))
    for ranged in (mf.CHUNK_SIZE, 64 << 20):
        results.append(s3_transfer(
            f"restore: every node its shards, GETs of {ranged >> 20} MiB",
            [get_requests(shard, ranged) * per_node for _ in range(p.nodes)],
            limits.get_rps, p, limits))
    gets = p.nodes * mf.chunk_count(int(ddp_gb * GB))
    results.append(S3Result(f"DDP: every node reads {ddp_gb:g} GB in 8 MiB GETs (bound)",
                            gets, 0, gets / limits.get_rps))
    return results


# --- the command line -------------------------------------------------------------------------

COLUMNS = [("link Gb/s", 9), ("node Gb/s", 9), ("K", 2), ("holders", 7), ("follow", 7),
           ("committed", 9),
           ("visible all", 11), ("K copies RAM", 12), ("K recorded", 10), ("in S3", 6),
           ("etcd req/s peak", 15), ("mean", 6), ("idle", 5), ("requests", 8), ("MB", 6),
           ("restore peers", 13), ("from S3", 7)]


def row(r: Result) -> str:
    p = r.params
    cells = [f"{p.link_gbps:g}", _node_rate(p), str(p.replicas), p.holder_updates, p.follow,
             f"{r.committed:.2f}", f"{r.visible_all:.2f}", f"{r.copies_ram:.2f}",
             f"{r.copies_recorded:.2f}", f"{r.stored:.1f}", f"{r.etcd_peak:,.0f}",
             f"{r.etcd_mean:,.0f}", f"{r.etcd_idle:,.0f}", f"{r.requests:,}",
             f"{r.etcd_mb:,.0f}",
             f"{r.restore_peers:.2f}", f"{r.restore_s3:.2f}"]
    return " | ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS, strict=True))


def _node_rate(p: Params) -> str:
    return "link" if p.node_gbps <= 0 else f"{p.node_gbps:.0f}"


def header() -> str:
    return " | ".join(name.rjust(w) for name, w in COLUMNS)


def main(argv: list[str] | None = None) -> None:
    defaults = Params()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--links", default="100,400", help="link speeds to run, Gb/s")
    parser.add_argument("--node-rates", default=None,
                        help="per-node data-plane rates to run, Gb/s each way (0: the link's); "
                        "default: 0 and the rate projected from --measured-cpu-per-gib at "
                        "--daemon-cores")
    parser.add_argument("--measured-gbps", type=float, default=MEASURED_GBPS,
                        help="the peer copy's rate bench/run.py measured on this machine, Gb/s")
    parser.add_argument("--measured-cpu-per-gib", type=float, default=MEASURED_CPU_PER_GIB,
                        help="the daemons' CPU-seconds per GiB copied, sender + receiver, as "
                        "bench/run.py measured it")
    parser.add_argument("--daemon-cores", type=int, default=DAEMON_CORES,
                        help="cores a node's daemon gives its data plane, for the projection")
    parser.add_argument("--ks", default="1,2", help="replica counts to run")
    parser.add_argument("--variants", default="cas:records@100:1,batch:peer",
                        help="holder-updates:follow pairs to run (@LINK:K: that one only)")
    parser.add_argument("--parts", default="checkpoint,rack,ddp,s3",
                        help="what to run: checkpoint (and a node lost), rack (a rack of "
                        "--rack-count lost whole), ddp (one writer, every node reads), s3 "
                        "(request limits)")
    parser.add_argument("--rack-count", type=int, default=50,
                        help="racks (failure domains) the nodes are in for --parts rack")
    parser.add_argument("--ddp-gb", type=float, default=20.0,
                        help="the DDP checkpoint every node loads, GB")
    parser.add_argument("--sample-chunks", type=int, default=256,
                        help="chunks of the DDP file routed one by one (the rest scaled)")
    args = vars(parser.parse_args(argv))
    parts = set(args.pop("parts").split(","))
    ddp_gb = args.pop("ddp_gb")
    rack_count = args.pop("rack_count")
    sample = args.pop("sample_chunks")
    links = [float(x) for x in args.pop("links").split(",")]
    ks = [int(x) for x in args.pop("ks").split(",")]
    variants = args.pop("variants").split(",")
    measured, cpu, cores = (args.pop("measured_gbps"), args.pop("measured_cpu_per_gib"),
                            args.pop("daemon_cores"))
    projected = projected_gbps(cpu, cores)
    rates = args.pop("node_rates")
    node_rates = [float(x) for x in rates.split(",")] if rates else [0.0, round(projected)]
    print(f"The peer data plane measured here: {measured:g} Gb/s ({measured / 8:.2f} GB/s) on "
          f"2 cores shared by both daemons, {cpu:g} CPU-seconds per GiB sent and received: "
          f"{projected_gbps(cpu, 1):.1f} Gb/s each way per core, {projected:.0f} Gb/s at "
          f"{cores} cores (node Gb/s below: `link` = a daemon that keeps up with its NIC)\n")
    base = Params(**args)
    if "checkpoint" in parts:
        checkpoints(base, links, ks, variants, node_rates)
    if "rack" in parts:
        racks(base, rack_count, links[0])
    if "ddp" in parts:
        print(f"\nOne writer, many readers: node 0 wrote a {ddp_gb:g} GB DDP checkpoint (K = "
              f"{base.replicas}); all {base.nodes:,} nodes x {base.ranks} ranks load it at once "
              "(a node's ranks share one fetch)")
        print(" | ".join(name.rjust(w) for name, w in DDP_COLUMNS))
        runs = [replace(base, link_gbps=link, node_gbps=rate) for link in links
                for rate in node_rates]
        for p in runs:
            for swarm in (False, True):
                print(ddp_row(ddp_restore(p, ddp_gb, swarm, sample)), flush=True)
    if "s3" in parts:
        limits = S3Limits()
        print(f"\nS3 request limits: {limits.get_rps:,.0f} GET/s and {limits.put_rps:,.0f} "
              f"PUT/s per prefix, 503 SlowDown past them, then the retry policy's pause; "
              f"{limits.streams} requests in flight per node")
        print(f"{'what':>60} | {'requests':>9} | {'SlowDown':>9} | {'seconds':>8}")
        for result in s3_table(base, limits, ddp_gb):
            print(f"{result.what:>60} | {result.requests:>9,} | {result.slowdowns:>9,} | "
                  f"{result.seconds:>8.1f}", flush=True)


def racks(base: Params, count: int, link: float) -> None:
    """The table of a rack lost whole after a checkpoint, K = 1, copies placed on the ring
    alone (before) and across the racks (`--failure-domain`)."""
    print(f"\nA rack lost whole: {base.nodes:,} nodes in {count} racks of consecutive ids, "
          f"K = 1, {link:g} Gb/s; one checkpoint, then the middle rack's nodes all lost")
    print(" | ".join(name.rjust(w) for name, w in RACK_COLUMNS))
    runs = [replace(base, racks=count, replicas=1, link_gbps=link, holder_updates="batch",
                    follow="event", placement=kind) for kind in ("ring", "domains")]
    with ProcessPoolExecutor(min(len(runs), os.cpu_count() or 1)) as pool:
        for r in pool.map(rack_loss, runs):
            cells = [r.params.placement, f"{r.nodes_lost}", f"{r.min_racks}",
                     f"{r.files_lost:,}", f"{r.bytes_lost / 1e9:,.1f}",
                     f"{r.restore_bytes / 1e9:,.1f}", f"{r.restore_peers:.2f}"]
            print(" | ".join(c.rjust(w) for c, (_, w) in zip(cells, RACK_COLUMNS, strict=True)),
                  flush=True)


RACK_COLUMNS = [("placement", 9), ("nodes lost", 10), ("racks per file", 14),
                ("files lost", 10), ("GB lost", 8), ("GB restored", 11),
                ("restore from peers s", 20)]


def checkpoints(base: Params, links: list[float], ks: list[int], variants: list[str],
                node_rates: list[float] = (0.0,)) -> None:  # type: ignore[assignment]
    """The table of one checkpoint and a node lost, one row per variant, link and K."""
    print(f"{base.nodes} nodes x {base.ranks} ranks, {base.params_b:g}B parameters x "
          f"{base.bytes_per_param:g} B = {base.total_bytes / 1e12:.2f} TB in "
          f"{base.nodes * base.ranks:,} shards of {base.shard_bytes / 1e6:.1f} MB; etcd "
          f"{base.etcd_rps:,.0f} req/s + {base.etcd_key_us:g} us/key, writes "
          f"{base.etcd_write_ms:g} ms, watch {base.watch_event_us:g} us/event; S3 "
          f"{base.s3_gbps:g} Gb/s aggregate, {base.s3_node_gbps:g} Gb/s per node; ttl "
          f"{base.ttl:g} s. Times in seconds from .metadata; restores from the loss seen "
          f"(ttl after it).")
    print(header())
    started = time.monotonic()
    runs = []
    for variant in variants:
        kind, _, only = variant.partition("@")
        holders, follow = kind.split(":")
        points = [(float(only.split(":")[0]), int(only.split(":")[1]), 0.0)] if only else [
            (link, k, rate) for link in links for k in ks for rate in node_rates]
        runs += [replace(base, link_gbps=link, node_gbps=rate, replicas=k,
                         holder_updates=holders, follow=follow) for link, k, rate in points]
    manifest_mb = 0.0
    with ProcessPoolExecutor(min(len(runs), os.cpu_count() or 1)) as pool:
        for result in pool.map(simulate, runs):  # in order, each as soon as it and those
            print(row(result), flush=True)       # before it are done
            manifest_mb = max(manifest_mb, result.manifest_mb)
    if manifest_mb:
        print(f"(follow=peer: each node fetches the {manifest_mb:.1f} MB encoded manifest "
              "from the committer)")
    print(f"(simulated in {time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
