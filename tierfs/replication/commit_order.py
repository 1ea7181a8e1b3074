"""In what order a committed step leaves this node: its peer copies first, then its upload
(`CommitPipeline`, `upload_after_copies`); and, in a cluster, which steps are planned again
(`CopyPlans`): a step committed on another node that this node holds files of, every step
it holds when members come and go, and every SHORT_CHECK seconds those short of copies."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import trio

from tierfs import manifest as mf
from tierfs.fs.model.nodes import Node
from tierfs.step_queue import StepQueue

COPIES_FIRST = 10.0  # seconds at most that an upload waits for the peer copies of its step
# Seconds between the checks for steps held here that are short of their copies
# (`CopyPlans.plan_short_again`).
SHORT_CHECK = 30.0


class Copies(Protocol):
    """The replicator as the order uses it: the steps it is given, in its queue."""

    queue: StepQueue

    def submit(self, manifest: mf.StepManifest) -> None: ...


class Uploads(Protocol):
    """The uploader as the order uses it."""

    def submit(self, manifest: mf.StepManifest) -> None: ...

    def wanted(self, manifest: mf.StepManifest) -> bool: ...


async def upload_after_copies(manifest: mf.StepManifest, uploader: Uploads,
                              copies: StepQueue) -> None:
    """Peer copies go first: they end the single-copy window within seconds, and an upload
    beside them takes the network and CPU they need (1 GiB on loopback took 5.3 s to
    replicate beside its upload, 0.34 s alone). The upload waits until this node made its
    copies of the step, or gave up for now (no live peer: the store is then the only other
    tier), at most COPIES_FIRST seconds. (In a cluster, also this node's share of a step
    committed on another node: `CopyPlans`.)"""
    with trio.move_on_after(COPIES_FIRST):
        await copies.settled(manifest.path)
    uploader.submit(manifest)


class CommitPipeline:
    """Follows the commit events of the namespace: each committed version goes to the
    replicator (peer copies) and, once they are made or given up for now, to the uploader."""

    def __init__(self, uploader: Uploads | None, replicator: Copies | None) -> None:
        self.uploader = uploader
        self.replicator = replicator
        self.commits = 0  # versions committed since the mount (`tierfs status`)

    async def run(self, events: trio.MemoryReceiveChannel[mf.StepManifest]) -> None:
        async with trio.open_nursery() as nursery:
            async for manifest in events:
                self.commits += 1
                if self.replicator is not None:
                    self.replicator.submit(manifest)
                if self.uploader is None:
                    continue
                if self.replicator is None:
                    self.uploader.submit(manifest)
                else:
                    nursery.start_soon(upload_after_copies, manifest, self.uploader,
                                       self.replicator.queue)


class CopyPlans:
    """The steps of the cluster this node plans copies of again (with --cluster): one committed
    elsewhere that it holds files of, once listed here; every one it holds when a node goes
    or comes (lost copies are restored; a node joining moves nothing). With each, this node's
    share of its upload (`shared_uploads`), after its copies."""

    def __init__(self, replicator: Copies, uploader: Uploads | None,
                 find_step: Callable[[str], Node | None],
                 held: Callable[[], Iterable[mf.StepManifest]],
                 short: Callable[[mf.StepManifest], bool] = lambda _manifest: False) -> None:
        self.replicator = replicator
        self.uploader = uploader
        self._find_step = find_step  # the tree's node of a step's path
        self._held = held  # the committed versions this node holds files of
        self._short = short  # whether a version held here is short of its copies
        self._nursery: trio.Nursery | None = None  # the service's, from `start`

    def start(self, nursery: trio.Nursery) -> None:
        """Uploads after copies run in `nursery` from now on."""
        self._nursery = nursery

    def learned(self, manifest: mf.StepManifest) -> None:
        """A step committed in the cluster was listed here: if this node holds files of that
        version (it wrote some, or holds copies), copies may be due, and its upload share."""
        node = self._find_step(manifest.path)
        if node is not None and node.step.committed and node.step.resident and \
                node.step.manifest.version == manifest.version:
            self.send(node.step.manifest)

    def members_changed(self) -> None:
        """A node went or came: every step held here is planned again from fresh records."""
        for manifest in self._held():
            self.send(manifest)  # a sender of its files may be gone

    async def plan_short_steps(self) -> None:
        """`plan_short_again` every SHORT_CHECK seconds."""
        while True:
            await trio.sleep(SHORT_CHECK)
            self.plan_short_again()

    def plan_short_again(self) -> int:
        """Every step held here that is short of its copies is planned again; how many.
        Each copy due is due by an event (the step committed or listed here, a member gone
        or come, a copy made) that has the step planned: this, run every SHORT_CHECK
        seconds, is the net for one that an event missed, which would otherwise wait for
        the next change of members (a race of two commits of one save lost such an event:
        `Commits.announce`)."""
        planned = 0
        for manifest in self._held():
            if self._short(manifest):
                self.replicator.submit(manifest)
                planned += 1
        return planned

    def send(self, manifest: mf.StepManifest) -> None:
        self.replicator.submit(manifest)
        self._upload_share(manifest)

    def _upload_share(self, manifest: mf.StepManifest) -> None:
        """This node's share of a step's upload (it holds files of it: it may be the one to
        send some to the store), after its copies (`shared_uploads`)."""
        step = self._find_step(manifest.path)
        if (self.uploader is None or self._nursery is None or step is None
                or step.step.persisted or not self.uploader.wanted(manifest)):
            return
        self._nursery.start_soon(upload_after_copies, manifest, self.uploader,
                                 self.replicator.queue)
