"""What operators watch: one log line per step and tier, and the Prometheus metrics.

`Events` is the one observer the workers report to (the namespace for commits, the uploader,
the replicator, the read sources for read-backs (`fs.store.metered`), the FUSE boundary for
refused writes, the verifier's reports); it implements the file system's `EventSink` port
(`fs.model.ports`) and imports nothing of fs: each report writes its event line, as in

    Step run1/step_240: RAM commit in 18 ms (12.4 GB, 3.1 GB/s)
    Step run1/step_240: replicated to node-b in 3.2 s (12.4 GB, 3.9 GB/s)
    Step run1/step_240: persisted to s3://bucket/prefix in 41 s (12.4 GB, 302 MB/s)
    Step run1/step_240: read back from s3://bucket/prefix in 9.8 s (12.4 GB, 1.3 GB/s)

and moves the metrics in its own `CollectorRegistry` (never the process-global one). Levels
(RAM used, what waits for each tier, peers up) are read from the daemon at scrape time by
`LevelsCollector`, in the trio thread, so the HTTP thread never touches the namespace.

Everything here is called from the trio thread and does no I/O but a log line; the HTTP server
(`serve`) runs in its own thread and never blocks trio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierfs import manifest as mf

log = logging.getLogger("tierfs.events")

# Steps range from a few MB (a toy model) to terabytes (a large model's full state).
BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(20, 44, 2)) + (float("inf"),)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                   600, 1800, 3600, float("inf"))
READ_BACK_IDLE = 1.0  # seconds without a read that end one read-back of a step from a tier

TIERS = ("ram", "replica", "persist", "read_back")


def human_size(nbytes: float) -> str:
    """Decimal units, as operators quote disk and network figures: 12.4 GB, 302 MB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            if unit == "B":
                return f"{nbytes:.0f} B"
            return f"{nbytes:.1f} {unit}" if nbytes < 100 else f"{nbytes:.0f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def event_line(step: str, what: str, nbytes: int, seconds: float) -> str:
    """`Step run1/step_240: RAM commit in 18 ms (12.4 GB, 3.1 GB/s)`."""
    rate = human_size(nbytes / max(seconds, 1e-6))
    return f"Step {step}: {what} in {human_seconds(seconds)} ({human_size(nbytes)}, {rate}/s)"


def _label(manifest: mf.StepManifest) -> str:
    """The step's path in the mount (run directory included), and its version if re-saved."""
    return manifest.path if manifest.version == 1 else f"{manifest.path} v{manifest.version}"


@dataclass
class _ReadBack:
    """The reads of one step from one tier, while they keep coming."""

    nbytes: int
    started: float
    ended: float


class Events:
    """The observer: event lines and counters (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.commits = Counter("tierfs_commits", "Steps committed in RAM", registry=registry)
        self.commit_seconds = Histogram("tierfs_commit_seconds", "Latency of a step's commit "
                                        "(seal, hash, manifest)", buckets=SECONDS_BUCKETS,
                                        registry=registry)
        self.step_bytes = Histogram("tierfs_step_bytes", "Bytes of a step moved to or from a "
                                    "tier (ram: committed, replica: sent to one peer, persist: "
                                    "uploaded, read_back: fetched back)", ["tier"],
                                    buckets=BYTES_BUCKETS, registry=registry)
        self.step_seconds = Histogram("tierfs_step_seconds", "Seconds a step took on a tier "
                                      "(same events as tierfs_step_bytes)", ["tier"],
                                      buckets=SECONDS_BUCKETS, registry=registry)
        self.verify_failures = Counter("tierfs_verify_failures", "Copies of files found bad "
                                       "by `tierfs verify` (repaired or not), by tier", ["tier"],
                                       registry=registry)
        self.refused_writes = Counter("tierfs_refused_writes", "Calls answered ENOSPC because "
                                      "the RAM tier was full", registry=registry)
        for tier in TIERS:  # every series exists from the start: rate() needs a first zero
            self.step_bytes.labels(tier)
            self.step_seconds.labels(tier)
        for tier in ("ram", "peer", "persist"):
            self.verify_failures.labels(tier)
        self._read_backs: dict[tuple[str, str], _ReadBack] = {}

    # -- events ------------------------------------------------------------------------------

    def committed(self, manifest: mf.StepManifest, seconds: float) -> None:
        self.commits.inc()
        self.commit_seconds.observe(seconds)
        self._moved("ram", manifest.total_bytes, seconds)
        log.info("%s", event_line(_label(manifest), "RAM commit", manifest.total_bytes,
                                  seconds))

    def replicated(self, manifest: mf.StepManifest, peer: str, sent: int,
                   seconds: float) -> None:
        """This node sent `sent` bytes of the step's files to `peer` (of a multi-node step,
        only the files it was the source of: not the step's size)."""
        self._moved("replica", sent, seconds)
        log.info("%s", event_line(_label(manifest), f"replicated to {peer}", sent, seconds))

    def persisted(self, manifest: mf.StepManifest, url: str, seconds: float) -> None:
        self._moved("persist", manifest.total_bytes, seconds)
        log.info("%s", event_line(_label(manifest), f"persisted to {url}",
                                  manifest.total_bytes, seconds))

    def write_refused(self) -> None:
        self.refused_writes.inc()

    def verify_failed(self, tier: str, files: int) -> None:
        """`files` copies found bad on `tier` (ram, peer, persist) by one `tierfs verify`."""
        if files:
            self.verify_failures.labels(tier).inc(files)

    def _moved(self, tier: str, nbytes: int, seconds: float) -> None:
        self.step_bytes.labels(tier).observe(nbytes)
        self.step_seconds.labels(tier).observe(seconds)

    # -- read-backs: reads come range by range; a step's read-back is one event ---------------

    def read_range(self, step_path: str, where: str, nbytes: int, started: float) -> None:
        now = time.monotonic()
        current = self._read_backs.get((step_path, where))
        if current is None:
            self._read_backs[(step_path, where)] = _ReadBack(nbytes, started, now)
        else:
            current.nbytes += nbytes
            current.started = min(current.started, started)
            current.ended = max(current.ended, now)

    def end_read_backs(self, idle: float = READ_BACK_IDLE) -> None:
        """Report the read-backs that saw no read for `idle` seconds (0: all of them)."""
        now = time.monotonic()
        for key, done in list(self._read_backs.items()):
            if now - done.ended >= idle:
                del self._read_backs[key]
                step_path, where = key
                seconds = done.ended - done.started
                self._moved("read_back", done.nbytes, seconds)
                log.info("%s", event_line(step_path, f"read back from {where}", done.nbytes,
                                          seconds))

    async def run(self) -> None:
        """The daemon's worker that closes read-backs once their reads stop."""
        try:
            while True:
                await trio.sleep(READ_BACK_IDLE / 2)
                self.end_read_backs()
        finally:
            self.end_read_backs(idle=0)


