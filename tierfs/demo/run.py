"""`tierfs demo` (what `make demo` runs): a training job checkpoints through tierfs, the daemon
is killed with SIGKILL in the middle of a save, tierfs is mounted again on the same RAM dir and
the job resumes from `latest`, its loss curve carrying on where it was.

Everything goes through the real command line and unmodified torch DCP calls; the demo cleans up
after itself (lazy unmount, kill by pid, RAM dir removed) whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

TOTAL_STEPS = 300
SAVE_EVERY = 25
CRASH_AT = 175
BARS = " ▁▂▃▄▅▆▇█"


def _tierfs(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tierfs {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


def _banner(text: str) -> None:
    print(f"\n== {text}", flush=True)


class Job:
    """A small model (token embedding + MLP) trained with Adam; DCP checkpoints its whole state."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.features = torch.randn(4096, 64)
        self.tokens = torch.randint(0, 20_000, (4096,))
        self.targets = (self.features @ (torch.randn(64, 1) / 8)
                        + 0.3 * torch.sin(3 * self.features[:, :1]))
        self.embedding = torch.nn.Embedding(20_000, 128)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64 + 128, 512), torch.nn.Tanh(),
                                       torch.nn.Linear(512, 1))
        self.model = torch.nn.ModuleDict({"embedding": self.embedding, "mlp": self.mlp})
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.step = 0

    def train_step(self) -> float:
        torch = self.torch
        batch = torch.randint(0, len(self.features), (256,),
                              generator=torch.Generator().manual_seed(self.step))
        inputs = torch.cat([self.features[batch], self.embedding(self.tokens[batch])], dim=1)
        loss = torch.nn.functional.mse_loss(self.mlp(inputs), self.targets[batch])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def state(self) -> dict[str, object]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "step": self.torch.tensor(self.step)}

    def save(self, run_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state(), storage_writer=dcp.FileSystemWriter(run_dir / f"step_{self.step}"))

    def load(self, step_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp

        state = self.state()
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step = int(state["step"])


def _sparkline(losses: list[float]) -> str:
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    return "".join(BARS[1 + int((value - low) / span * (len(BARS) - 2))] for value in losses)


class DemoMount:
    """One tierfs mount for the demo, always torn down."""

    def __init__(self, mountpoint: Path, ram_dir: Path, options: list[str]) -> None:
        self.mountpoint = mountpoint
        self.mountpoint.mkdir(exist_ok=True)
        self.ram_dir = ram_dir
        self.options = options
        self.pid = 0

    def mount(self) -> None:
        started = time.monotonic()
        _tierfs("mount", str(self.mountpoint), "--ram-dir", str(self.ram_dir), *self.options)
        self.pid = self.status()["pid"]
        print(f"$ tierfs mount {self.mountpoint} --ram-dir {self.ram_dir} "
              f"{' '.join(self.options)}\n  (daemon pid {self.pid}, ready in "
              f"{time.monotonic() - started:.2f} s)")

    def status(self) -> dict:  # type: ignore[type-arg]
        return json.loads(_tierfs("status", str(self.mountpoint), "--json"))

    def show_status(self) -> None:
        print(f"$ tierfs status {self.mountpoint}")
        print(_tierfs("status", str(self.mountpoint)).rstrip())

    def kill9_when_exists(self, path: Path) -> None:
        """SIGKILL the daemon as soon as `path` appears (a save has begun), then lazy-unmount."""
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(self.pid, signal.SIGKILL)
        print(f"$ kill -9 {self.pid}; fusermount3 -u -z {self.mountpoint}")
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)

    def unmount(self) -> None:
        print(f"$ tierfs flush {self.mountpoint}")
        print(_tierfs("flush", str(self.mountpoint)).rstrip())
        _tierfs("umount", str(self.mountpoint))
        print(f"$ tierfs umount {self.mountpoint}")

    def cleanup(self) -> None:
        # lazily unmounted whether or not it still is mounted (then fusermount3 only complains)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.ram_dir, ignore_errors=True)


