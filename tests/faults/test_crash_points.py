"""Crash points: the daemon (or the training process) is killed with SIGKILL at many distinct
moments of real DCP saves, and after every restart on the same RAM dir

* every step committed before verifies byte-identical: the bytes read through the mount, the
  manifest's `user.tierfs.xxh3` and the hashes the training process saved all agree;
* no partial step is ever `committed`: a step that comes back committed loads with DCP and
  equals, tensor by tensor, what the training process saved;
* the interrupted step is either committed whole or `writing` (a re-saved step: its old or its
  new version, committed);
* a save that returned to the training process is never lost.

The moment of each kill is varied systematically over a save (fractions of the calibrated time
of the data phase, of the commit after the last shard, of replication, of the upload), and what
the RAM dir held at the kill is recorded, so the report shows which phases were hit.
Counts go to tests/faults/results/crash_points_<mode>.json.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, MountFactory, getxattr, pid_alive, wait_until
from tests.faults.conftest import FULL, Trainer, report, scale, step_problems
from tests.test_cluster import Cluster
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.mount_helper.mounts import is_mounted

pytestmark = pytest.mark.faults

KEEP = 4  # committed steps kept (and verified after every crash); older ones are removed


def disk_phase(ram_dir: Path, relpath: str, old_version: int) -> str:
    """Where the save stood when the daemon died, as its RAM dir shows it."""
    step_dir = ram_dir / "tree" / relpath
    try:
        names = set(os.listdir(step_dir))
    except FileNotFoundError:
        return "before any data"
    if mf.MANIFEST_NAME in names:
        try:
            version = mf.decode((step_dir / mf.MANIFEST_NAME).read_bytes()).version
        except (OSError, mf.ManifestError):
            version = -1
        if version > old_version:
            return "manifest renamed into place"
    if mf.MANIFEST_NAME + ".tmp" in names:
        return "manifest being written"
    if ".metadata" in names:
        return ".metadata in place, not committed"
    if ".metadata.tmp" in names:
        return ".metadata being written"
    if any(n.endswith(".distcp") for n in names):
        return "shards on disk, no .metadata yet"
    return "before any data"


class CrashRun:
    """One chain of saves on one node's RAM dir, a crash in each, with the checks after."""

    def __init__(self, mounts: MountFactory, mnt: Mount, trainer: Trainer, mib: float,
                 env: dict[str, str] | None = None) -> None:
        self.mounts = mounts
        self.mnt = mnt
        self.trainer = trainer
        self.mib = mib
        self.env = env
        self.expected: dict[str, tuple[int, dict[str, str]]] = {}
        # Committed steps the test removed from the mount: another tier (the store, a peer)
        # may list them again after a restart, which is no partial step.
        self.removed: set[str] = set()
        self.number = 0
        self.tried = 0
        self.losses = 0
        self.problems: list[str] = []
        self.phases: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()

    def next_path(self) -> str:
        self.number += 1
        return f"run/step_{self.number}"

    def clean_save(self) -> tuple[str, dict[str, float]]:
        """A save that must commit; its timings (start->shards->committed->returned)."""
        relpath = self.next_path()
        seed = self.number
        started = time.monotonic()
        self.trainer.start_save(self.mnt / relpath, seed, self.mib)
        self.trainer.expect("shards")
        shards = time.monotonic()
        wait_until(lambda: _state(self.mnt / relpath) == "committed", timeout=60,
                   interval=0.002)
        committed = time.monotonic()
        done = self.trainer.expect("done")
        assert done["ok"], done
        self.expected[relpath] = (seed, done["files"])
        return relpath, {"data": shards - started, "commit": committed - shards,
                         "total": time.monotonic() - started}

    def kill_daemon(self) -> None:
        """SIGKILL the daemon but leave its mount in place until `restart`: the training
        process then fails with ENOTCONN. (A lazy unmount at once would let a save that is
        still running go on into the plain directory beneath the mountpoint and "succeed".)"""
        os.kill(self.mnt.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(self.mnt.pid))

    def restart(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt.mountpoint)],
                       capture_output=True)
        wait_until(lambda: not is_mounted(self.mnt.mountpoint))
        beneath = os.listdir(self.mnt.mountpoint)
        if beneath:  # nothing may ever have been written around tierfs
            self.losses += 1
            self.problems.append(f"written beneath the mountpoint: {beneath}")
        self.mnt = self.mounts.remount(self.mnt, env=self.env)

    def record(self, kind: str, relpath: str, phase: str, done: dict[str, Any] | None,
               seed: int, old: tuple[int, dict[str, str]] | None) -> None:
        """Check everything after a crash at `relpath`; count the crash point."""
        self.tried += 1
        self.phases[f"{kind}: {phase}"] += 1
        self.check_others(skip=relpath)
        self.check_interrupted(kind, relpath, done, seed, old)
        self.check_latest()
        self.trim()

    def check_others(self, skip: str) -> None:
        states = {s["path"]: s["state"] for s in self.mnt.status()["steps"]}
        for relpath, (_seed, files) in self.expected.items():
            if relpath == skip:
                continue
            problems = step_problems(self.mnt, relpath, files)
            if states.get(relpath) != "committed":
                problems.append(f"status lists {relpath} as {states.get(relpath)}")
            if problems:
                self.losses += 1
                self.problems += problems
        for relpath, state in states.items():
            if (state == "committed" and relpath not in self.expected and relpath != skip
                    and relpath not in self.removed):
                self.losses += 1
                self.problems.append(f"{relpath} is committed but was never saved whole")

    def check_interrupted(self, kind: str, relpath: str, done: dict[str, Any] | None,
                          seed: int, old: tuple[int, dict[str, str]] | None) -> None:
        step_dir = self.mnt / relpath
        state = _state(step_dir)
        returned = done is not None and done.get("ok")
        if state == "committed":
            files = {name: getxattr(step_dir / name, "user.tierfs.xxh3")
                     for name in os.listdir(step_dir)}
            if old is not None and files == old[1]:
                self.outcomes["old version committed"] += 1
                problems = step_problems(self.mnt, relpath, old[1])
                if returned:
                    problems.append(f"{relpath}: the re-save returned but the old version "
                                    "came back")
            else:
                problems = step_problems(self.mnt, relpath, files)
                if returned and files != done["files"]:
                    problems.append(f"{relpath}: committed files differ from the saved ones")
                ok, error = self.trainer.load_matches(step_dir, seed, self.mib)
                if not ok:
                    problems.append(f"{relpath} committed but does not load: {error}")
                self.outcomes["committed whole"] += 1
                self.expected[relpath] = (seed, files)
        else:
            self.outcomes[f"left {state}"] += 1
            problems = []
            if returned:
                problems.append(f"{relpath}: the save returned but the step is {state}")
            if old is not None:
                problems.append(f"{relpath}: a re-saved step came back {state}, not as its "
                                "last committed version")
            if state is not None:
                shutil.rmtree(step_dir)  # the job would save it again; keep the RAM dir small
            self.expected.pop(relpath, None)
        if problems:
            self.losses += 1
            self.problems += problems

    def check_latest(self) -> None:
        if self.expected:
            newest = max(self.expected, key=lambda p: int(p.rsplit("_", 1)[1]))
            # Asked by a process of its own: this one has just read the step's files, and a
            # process reading a step keeps seeing it as `latest` for a while (latest_pins).
            found = subprocess.run(["readlink", str(self.mnt / "run/latest")],
                                   capture_output=True, text=True).stdout.strip()
            if found != newest.split("/")[1]:
                self.problems.append(f"latest is {found}, expected {newest}")
                self.losses += 1

    def trim(self) -> None:
        for relpath in sorted(self.expected, key=lambda p: int(p.rsplit("_", 1)[1]))[:-KEEP]:
            shutil.rmtree(self.mnt / relpath)
            del self.expected[relpath]
            self.removed.add(relpath)

    def counts(self) -> dict[str, Any]:
        return {"crash_points_tried": self.tried, "losses": self.losses,
                "problems": self.problems[:20], "phases_hit": dict(self.phases),
                "outcomes": dict(self.outcomes)}


