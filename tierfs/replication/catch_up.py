"""What a node that was down corrects with the cluster's records: before it joins, the copies
it lost (`drop_lost_copies`: a node that cannot correct them does not join); once it runs,
what it missed (`apply_missed`: the deletes made meanwhile, the commit records etcd never got).
Both are tried until etcd answers (`tierfs.retry.CATCH_UP_RETRIES`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from tierfs.fs.lifecycle.commits import PENDING_RETRY
from tierfs.fs.lifecycle.recovery import RecoveryReport
from tierfs.fs.model.ports import StepCopies
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.etcd import EtcdError
from tierfs.retry import CATCH_UP_RETRIES, retry

log = logging.getLogger(__name__)


def _etcd_error(exc: Exception) -> bool:
    return isinstance(exc, EtcdError)


async def drop_lost_copies(sealed: ClusterCommits, recovered: RecoveryReport,
                           holds_copy: Callable[[str, str, str], bool],
                           in_store: Callable[[str], bool], patience: float) -> bool:
    """The records stop counting this node as a holder of files it does not hold in RAM
    (`holds_copy`: it was replaced with an empty RAM dir, or lost files): the survivors
    restore those copies (`ClusterCommits.drop_lost_copies`). At start, before the node is a
    live member, and only if start-up found this node may have lost copies (an empty RAM dir,
    steps set aside, objects removed: `RecoveryReport`), since it reads every step listing
    this node: from then on a copy of a step not persisted leaves RAM only after it left the
    records (`Eviction._leave`), and a bad one leaves them when it is quarantined. Tried for
    `patience` seconds; False if the records could not be corrected in that time: such a node
    must not join (peers would count the copies it lost)."""
    if not recovered.may_have_lost_copies:
        log.info("the RAM store holds every copy it held (%d committed steps): the "
                 "cluster's records are not read for lost copies", recovered.steps)
        return True
    with trio.move_on_after(patience):
        dropped = await retry(lambda: sealed.drop_lost_copies(holds_copy, in_store),
                              "comparing the cluster's records with the copies here",
                              retryable=_etcd_error, policy=CATCH_UP_RETRIES)
        if dropped:
            log.warning("%d copies the cluster's records listed here are not in RAM: the "
                        "other holders restore them", dropped)
        return True
    return False


async def apply_missed(sealed: ClusterCommits, tiers: StepCopies) -> None:
    """What this node missed while it was down, once etcd answers (tried until it does):
    deletes made meanwhile are applied here, and the steps it committed whose commit record
    never reached etcd are published later (`StepCopies.publish_later`)."""
    unpublished, deleted = await retry(
        lambda: sealed.missed(tiers.owned_manifests(), tiers.listed_manifests()),
        "comparing this node's steps with etcd", retryable=_etcd_error,
        policy=CATCH_UP_RETRIES)
    for deletion in deleted:
        failures = 0
        while True:
            try:
                tiers.delete_from_peer(deletion.step, deletion.version, deletion.committed_ns,
                                       "another node (a tombstone in etcd)")
                break
            except OSError as exc:
                # No room for its record (the RAM dir's file system full: a /dev/shm other
                # processes fill): nothing was changed; tried again at the pace of the pending
                # commits, never given up (an error here would end the daemon), and said once
                # (a full file system can last).
                failures += 1
                if failures == 1:
                    log.warning("delete of %s made while this node was down is not applied "
                                "here yet: %s", deletion.step, exc.strerror or exc)
                await trio.sleep(PENDING_RETRY)
    for manifest in unpublished:
        tiers.publish_later(manifest)
