"""The steps committed in the cluster, as this node lists them (with --cluster): every one from
the start and each new commit within a watch event (`ClusterSteps.follow`); what it missed while
it was down (`catch_up`); and the rounds that write the commit records etcd could not take and
list the steps there was no room for (`publish_pending`). `caught_up` says when all that was
found at start is done (`tierfs status`)."""

from __future__ import annotations

import logging

import trio

from tierfs import manifest as mf
from tierfs.fs.lifecycle.commits import PENDING_RETRY
from tierfs.fs.model.ports import StepCopies
from tierfs.replication.catch_up import apply_missed
from tierfs.replication.commit_order import CopyPlans
from tierfs.replication.coordination.cluster_commit import ClusterCommits

log = logging.getLogger(__name__)


class ClusterSteps:
    """The cluster's commits, listed in this node's tree (`StepCopies.learn`); a step this node
    holds files of is planned again (`CopyPlans.learned`)."""

    def __init__(self, sealed: ClusterCommits, tiers: StepCopies, plans: CopyPlans) -> None:
        self.sealed = sealed
        self.tiers = tiers
        self.plans = plans
        # Set once what this node missed while it was down is applied and the commit records
        # it found missing were written (or tried, if etcd refused them: they are retried
        # every PENDING_RETRY).
        self.caught_up = trio.Event()
        self._missed_taken = False  # `catch_up` listed what this node missed
        # Steps of the cluster not listed here for want of room for their records: path ->
        # (manifest, holders), listed again each PENDING_RETRY.
        self._unlearned: dict[str, tuple[mf.StepManifest, list[str]]] = {}

    def learn(self, manifest: mf.StepManifest, holders: list[str]) -> None:
        """A step committed in the cluster is listed here; if this node holds files of that
        version (it wrote some, or holds copies), the step is planned again: copies may be
        due, and the records (touched when holders are added) say who holds each file now."""
        try:
            self.tiers.learn(manifest, holders)
        except OSError as exc:
            # No room for its records (the RAM dir's file system full: a /dev/shm other
            # processes fill): listed by a retry once there is (`publish_pending`'s round);
            # an error here would end the watch of the commits, and the daemon with it.
            if manifest.path not in self._unlearned:
                log.warning("%s v%d is not listed here yet: %s", manifest.path,
                            manifest.version, exc.strerror or exc)
            self._unlearned[manifest.path] = (manifest, holders)
            return
        self._unlearned.pop(manifest.path, None)
        self.plans.learned(manifest)

    async def learn_all(self) -> None:
        """Every step of the cluster, from the start."""
        await self.sealed.learn_all(self.learn, self.tiers.store_state)

    async def follow(self) -> None:
        """Every commit of the other nodes is listed here within a watch event, and what the
        store holds of each step, whoever uploaded it."""
        await self.sealed.follow(self.learn, self.tiers.unlisted, self.tiers.store_state)

    async def catch_up(self) -> None:
        """What this node missed while it was down (`catch_up.apply_missed`); the commit
        records it found missing are written by the next `publish_pending` round."""
        await apply_missed(self.sealed, self.tiers)
        self._missed_taken = True

    async def publish_pending(self) -> None:
        """Commit records etcd could not take (it was down) are written once it is back; steps
        of the cluster this node had no room to list are listed once it has."""
        while True:
            await trio.sleep(PENDING_RETRY)
            caught_up = self._missed_taken  # this round writes what the catch-up found
            await self.tiers.publish_pending()
            for manifest, holders in list(self._unlearned.values()):
                self.learn(manifest, holders)
            if caught_up:
                self.caught_up.set()