def _state(path: Path) -> str | None:
    try:
        return getxattr(path, "user.tierfs.state")
    except FileNotFoundError:
        return None


def spread(count: int, span: float) -> list[float]:
    """`count` moments evenly over [0, span]: the crash schedule of one phase."""
    return [span * (i + 0.5) / count for i in range(count)]


def crash_daemon_during_save(run: CrashRun, kind: str, delay: float, *,
                             after: str = "start", resave: bool = False) -> None:
    """Start a save, wait for event `after` plus `delay` seconds, kill the daemon, restart."""
    if resave:
        relpath = max(run.expected, key=lambda p: int(p.rsplit("_", 1)[1]))
        old = run.expected[relpath]
        seed = old[0] + 1000
    else:
        relpath, old = run.next_path(), None
        seed = run.number
    old_version = _manifest_version(run.mnt.ram_dir, relpath)
    run.trainer.start_save(run.mnt / relpath, seed, run.mib, pause=(after == "paused"))
    if after in ("shards", "paused"):
        run.trainer.expect("shards")
    time.sleep(delay)
    run.kill_daemon()
    phase = disk_phase(run.mnt.ram_dir, relpath, old_version)
    if after == "paused":
        run.trainer.send("go")  # finish() runs against a dead mount and fails
    done = run.trainer.expect("done")
    run.restart()
    run.record(kind, relpath, phase, done, seed, old)


