"""Cluster membership on etcd: who is up, and the ring replication follows.

Each daemon registers `/<prefix>/members/<node_id>` = {address, started} under a lease of a few
seconds (`ttl`) that it keeps alive every ttl/3 s; a daemon that dies or loses etcd for longer
than the ttl loses the lease, etcd deletes the key, and every node sees it go. Every node
follows the member prefix (one snapshot, then a watch), so while nothing changes a node's work
is one keepalive per ttl/3 s, whatever the size of the cluster; a change costs each node one
watch event.

A node id is one daemon: registering an id that a live daemon at another address holds waits
one ttl for that lease to end (a crashed predecessor), then fails with `NodeIdInUse`. The same
id at the same address (a daemon restarted in place) takes its key over at once.

If the lease is lost while the daemon runs (etcd unreachable for longer than the ttl, or the
lease revoked), the keepalive finds it gone and the node registers again; a new lease that ends
before the key is written (the daemon stalled longer than the ttl) is replaced the same way. An
etcd restart keeps leases (etcd renews them when it comes back), so a short outage changes
nothing.

An etcd that was stopped (or cut off) for longer than the ttl ends every lease when it comes
back, the live daemons' too: every node sees every other go, and each registers again within
one keepalive period. So a node that leaves the live members stays *admitted* (`admits`: its
peer connections are taken and made, its copies count as reachable) for `rejoin_grace`
seconds, until its lease is known dead: it did not register again in that time. Who is *up*
(`is_up`, the ring, what eviction and placement count) follows etcd at once.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import trio

from tierfs.replication.coordination import placement
from tierfs.replication.coordination.etcd import (
    GRPC_NOT_FOUND,
    ClusterUrl,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    LeaseExpired,
    Snapshot,
    WatchEvent,
    retry_unavailable,
)

log = logging.getLogger(__name__)

DEFAULT_TTL = 3  # seconds; etcd's minimum lease is about 2 s with its default election timeout
# Seconds, beyond its ttl, that a node which left the live members stays admitted: a live node
# whose lease ended in an etcd outage registers again within one keepalive period (ttl / 3).
REJOIN_MARGIN = 1.0
LEAVE_TIMEOUT = 2.0  # at most this long to revoke the lease on a clean exit


class NodeIdInUse(EtcdError):
    """Another live daemon is registered under this node id."""


@dataclass(frozen=True)
class MemberInfo:
    node_id: str
    address: str  # HOST:PORT peers connect to (--advertise, else --listen)
    started: float  # Unix time the daemon registered
    domain: str | None = None  # --failure-domain

    def encode(self) -> bytes:
        fields: dict[str, object] = {"address": self.address, "started": self.started}
        if self.domain is not None:
            fields["domain"] = self.domain
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, node_id: str, value: bytes) -> MemberInfo:
        fields = json.loads(value)
        if not isinstance(fields.get("address"), str):
            raise ValueError("no address")
        domain = fields.get("domain")
        if domain is not None and not isinstance(domain, str):
            raise ValueError("a domain that is not a string")
        return cls(node_id, fields["address"], float(fields.get("started", 0.0)), domain)


@dataclass(frozen=True)
class MemberEvent:
    kind: Literal["up", "down"]
    node_id: str
    info: MemberInfo | None  # None for "down"


class Membership:
    """This node's registration and its view of the live members."""

    def __init__(self, etcd: Etcd, cluster: ClusterUrl, node_id: str, address: str,
                 ttl: int = DEFAULT_TTL, domain: str | None = None) -> None:
        if not node_id or "/" in node_id:
            raise ValueError(f"node id {node_id!r} must be non-empty and contain no '/'")
        self.etcd = etcd
        self.node_id = node_id
        self.ttl = ttl
        self.info = MemberInfo(node_id, address, time.time(), domain)
        self.prefix = cluster.key("members") + "/"
        self.key = self.prefix + node_id
        self.members: dict[str, MemberInfo] = {}  # the live ones, as etcd says
        # Members that left the live ones, with the trio time until which they stay admitted.
        self._departed: dict[str, tuple[MemberInfo, float]] = {}
        self.rejoin_grace = ttl + REJOIN_MARGIN
        # Until this trio time (one rejoin grace after this node registered) a node not seen
        # yet may be one that is starting too: `starting`.
        self._starting_until = math.inf
        self.changed = trio.Event()  # set (and replaced) at every change of the members
        # Counts every change of who is up or admitted (a cache of answers keys on it).
        self.generation = 0
        self._lease = 0
        # whether etcd answered this node's last lease keepalive (sent every ttl/3 seconds)
        self.etcd_answers = True
        self._subscribers: list[trio.MemorySendChannel[MemberEvent]] = []

    @property
    def ring(self) -> list[str]:
        """The live members' ids in ring order (sorted, failure domains interleaved): the
        ring replication follows."""
        return placement.ring(self.members, self.domains)

    @property
    def domains(self) -> dict[str, str]:
        """The failure domain of each live member that has one (`--failure-domain`)."""
        return {node: info.domain for node, info in self.members.items()
                if info.domain is not None}

    def is_up(self, node_id: str) -> bool:
        return node_id in self.members

    def admits(self, node_id: str) -> bool:
        """Whether `node_id` is live, or left the live members less than `rejoin_grace` ago
        (its lease may have ended in an etcd outage while it lives: see the module
        docstring)."""
        return node_id in self.members or node_id in self._departed

    @property
    def starting(self) -> bool:
        """Whether this node registered less than `rejoin_grace` ago (or not yet): the nodes
        of a cluster that starts together register one by one, so one not seen yet may only
        be later than this one."""
        return trio.current_time() < self._starting_until

    @property
    def admitted(self) -> dict[str, MemberInfo]:
        """Every admitted node and where it is: the live ones, and those within their grace."""
        return {**{node: info for node, (info, _until) in self._departed.items()},
                **self.members}

    def subscribe(self) -> trio.MemoryReceiveChannel[MemberEvent]:
        """A channel of every later up/down event (unbounded: membership changes are rare)."""
        send, receive = trio.open_memory_channel[MemberEvent](math.inf)
        self._subscribers.append(send)
        return receive

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Register, then keep the lease alive and follow the members until cancelled; started
        once registered and the members are known. On the way out the lease is revoked, so
        the others see this node leave at once rather than after the ttl."""
        await self._register()  # outside the nursery: NodeIdInUse reaches the caller as is
        self._starting_until = trio.current_time() + self.rejoin_grace
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._follow)
                nursery.start_soon(self._keep_alive)
                nursery.start_soon(self._end_graces)
                task_status.started()
        finally:
            await self._leave()

    async def _register(self) -> None:
        while True:
            lease = await retry_unavailable(lambda: self.etcd.grant_lease(self.ttl),
                                            f"node {self.node_id}: lease grant")
            try:
                await self._claim(lease)
                return
            except EtcdError as exc:
                if exc.code != GRPC_NOT_FOUND:
                    raise
                # The lease ended before the key was written: this process stalled for longer
                # than the ttl after the grant (a loaded machine). Take a new one.
                log.warning("node %s: its new lease ended before it registered; taking another",
                            self.node_id)

    async def _claim(self, lease: int) -> None:
        """Write this node's key under `lease` (waiting out a crashed predecessor's)."""
        value = self.info.encode()
        deadline = trio.current_time() + self.ttl + 1
        while not await retry_unavailable(
                lambda: self.etcd.put_if_absent(self.key, value, lease), "registering"):
            holder = await retry_unavailable(lambda: self.etcd.get(self.key), "registering")
            if holder is None:
                continue  # it expired just now
            if self._same_daemon(holder):  # this daemon restarted in place: take the key over
                await retry_unavailable(lambda: self.etcd.put(self.key, value, lease),
                                        "registering")
                break
            if trio.current_time() > deadline:
                await self.etcd.revoke(lease)
                raise NodeIdInUse(f"node id {self.node_id} is registered by a live daemon at "
                                  f"{self._address_of(holder)}")
            await trio.sleep(0.2)  # a crashed predecessor's lease ends within the ttl
        self._lease = lease
        log.info("node %s registered in the cluster at %s (lease %x, ttl %d s)", self.node_id,
                 self.info.address, lease, self.ttl)

    def _same_daemon(self, holder: KeyValue) -> bool:
        return self._address_of(holder) == self.info.address

    def _address_of(self, holder: KeyValue) -> str:
        try:
            return MemberInfo.decode(self.node_id, holder.value).address
        except (ValueError, TypeError):
            return "an unknown address (malformed record)"

    async def _keep_alive(self) -> None:
        while True:
            await trio.sleep(self.ttl / 3)
            try:
                await self.etcd.keepalive(self._lease)
            except LeaseExpired:
                log.warning("node %s: its lease in etcd has ended; registering again",
                            self.node_id)
                await self._register()
            except EtcdUnavailable as exc:
                if self.etcd_answers:
                    log.warning("node %s: lease keepalive failed: %s", self.node_id, exc)
                self.etcd_answers = False
                continue
            if not self.etcd_answers:
                log.info("node %s: etcd answers keepalives again", self.node_id)
                self.etcd_answers = True

    async def _follow(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                      ) -> None:
        send, receive = trio.open_memory_channel[Snapshot | list[WatchEvent]](16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.etcd.follow_prefix, self.prefix, send)
            started = False
            async for item in receive:
                if isinstance(item, Snapshot):
                    self._replace(item.kvs)
                else:
                    self._apply(item)
                if not started:
                    task_status.started()
                    started = True

    def _replace(self, kvs: list[KeyValue]) -> None:
        now: dict[str, MemberInfo] = {}
        for kv in kvs:
            info = self._decode(kv)
            if info is not None:
                now[info.node_id] = info
        for node_id in sorted(set(self.members) - set(now)):
            self._set(node_id, None)
        for node_id, info in sorted(now.items()):
            self._set(node_id, info)

    def _apply(self, events: list[WatchEvent]) -> None:
        for event in events:
            node_id = event.kv.key[len(self.prefix):]
            self._set(node_id, self._decode(event.kv) if event.kind == "put" else None)

    def _decode(self, kv: KeyValue) -> MemberInfo | None:
        node_id = kv.key[len(self.prefix):]
        try:
            return MemberInfo.decode(node_id, kv.value)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring the malformed member record %s: %s", kv.key, exc)
            return None

    def _set(self, node_id: str, info: MemberInfo | None) -> None:
        """Record one member's state; tell subscribers if it changed."""
        if self.members.get(node_id) == info:
            return
        if info is None:
            gone = self.members.pop(node_id)
            self._departed[node_id] = (gone, trio.current_time() + self.rejoin_grace)
            event = MemberEvent("down", node_id, None)
        else:
            self.members[node_id] = info
            self._departed.pop(node_id, None)
            event = MemberEvent("up", node_id, info)
        log.info("member %s %s%s", node_id, event.kind, f" at {info.address}" if info else "")
        for send in self._subscribers:
            send.send_nowait(event)
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        self.changed.set()
        self.changed = trio.Event()

    async def _end_graces(self) -> None:
        """A node that left and did not come back within `rejoin_grace` is no longer
        admitted, and once this node's own start is that long ago it is no longer `starting`
        (changes of the members like any other)."""
        starting = self.starting
        while True:
            now = trio.current_time()
            ended = [node for node, (_info, until) in self._departed.items() if until <= now]
            for node_id in ended:
                del self._departed[node_id]
                log.info("member %s did not come back within %.0f s: its lease is dead",
                         node_id, self.rejoin_grace)
            if ended or starting != self.starting:
                starting = self.starting
                self._changed()
            changed = self.changed
            with trio.move_on_at(min([until for _i, until in self._departed.values()]
                                     + ([self._starting_until] if starting else []),
                                     default=math.inf)):
                await changed.wait()

    async def _leave(self) -> None:
        lease, self._lease = self._lease, 0
        if not lease:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(LEAVE_TIMEOUT):
            try:
                await self.etcd.revoke(lease)
            except EtcdError as exc:
                log.info("node %s: could not leave at once (%s); its lease ends within %d s",
                         self.node_id, exc, self.ttl)