def run_demo() -> int:
    from tierfs.devtools.seaweed import SeaweedS3

    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="tierfs-demo-"))
    s3 = SeaweedS3(root / "seaweedfs")
    mounts: list[DemoMount] = []
    try:
        _banner("1. an S3 server (SeaweedFS on loopback) for the persistent tier")
        s3.start()
        s3.client().create_bucket(Bucket="tierfs-demo")
        os.environ.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
                          AWS_DEFAULT_REGION="us-east-1")
        print(f"S3 at {s3.endpoint}, bucket tierfs-demo (pid {s3.pid})")
        options = ["--ram-limit", "2G", "--persist", "s3://tierfs-demo/ckpt",
                   "--s3-endpoint", s3.endpoint, "--keep-ram", "2"]

        _banner("2. mount tierfs: RAM tier on tmpfs, every committed step persisted to S3, "
                "the newest 2 steps kept in RAM")
        fs = DemoMount(root / "checkpoints", Path("/dev/shm") / f"tierfs-demo-{os.getpid()}",
                       options)
        mounts.append(fs)
        fs.mount()
        run_dir = fs.mountpoint / "run1"
        _banner(f"3. train, DCP checkpoint every {SAVE_EVERY} steps into {run_dir}/step_N")
        job = Job()
        losses: list[float] = []
        while job.step < CRASH_AT:
            losses.append(job.train_step())
            if job.step % SAVE_EVERY == 0 and job.step < CRASH_AT:
                save_started = time.monotonic()
                job.save(run_dir)
                state = os.getxattr(run_dir / f"step_{job.step}", "user.tierfs.state").decode()
                print(f"step {job.step:3d}  loss {losses[-1]:.4f}  saved step_{job.step} in "
                      f"{1000 * (time.monotonic() - save_started):.0f} ms  ({state})")
        print()
        fs.show_status()

        _banner(f"4. step {CRASH_AT}: the tierfs daemon is killed with SIGKILL in the middle of "
                "the save")
        killer = threading.Thread(target=fs.kill9_when_exists,
                                  args=(run_dir / f"step_{CRASH_AT}" / "__0_0.distcp",))
        killer.start()
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            job.save(run_dir)
            print("the save had already finished when the daemon died")
        except (OSError, CheckpointException) as exc:  # DCP's error is a BaseException
            reason = "Transport endpoint is not connected" if "107" in str(exc) else exc
            print(f"the training job's save failed: {reason}")
        killer.join()
        curve_before = losses[:]
        del job

        _banner("5. mount again on the same RAM dir")
        fs.mount()
        fs.show_status()
        latest = os.readlink(run_dir / "latest")
        interrupted = run_dir / f"step_{CRASH_AT}"
        if latest == interrupted.name:
            print(f"latest -> {latest}   (the save finished just before the daemon died)")
        else:
            state = os.getxattr(interrupted, "user.tierfs.state").decode()
            print(f"latest -> {latest}   (the interrupted {interrupted.name} is '{state}', "
                  "never 'committed')")

        _banner(f"6. a new job resumes from {run_dir}/latest and trains to step {TOTAL_STEPS}")
        job = Job()
        job.load(run_dir / "latest")
        print(f"resumed at step {job.step}; the loss there was {curve_before[job.step - 1]:.4f}")
        losses = curve_before[:job.step]
        while job.step < TOTAL_STEPS:
            losses.append(job.train_step())
            if job.step % SAVE_EVERY == 0:
                job.save(run_dir)
                print(f"step {job.step:3d}  loss {losses[-1]:.4f}  saved step_{job.step}")
        every = [sum(losses[i:i + 6]) / len(losses[i:i + 6]) for i in range(0, len(losses), 6)]
        print(f"\nlog(loss), steps 1-{TOTAL_STEPS}, resumed after the crash at step "
              f"{int(latest.split('_')[-1])}: {_sparkline([math.log(v) for v in every])}")
        print(f"loss at step 1 {losses[0]:.4f}, at step {TOTAL_STEPS} {losses[-1]:.4f}")

        _banner("7. read an old step that has left RAM: fetched from S3 range by range, verified")
        _tierfs("flush", str(fs.mountpoint))  # uploads done: no eviction runs meanwhile
        old = Job()
        load_started = time.monotonic()
        old.load(run_dir / "step_50")
        print(f"loaded step_50 in {time.monotonic() - load_started:.2f} s: the ranges it read "
              "came from S3, each checked against the manifest's chunk checksums, and stay in "
              "RAM until the next eviction (--keep-ram 2)")
        fs.show_status()
        fs.unmount()

        _banner("8. a fresh node: empty RAM dir, same bucket; it finds the job's history")
        fresh = DemoMount(root / "fresh-node", Path("/dev/shm") / f"tierfs-demo-{os.getpid()}-b",
                          options)
        mounts.append(fresh)
        fresh.mount()
        fresh.show_status()
        restored = Job()
        restored.load(fresh.mountpoint / "run1/latest")
        same = all(restored.torch.equal(a, b) for a, b in
                   zip(restored.model.state_dict().values(), job.model.state_dict().values(),
                       strict=True))
        print(f"loaded run1/latest (step {restored.step}) from S3 on the fresh node: "
              f"{'identical to' if same else 'DIFFERENT FROM'} the job's final weights")
        fresh.unmount()
        s3.stop()

        cluster_ok = run_cluster_part(root, mounts)
        print(f"\ndemo finished in {time.monotonic() - started:.0f} s")
        return 0 if same and cluster_ok else 1
    finally:
        for mount in mounts:
            mount.cleanup()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)