def _manifest_version(ram_dir: Path, relpath: str) -> int:
    try:
        return mf.decode((ram_dir / "tree" / relpath / mf.MANIFEST_NAME).read_bytes()).version
    except FileNotFoundError:
        return 0


def save_until_committed(run: CrashRun) -> tuple[str, int]:
    """Start a save of a new step and return as soon as the mount shows it committed (the
    training process may still be reading its files back)."""
    relpath = run.next_path()
    run.trainer.start_save(run.mnt / relpath, run.number, run.mib)
    run.trainer.expect("shards")
    wait_until(lambda: _state(run.mnt / relpath) == "committed", timeout=60, interval=0.002)
    return relpath, run.number


def calibrate(run: CrashRun, reached: Any) -> float:
    """Seconds from a clean save's commit until `reached(relpath)` holds (replicated,
    uploaded): the span over which the kills of that phase are spread."""
    relpath, seed = save_until_committed(run)
    begun = time.monotonic()
    wait_until(lambda: reached(relpath), timeout=60, interval=0.002)
    seconds = time.monotonic() - begun
    done = run.trainer.expect("done")
    assert done["ok"], done
    run.expected[relpath] = (seed, done["files"])
    return seconds


def crash_trainer_during_save(run: CrashRun, delay: float) -> None:
    """Kill the training process instead: the daemon lives on, the step must not commit."""
    relpath = run.next_path()
    seed = run.number
    run.trainer.start_save(run.mnt / relpath, seed, run.mib)
    time.sleep(delay)
    run.trainer.kill_child()
    done = run.trainer.expect("done")
    time.sleep(0.05)  # the kernel releases the dead process's files; the daemon seals them
    phase = "trainer killed: " + disk_phase(run.mnt.ram_dir, relpath, 0)
    run.record("training process killed", relpath, phase, done, seed, None)


@pytest.mark.timeout(scale(300, 1500))
def test_crash_points_single_node(mounts: MountFactory, trainer: Trainer) -> None:
    """Kills during data writes, between the last shard and .metadata, during the commit
    (manifest write) and during a re-save of a committed step; and kills of the training
    process. One RAM dir for the whole chain."""
    started = time.monotonic()
    run = CrashRun(mounts, mounts.mount(), trainer, mib=scale(2, 3))
    timings = [run.clean_save()[1] for _ in range(2)]
    t_data = max(t["data"] for t in timings)
    t_commit = max(t["commit"] for t in timings)
    t_total = max(t["total"] for t in timings)
    schedule: list[tuple[str, float, str, bool]] = []
    schedule += [("data writes", d, "start", False) for d in spread(scale(2, 60), t_data)]
    schedule += [("after last shard, before .metadata", 0.0, "paused", False)
                 for _ in range(scale(1, 12))]
    schedule += [("commit (.metadata and manifest)", d, "shards", False)
                 for d in spread(scale(2, 48), 1.5 * t_commit)]
    schedule += [("re-save of a committed step", d, "start", True)
                 for d in spread(scale(1, 24), t_total)]
    for kind, delay, after, resave in schedule:
        crash_daemon_during_save(run, kind, delay, after=after, resave=resave)
    for delay in spread(scale(2, 30), t_total):
        crash_trainer_during_save(run, delay)
    report("crash_points_single_node",
           {**run.counts(), "seconds": round(time.monotonic() - started, 1),
            "state_mib": run.mib, "calibration_s": {"data": round(t_data, 3),
                                                    "commit": round(t_commit, 3),
                                                    "total": round(t_total, 3)}})
    assert run.losses == 0, run.problems
    assert run.tried == len(schedule) + scale(2, 30)
    if FULL:  # the schedule must really have hit the phases it is meant to
        phases = {p.split(": ", 1)[1] for p in run.phases}
        assert {"shards on disk, no .metadata yet", ".metadata in place, not committed",
                "manifest renamed into place"} <= phases, run.phases