# -- levels, read at scrape time ---------------------------------------------------------------

@dataclass(frozen=True)
class Levels:
    """The daemon's state as gauges see it; made in the trio thread."""

    ram_used_bytes: int
    ram_limit_bytes: int
    pending: dict[str, tuple[int, int]]  # tier -> (steps, bytes) not yet there
    peers: int
    peers_up: int
    incomplete_steps: int = 0  # committed steps with a file reachable on no tier now
    sent_to_peers: dict[str, int] = field(default_factory=dict)  # bytes of frames, per peer


class LevelsCollector(Collector):
    """Gauges read from the daemon when scraped: `levels` runs in the trio thread (through
    `trio.from_thread`), so nothing in the namespace is read from the HTTP thread."""

    def __init__(self, levels: Callable[[], Levels], token: trio.lowlevel.TrioToken) -> None:
        self._levels = levels
        self._token = token

    def describe(self) -> Iterable[Metric]:
        return []  # not known before a scrape; nothing to check against

    def collect(self) -> Iterable[Metric]:
        try:
            levels = trio.from_thread.run_sync(self._levels, trio_token=self._token)
        except trio.RunFinishedError:
            return []  # the daemon is stopping
        ram_used = GaugeMetricFamily("tierfs_ram_used_bytes", "Bytes the RAM tier holds")
        ram_used.add_metric([], levels.ram_used_bytes)
        ram_limit = GaugeMetricFamily("tierfs_ram_limit_bytes", "The RAM tier's limit "
                                      "(--ram-limit)")
        ram_limit.add_metric([], levels.ram_limit_bytes)
        steps = GaugeMetricFamily("tierfs_pending_steps", "Committed steps not yet on a tier "
                                  "that they are due on", labels=["tier"])
        nbytes = GaugeMetricFamily("tierfs_pending_bytes", "Bytes of those steps",
                                   labels=["tier"])
        for tier, (count, size) in sorted(levels.pending.items()):
            steps.add_metric([tier], count)
            nbytes.add_metric([tier], size)
        peers = GaugeMetricFamily("tierfs_peers", "Other nodes of the cluster seen since start")
        peers.add_metric([], levels.peers)
        up = GaugeMetricFamily("tierfs_peers_up", "Other nodes that answer heartbeats")
        up.add_metric([], levels.peers_up)
        incomplete = GaugeMetricFamily("tierfs_incomplete_steps", "Committed steps with a "
                                       "file that no live node and no store holds now "
                                       "(`latest` skips them)")
        incomplete.add_metric([], levels.incomplete_steps)
        sent = CounterMetricFamily("tierfs_peer_sent_bytes", "Bytes this node sent to each "
                                   "peer (replicas, ranges read by or relayed to it, "
                                   "requests)", labels=["peer"])
        for peer, count in sorted(levels.sent_to_peers.items()):
            sent.add_metric([peer], count)
        return [ram_used, ram_limit, steps, nbytes, peers, up, incomplete, sent]


class MetricsServer:
    """`--metrics HOST:PORT`: Prometheus text over HTTP, from a thread of its own."""

    def __init__(self, events: Events, levels: Callable[[], Levels], host: str,
                 port: int) -> None:
        events.registry.register(LevelsCollector(levels, trio.lowlevel.current_trio_token()))
        # Binding fails here, at start-up, with the OSError the daemon reports.
        self._server, self._thread = start_http_server(port, host, events.registry)
        log.info("serving metrics on http://%s:%d/metrics", host, port)

    async def aclose(self) -> None:
        # shutdown() waits for the serving loop to notice (up to half a second): not in trio.
        await trio.to_thread.run_sync(self._server.shutdown)
        self._server.server_close()