def run_cluster_part(root: Path, mounts: list[DemoMount]) -> bool:
    """Three nodes on loopback, members of a cluster in a real etcd (started here, stopped by
    pid): a job saves on node0, node0 dies and is replaced by a fresh node with an empty RAM
    dir, and the job resumes there from the replicas."""
    from tierfs.devtools.etcd import Etcd

    first = len(mounts)
    with Etcd(root / "etcd") as etcd:
        try:
            return _cluster_demo(root, mounts, etcd.cluster_url("tierfs-demo"))
        finally:
            for node in mounts[first:]:  # gone before etcd stops
                node.cleanup()


def _cluster_demo(root: Path, mounts: list[DemoMount], cluster_url: str) -> bool:
    _banner("9. a 3-node cluster on loopback (membership and commits in etcd), each committed "
            "step copied to the next node")
    token = root / "cluster.token"
    with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(24).hex())  # private from its first byte
    from tierfs.devtools.local_server import free_ports

    ports = free_ports(3)  # distinct: all held open while chosen
    nodes = []
    for i in range(3):
        node = DemoMount(root / f"node{i}", Path("/dev/shm") / f"tierfs-demo-{os.getpid()}-n{i}",
                         ["--ram-limit", "1G", "--node-id", f"node{i}", "--cluster",
                          cluster_url, "--listen", f"127.0.0.1:{ports[i]}",
                          "--token-file", str(token), "--replicas", "1"])
        mounts.append(node)
        node.mount()
        nodes.append(node)
    job = Job()
    run_dir = nodes[0].mountpoint / "run2"
    while job.step < 100:
        job.train_step()
        if job.step % SAVE_EVERY == 0:
            job.save(run_dir)
            print(f"node0: saved run2/step_{job.step}")
    deadline = time.monotonic() + 30
    while not all(s["replicas"] for s in nodes[0].status()["steps"]):
        if time.monotonic() > deadline:
            print("replication did not finish in 30 s")
            return False
        time.sleep(0.1)
    nodes[2].show_status()
    print(f"$ kill -9 {nodes[0].pid}  (node0 is lost, RAM and all)")
    os.kill(nodes[0].pid, signal.SIGKILL)
    subprocess.run(["fusermount3", "-u", "-z", str(nodes[0].mountpoint)], capture_output=True)
    shutil.rmtree(nodes[0].ram_dir, ignore_errors=True)
    _banner("10. a replacement node0 with an empty RAM dir sees every step and resumes")
    nodes[0].mount()
    nodes[0].show_status()
    resumed = Job()
    load_started = time.monotonic()
    resumed.load(run_dir / "latest")
    same = all(resumed.torch.equal(a, b) for a, b in
               zip(resumed.model.state_dict().values(), job.model.state_dict().values(),
                   strict=True))
    print(f"resumed at step {resumed.step} from the replicas in "
          f"{time.monotonic() - load_started:.2f} s: "
          f"{'identical to' if same else 'DIFFERENT FROM'} the weights saved before the loss")
    while resumed.step < 125:
        resumed.train_step()
    resumed.save(run_dir)
    print(f"node0: saved run2/step_{resumed.step}")
    for node in nodes:
        _tierfs("umount", str(node.mountpoint))
    print("$ tierfs umount node0 node1 node2")
    return same