@pytest.mark.timeout(scale(200, 900))
def test_crash_points_during_replication(mounts: MountFactory, trainer: Trainer,
                                         token_file: Path, etcd_server: Etcd) -> None:
    """Two nodes: a committed step is being streamed from node0 to node1 when the sender or
    the receiver is killed; after its restart both nodes serve every committed step whole,
    and the interrupted replication completes."""
    started = time.monotonic()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    for node_id in cluster.ports:
        cluster.start(node_id)
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    node0 = cluster.nodes["node0"]
    run = CrashRun(mounts, node0, trainer, mib=scale(12, 16))

    def replicated(relpath: str) -> bool:
        return (cluster.nodes["node1"].ram_dir / "tree" / relpath / mf.MANIFEST_NAME).exists()

    t_repl = max(calibrate(run, replicated) for _ in range(2))
    points = spread(scale(2, 30), 1.3 * t_repl)
    hits: Counter[str] = Counter()
    for i, delay in enumerate(points):
        victim = ("node0", "node1")[i % 2]
        run.mnt = cluster.nodes["node0"]
        relpath, seed = save_until_committed(run)
        time.sleep(delay)
        cluster.nodes[victim].kill9()
        hits[f"{victim} killed, replica {'complete' if replicated(relpath) else 'partial'}"] \
            += 1
        done = run.trainer.expect("done")
        cluster.start(victim)
        run.mnt = cluster.nodes["node0"]
        run.record(f"replication, {victim} killed", relpath, "step committed", done, seed,
                   None)
        # every step the writer holds reaches node1 again, whole, and node1 serves it
        wait_until(lambda r=relpath: cluster.nodes["node0"].step(r)["replicas"] == ["node1"],
                   timeout=60, interval=0.2)
        for path, (_seed, saved) in run.expected.items():
            problems = step_problems(cluster.nodes["node1"], path, saved)
            if problems:
                run.losses += 1
                run.problems += problems
    report("crash_points_replication",
           {**run.counts(), "kills": dict(hits), "seconds": round(time.monotonic() - started, 1),
            "state_mib": run.mib, "replication_s": round(t_repl, 3)})
    assert run.losses == 0, run.problems


@pytest.mark.timeout(scale(200, 900))
def test_crash_points_during_upload(mounts: MountFactory, trainer: Trainer,
                                    s3_server: SeaweedS3, bucket: str,
                                    s3_env: dict[str, str]) -> None:
    """A committed step is being uploaded to S3 when the daemon is killed: after the restart
    every step is whole in RAM; the store holds each step whole or without its manifest (never
    listed) at every kill; after a flush every step is in the store, and a fresh node with an
    empty RAM dir lists exactly the complete steps and reads them byte-identical."""
    started = time.monotonic()
    client = s3_server.client()
    args = ("--persist", f"s3://{bucket}/ckpt", "--s3-endpoint", s3_server.endpoint)
    run = CrashRun(mounts, mounts.mount(*args, env=s3_env), trainer, mib=scale(6, 8),
                   env=s3_env)

    def in_store(relpath: str) -> dict[str, int]:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"ckpt/{relpath}/")
        return {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in listing.get("Contents", [])}

    def store_problems() -> list[str]:
        """Every step whose manifest object is in the store has all its files, whole."""
        problems = []
        for relpath in [f"run/step_{n}" for n in range(1, run.number + 1)]:
            objects = in_store(relpath)
            if mf.MANIFEST_NAME not in objects:
                continue
            body = client.get_object(Bucket=bucket, Key=f"ckpt/{relpath}/{mf.MANIFEST_NAME}")
            manifest = mf.decode(body["Body"].read())
            for entry in manifest.files:
                if objects.get(entry.name) != entry.size:
                    problems.append(f"store: {relpath}/{entry.name} incomplete but the "
                                    "manifest is there")
        return problems

    t_upload = max(calibrate(run, lambda r: mf.MANIFEST_NAME in in_store(r))
                   for _ in range(2))
    hits: Counter[str] = Counter()
    for delay in spread(scale(2, 30), 1.3 * t_upload):
        relpath, seed = save_until_committed(run)
        time.sleep(delay)
        run.kill_daemon()
        objects = in_store(relpath)
        hits["manifest uploaded" if mf.MANIFEST_NAME in objects else
             f"{len(objects)} files uploaded, no manifest"] += 1
        problems = store_problems()
        run.losses += len(problems)
        run.problems += problems
        done = run.trainer.expect("done")
        run.restart()
        run.record("upload", relpath, "step committed", done, seed, None)
    from tests.conftest import tierfs

    tierfs("flush", str(run.mnt.mountpoint), "--timeout", "120", env=s3_env)
    problems = store_problems()
    complete = {f"run/step_{n}" for n in range(1, run.number + 1)
                if mf.MANIFEST_NAME in in_store(f"run/step_{n}")}
    assert set(run.expected) <= complete
    fresh = mounts.mount(*args, env=s3_env)
    listed = {s["path"] for s in fresh.status()["steps"]}
    if listed != complete:
        problems.append(f"a fresh node lists {sorted(listed)}, the store holds "
                        f"{sorted(complete)} whole")
    for relpath, (_seed, saved) in run.expected.items():
        problems += step_problems(fresh, relpath, saved)
    run.losses += len(problems)
    run.problems += problems
    report("crash_points_upload",
           {**run.counts(), "kills": dict(hits), "seconds": round(time.monotonic() - started, 1),
            "state_mib": run.mib, "upload_s": round(t_upload, 3)})
    assert run.losses == 0, run.problems
