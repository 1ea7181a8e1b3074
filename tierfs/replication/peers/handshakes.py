"""Whether this node's peer handshake with each live member succeeds: a member that etcd says
is up may still be one no exchange can reach (given another token, or advertised at an address
the other nodes cannot reach, as `--advertise 127.0.0.1:PORT` on a cluster of several hosts).

Each node proves it: a handshake and a PING with every member FIRST_PROBE_AFTER seconds after
it comes up (or comes back at another address), again every RETRY_EVERY seconds with a member
whose handshake failed, and at once when a connection to a member fails elsewhere
(`check_soon`). A probe is a PING on a connection of the pool: a new connection's handshake
then serves the requests that follow. A failure counts only once a second probe,
CONFIRM_AFTER later, fails the same way; a member that closes the connection without a word
says nothing (one that has just registered may not know this node yet): it is asked again for
a few seconds, and its state stays as it was.

A member's *link* is then `ok`, `refused (token)` (its proof of the token is wrong: the two
nodes were given different tokens), `refused (TLS)` (with `--peer-tls`: a certificate not of
the cluster's CA at either end) or `unreachable` (nothing answers at its address, or not as a
peer port). `tierfs status` shows a failing member as `up, refused (token)`,
`up, refused (TLS)` or `up, unreachable`, and its copies do not count as reachable
(`PeerDirectory.may_be_up`): a step that only such a node holds is not `latest` here until
its files can be read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import (
    ConnectionClosed,
    ConnectionLost,
    TlsRefused,
    TokenRefused,
)

log = logging.getLogger(__name__)

OK = "ok"
REFUSED = "refused (token)"
TLS_REFUSED = "refused (TLS)"
UNREACHABLE = "unreachable"
RETRY_EVERY = 5.0  # seconds between probes of a member whose handshake fails
# Seconds from a member's coming up to its first probe: long enough for it to have read who
# the members are (it refuses a node it does not know yet), short beside a step's commit.
FIRST_PROBE_AFTER = 1.0
CONFIRM_AFTER = 0.5  # seconds before the probe that confirms a failure
CLOSED_PATIENCE = 10  # probes a member may close without a word before nothing is concluded
_CLOSED = "closed"  # the member closed the connection: nothing learnt

Probe = Callable[[str], Awaitable[None]]  # a handshake and a PING with this node (raises)


@dataclass
class Link:
    """The last probe of one member, at one address."""

    addr: str
    state: str
    error: str = ""
    checked: float = -math.inf  # trio time of the probe


def _classify(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, TokenRefused):
        return REFUSED, str(exc)
    if isinstance(exc, TlsRefused):
        return TLS_REFUSED, str(exc)
    if isinstance(exc, trio.TooSlowError):
        return UNREACHABLE, "timed out"
    return UNREACHABLE, _oserror_reason(exc) or str(exc) or type(exc).__name__


def _oserror_reason(exc: BaseException | None) -> str | None:
    """`connection refused` from trio's `all attempts to connect ... failed` (its cause, or
    the first of a group)."""
    while exc is not None:
        if getattr(exc, "strerror", None):
            return str(exc.strerror).lower()  # type: ignore[attr-defined]
        group = getattr(exc, "exceptions", None)
        exc = exc.__cause__ or (group[0] if group else None)
    return None


class PeerLinks:
    """The link to each live member, as this node's probes found it."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        self._links: dict[str, Link] = {}
        self._soon: set[str] = set()
        self._probing: set[str] = set()
        # members not probed yet (or that gave no answer): address, and when to probe them
        self._unprobed: dict[str, tuple[str, float]] = {}
        self._wake = trio.Event()
        self.generation = 0  # counts every change of a member's link state

    def state(self, node_id: str, addr: str) -> str:
        """`ok`, `refused (token)`, `refused (TLS)` or `unreachable` for the member at
        `addr`; `ok` while it has not been probed there yet."""
        link = self._links.get(node_id)
        return link.state if link is not None and link.addr == addr else OK

    def error(self, node_id: str, addr: str) -> str:
        link = self._links.get(node_id)
        return link.error if link is not None and link.addr == addr else ""

    def failing(self, node_id: str, addr: str) -> bool:
        return self.state(node_id, addr) != OK

    def check_soon(self, node_id: str) -> None:
        """A connection to this member failed elsewhere: probe it now (unless its handshake
        is known to fail: it is probed again every RETRY_EVERY seconds anyway)."""
        link = self._links.get(node_id)
        if link is None or link.state == OK:
            self._soon.add(node_id)
            self._wake.set()

    async def run(self, members: Callable[[], dict[str, str]],
                  changed: Callable[[], trio.Event]) -> None:
        """Probe the members (`members()`: node id -> address, this node left out) as the
        module docstring says, until cancelled; `changed()` is set at a change of them. Each
        probe runs on its own: one that waits out a timeout holds up no other."""
        async with trio.open_nursery() as nursery:
            while True:
                change, self._wake = changed(), trio.Event()
                now = trio.current_time()
                current = members()
                for gone in set(self._links) - set(current):
                    del self._links[gone]
                for gone in set(self._unprobed) - set(current):
                    del self._unprobed[gone]
                later = math.inf
                for node_id, addr in current.items():
                    if node_id in self._probing:
                        continue
                    due = self._due(node_id, addr, now)
                    if due <= now:
                        self._probing.add(node_id)
                        nursery.start_soon(self._check, node_id, addr)
                    later = min(later, due)
                self._soon.clear()
                with trio.move_on_at(later):
                    async with trio.open_nursery() as waits:
                        for event in (change, self._wake):
                            waits.start_soon(_set_then_cancel, event, waits.cancel_scope)

    def _due(self, node_id: str, addr: str, now: float) -> float:
        """When the member at `addr` is to be probed next (trio time)."""
        if node_id in self._soon:
            return now
        link = self._links.get(node_id)
        if link is None or link.addr != addr:  # first seen there, or no answer yet
            seen_addr, due = self._unprobed.get(node_id, ("", math.inf))
            if seen_addr != addr:
                due = now + FIRST_PROBE_AFTER
                self._unprobed[node_id] = (addr, due)
            return due
        return link.checked + RETRY_EVERY if link.state != OK else math.inf

    async def _check(self, node_id: str, addr: str) -> None:
        try:
            state, error = await self._confirmed(node_id)
        finally:
            self._probing.discard(node_id)
            self._wake.set()  # the loop sets its next retry from this probe's result
        before = self.state(node_id, addr)  # ok while never probed at this address
        if state == _CLOSED:  # nothing learnt: as it was, asked again later
            if (link := self._links.get(node_id)) is None or link.addr != addr:
                self._unprobed[node_id] = (addr, trio.current_time() + RETRY_EVERY)
            return
        self._unprobed.pop(node_id, None)
        self._links[node_id] = Link(addr, state, error, trio.current_time())
        if before == state:
            return
        self.generation += 1
        if state == OK:
            log.warning("node %s at %s: peer handshake succeeds again", node_id, addr)
        else:
            log.error("node %s at %s is up, %s: %s; its copies do not count here until a "
                      "handshake with it succeeds", node_id, addr, state, error)

    async def _confirmed(self, node_id: str) -> tuple[str, str]:
        """A probe's result, a failure only once the next probe, CONFIRM_AFTER later, fails
        the same way. A member that closes the connection without a word may not know this
        node yet (it has just registered): asked again, CLOSED_PATIENCE times at most."""
        state, error = await self._attempt(node_id)
        for _ in range(CLOSED_PATIENCE):
            if state == OK:
                break
            await trio.sleep(CONFIRM_AFTER)
            again, error = await self._attempt(node_id)
            if again == state != _CLOSED:
                break
            state = again
        return state, error

    async def _attempt(self, node_id: str) -> tuple[str, str]:
        try:
            await self._probe(node_id)
        except (ConnectionClosed, ConnectionLost) as exc:
            return _CLOSED, str(exc)
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            return _classify(exc)
        return OK, ""


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
