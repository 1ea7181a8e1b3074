"""One run of the partition suite: a cluster in network namespaces, the DCP job on its mounts,
the history, the `latest` watcher and the nemesis, built together and torn down together
(`PartitionRun.open`), and judged at the end (`finish`: heal, settle, read everything on every
node, check the history).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import MountFactory
from tests.faults.checker import Bounds, check
from tests.faults.history import History
from tests.faults.nemesis import Nemesis
from tests.faults.netcluster import ETCD, NetCluster
from tests.faults.network import Network
from tests.faults.results_io import RESULTS, write_results
from tests.faults.workload import Job, LatestWatcher, Workload

RUN = "run"
COMMIT_TIMEOUT = 6.0  # --commit-timeout of every node (seconds)
# The bounds of doc/CLUSTER.md ("Bounds"), in seconds:
# the saver's call that commits: --commit-timeout (the lookups of `.metadata` on its way
# included), plus 1.5 s of scheduling on a loaded 2-core machine;
COMMIT_BOUND = COMMIT_TIMEOUT + 1.5
# a whole save: that, plus DCP's own work and the local writes of a loaded 2-core machine;
SAVE_BOUND = COMMIT_BOUND + 15.0
# every node agrees on the committed steps and `latest` after a heal.
SETTLE_BOUND = 15.0
BOUNDS = Bounds(settle=SETTLE_BOUND, commit=COMMIT_BOUND, save=SAVE_BOUND)
TTL = 3.0  # the members' lease (membership.DEFAULT_TTL): a cut "longer than the lease" > this


class PartitionRun:
    """See the module docstring. `nodes` hosts named n0, n1, ...; rank r on node r % nodes."""

    def __init__(self, workdir: Path, mounts: MountFactory, token_file: Path, name: str,
                 seed: int, nodes: int = 3, ranks: int | None = None,
                 domains: dict[str, str] | None = None, options: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.mounts = mounts
        self.token_file = token_file
        self.name = name
        self.seed = seed
        self.rng = random.Random(seed)
        self.node_ids = [f"n{i}" for i in range(nodes)]
        self.ranks = ranks or nodes
        self.domains = domains
        self.options = ("--replicas", "1", "--commit-timeout", str(COMMIT_TIMEOUT), *options)
        self.history = History()
        self._step = 0
        self.steps: list[str] = []  # every step path saved, in order
        self.acknowledged: list[str] = []  # the steps whose last save returned success

    @classmethod
    @contextlib.contextmanager
    def open(cls, *args: Any, **kwargs: Any) -> Iterator[PartitionRun]:
        run = cls(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            run.network = stack.enter_context(Network(run.workdir, run.node_ids, [ETCD]))
            stack.callback(run.mounts.cleanup)  # before the network goes: daemons by pid
            run.cluster = NetCluster(run.workdir, run.mounts, run.network, run.token_file,
                                     run.domains)
            run.cluster.start_all(*run.options)
            roots = [run.cluster.nodes[n].mountpoint for n in run.node_ids]
            run.job = Job(run.workdir, run.ranks, roots)
            stack.callback(run.job.close)
            run.workload = Workload(run.history, run.job, run.cluster.nodes, run.node_ids,
                                    SAVE_BOUND)
            run.watcher = stack.enter_context(LatestWatcher(run.history, run.cluster.nodes,
                                                            RUN))
            run.nemesis = Nemesis(run.network, run.history)
            try:
                yield run
            finally:
                run.history.dump(RESULTS / f"{run.name}.history.jsonl")

    # -- operations ---------------------------------------------------------------------------

    def next_step(self) -> str:
        self._step += 10
        path = f"{RUN}/step_{self._step}"
        self.steps.append(path)
        return path

    def save(self, path: str | None = None, seed: int | None = None) -> bool:
        """Save a new step (or `path` again, with another seed): the save's outcome."""
        path = path or self.next_step()
        seed = seed if seed is not None else int(path.rsplit("_", 1)[1])
        ok = self.workload.save(path, seed)
        if ok and path not in self.acknowledged:
            self.acknowledged.append(path)
        return ok

    def load(self, node: str | None = None, path: str = f"{RUN}/latest") -> bool:
        return self.workload.load(path, node or self.rng.choice(self.node_ids))

    def heal_and_settle(self) -> float:
        healed = self.nemesis.heal()
        return self.workload.settle(RUN, SETTLE_BOUND, healed)

    def node_of_rank(self, rank: int) -> str:
        return self.node_ids[rank % len(self.node_ids)]

    # -- the end ------------------------------------------------------------------------------

    def finish(self, **extra_counts: Any) -> dict[str, Any]:
        """Heal, settle, read back everything everywhere, check the history; fails the test
        with every violation found."""
        self.heal_and_settle()
        self.workload.final_reads(RUN)
        violations, counts = check(self.history, self.node_ids, RUN, BOUNDS)
        counts.update(seed=self.seed, latest_reads=self.watcher.reads, violations=len(violations),
                      **extra_counts)
        write_results(self.name, counts)
        assert not violations, (f"{len(violations)} violations (seed {self.seed}; history in "
                                f"tests/faults/results/{self.name}.history.jsonl):\n"
                                + "\n".join(violations))
        return counts
