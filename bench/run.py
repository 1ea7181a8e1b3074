"""tierfs benchmark: unmodified DCP and torch.save against a tierfs mount, a tmpfs directory (the
machine's physical limit), a local-disk directory, and direct S3 (s3torchconnector), on the same
SeaweedFS endpoint tierfs persists to.

Runs are interleaved (tierfs, tmpfs, disk, s3, tierfs, ...) and repeated; medians are reported,
with each target's ratio to tmpfs computed pair by pair within a repetition, so that machine
noise cancels. Writes a Markdown table, a JSON file and a PNG chart into --out.

    python bench/run.py --size 2G --reps 3 --out bench/results      # make bench
    python bench/run.py --size 256M --reps 2 --out bench/results    # make bench-quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierfs.mount_helper.config import parse_size
from tierfs.mount_helper.seaweed import SeaweedS3

TARGETS = ("tierfs", "tmpfs", "disk", "s3")
BUCKET = "tierfs-bench"


def transformer_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """A state dict shaped like a transformer plus Adam: a few large matrices, many small
    vectors, and two moments per parameter."""
    params: dict[str, torch.Tensor] = {}
    hidden = 1024
    layer_bytes = 12 * hidden * hidden * 4 * 3  # weights + Adam exp_avg + exp_avg_sq
    layers = max(1, total_bytes // layer_bytes)
    generator = torch.Generator().manual_seed(0)
    for layer in range(layers):
        for name, shape in (("attn.qkv", (3 * hidden, hidden)), ("attn.out", (hidden, hidden)),
                            ("mlp.up", (4 * hidden, hidden)), ("mlp.down", (hidden, 4 * hidden)),
                            ("ln1", (hidden,)), ("ln2", (hidden,))):
            weight = torch.randn(shape, generator=generator)
            params[f"layers.{layer}.{name}"] = weight
            params[f"optim.{layer}.{name}.exp_avg"] = torch.randn(shape, generator=generator)
            params[f"optim.{layer}.{name}.exp_avg_sq"] = torch.rand(shape, generator=generator)
    return params


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="tierfs-bench-"))
        self.ram_dir = Path("/dev/shm") / f"tierfs-bench-{os.getpid()}"
        self.tmpfs = Path("/dev/shm") / f"tierfs-bench-tmpfs-{os.getpid()}"
        self.disk = self.work / "disk"
        self.mount = self.work / "mnt"
        self.s3 = SeaweedS3(self.work / "seaweed", volumes=2000)  # room for every run's data
        self.pid = 0

    def __enter__(self) -> Bench:
        self.s3.start()
        self.s3.client().create_bucket(Bucket=BUCKET)
        os.environ.update(AWS_ACCESS_KEY_ID=self.s3.access_key,
                          AWS_SECRET_ACCESS_KEY=self.s3.secret_key,
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=self.s3.endpoint)
        for directory in (self.tmpfs, self.disk, self.mount):
            directory.mkdir(parents=True)
        self._tierfs("mount", str(self.mount), "--ram-dir", str(self.ram_dir),
                     "--log-file", str(Path(self.args.out).absolute() / "tierfs.log"),
                     "--ram-limit",
                     "16G", "--persist", f"s3://{BUCKET}/tierfs", "--s3-endpoint",
                     self.s3.endpoint)
        self.pid = json.loads(self._tierfs("status", str(self.mount), "--json"))["pid"]
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)
        self.s3.stop()
        for path in (self.ram_dir, self.tmpfs, self.work):
            shutil.rmtree(path, ignore_errors=True)

    def _tierfs(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                              text=True)
        if done.returncode != 0:
            log = Path(self.args.out) / "tierfs.log"
            tail = log.read_text().splitlines()[-15:] if log.exists() else []
            raise RuntimeError(f"tierfs {args[0]}: {done.stderr.strip()}\n" + "\n".join(tail))
        return done.stdout

    def location(self, target: str, name: str) -> str:
        return {"tierfs": str(self.mount / "run" / name), "tmpfs": str(self.tmpfs / name),
                "disk": str(self.disk / name), "s3": f"s3://{BUCKET}/direct/{name}"}[target]

    def writer(self, target: str, name: str, threads: int) -> Any:
        if target == "s3":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageWriter

            return S3StorageWriter(region="us-east-1", path=self.location(target, name),
                                   s3client_config=S3ClientConfig(force_path_style=True),
                                   thread_count=threads)
        return dcp.FileSystemWriter(self.location(target, name), thread_count=threads)

    def reader(self, target: str, name: str) -> Any:
        if target == "s3":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader

            return S3StorageReader(region="us-east-1", path=self.location(target, name),
                                   s3client_config=S3ClientConfig(force_path_style=True))
        return dcp.FileSystemReader(self.location(target, name))

    def drop(self, target: str, name: str) -> None:
        """Remove what a run wrote, so the next repetition starts alike (RAM is finite)."""
        path = self.location(target, name)
        if target == "s3":
            client = self.s3.client()
            prefix = f"direct/{name}/"
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                         Prefix=prefix):
                for item in page.get("Contents", []):
                    client.delete_object(Bucket=BUCKET, Key=item["Key"])
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)

    def wait_persisted(self, step: str) -> float:
        started = time.monotonic()
        while time.monotonic() - started < 600:
            status = json.loads(self._tierfs("status", str(self.mount), "--json"))
            entry = next((s for s in status["steps"] if s["path"] == f"run/{step}"), None)
            if entry and entry["persisted"]:
                return time.monotonic() - started
            time.sleep(0.05)
        raise TimeoutError(f"run/{step} was not persisted within 600 s")


def timed(func: Callable[[], object]) -> float | BaseException:
    started = time.perf_counter()
    try:
        func()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return exc
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    state = transformer_state(parse_size(args.size))
    size = state_bytes(state)
    fresh = {k: torch.empty_like(v) for k, v in state.items()}
    results: dict[str, dict[str, list[float]]] = {}
    persist_seconds: list[float] = []

    failures: list[str] = []

    def record(workload: str, target: str, seconds: float | BaseException) -> None:
        if isinstance(seconds, BaseException):  # one failed run is reported, not fatal
            failures.append(f"{workload} on {target}: {type(seconds).__name__}: "
                            f"{str(seconds).strip().splitlines()[-1][:200]}")
            print(f"FAILED {failures[-1]}", flush=True)
            return
        results.setdefault(workload, {}).setdefault(target, []).append(seconds)

    with Bench(args) as bench:
        for rep in range(args.reps):
            for target in TARGETS:
                for threads in (1, 4):
                    name = f"step_{rep * 10 + threads}"
                    seconds = timed(lambda t=target, n=name, th=threads: dcp.save(
                        state, storage_writer=bench.writer(t, n, th)))
                    record(f"DCP save, {threads} thread(s)", target, seconds)
                    if target == "tierfs" and threads == 4 and isinstance(seconds, float):
                        try:
                            persist_seconds.append(bench.wait_persisted(name))
                        except TimeoutError as exc:
                            record("committed -> persisted", target, exc)
                    record(f"DCP load ({threads}-thread save)", target,
                           timed(lambda t=target, n=name: dcp.load(
                               fresh, storage_reader=bench.reader(t, n))))
                    bench.drop(target, name)
                name = f"step_{rep * 10 + 5}"
                future_holder: list[Any] = []
                record("DCP async_save, blocking part", target,
                       timed(lambda t=target, n=name, f=future_holder: f.append(dcp.async_save(
                           state, storage_writer=bench.writer(t, n, 1)))))
                if future_holder:
                    try:
                        future_holder[0].result()
                    except BaseException as exc:  # noqa: BLE001 - reported like the others
                        record("DCP async_save, blocking part", target, exc)
                bench.drop(target, name)
                if target != "s3":
                    path = bench.location(target, f"model_{rep}.pt")
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    record("torch.save", target, timed(lambda p=path: torch.save(state, p)))
                    record("torch.load", target,
                           timed(lambda p=path: torch.load(p, weights_only=True)))
                    bench.drop(target, f"model_{rep}.pt")
            print(f"repetition {rep + 1} of {args.reps} done", flush=True)
        rss = _rss_kib(bench.pid)
    return {"bytes": size, "reps": args.reps, "results": results, "failures": failures,
            "persist_seconds": persist_seconds, "daemon_rss_kib": rss,
            "machine": _machine()}


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def _machine() -> str:
    cpus = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpus} cores, {memory:.0f} GiB RAM, Linux {os.uname().release}, "
            f"torch {torch.__version__}")


def report(data: dict[str, Any], out: Path) -> str:
    size = data["bytes"]
    lines = [f"Checkpoint: {size / 2**30:.2f} GiB, {data['reps']} interleaved repetitions; "
             f"machine: {data['machine']}.", "",
             "| workload | " + " | ".join(TARGETS) + " | tierfs / tmpfs |",
             "|---|" + "---|" * (len(TARGETS) + 1)]
    for workload, by_target in data["results"].items():
        cells = []
        for target in TARGETS:
            times = by_target.get(target)
            if not times:
                cells.append("-")
                continue
            median = statistics.median(times)
            cells.append(f"{median:.2f} s ({size / median / 2**30:.2f} GiB/s)")
        tier, tmp = by_target.get("tierfs"), by_target.get("tmpfs")
        ratio = "-"
        if tier and tmp:
            # throughput ratio per repetition, then the median: noise common to a pair cancels
            ratio = f"{statistics.median(b / a for a, b in zip(tier, tmp, strict=False)):.2f}x"
        lines.append(f"| {workload} | " + " | ".join(cells) + f" | {ratio} |")
    persist = statistics.median(data["persist_seconds"]) if data["persist_seconds"] else 0
    lines += ["", f"committed -> persisted (SeaweedFS on loopback): median {persist:.2f} s "
              f"after the save returned; daemon RSS at the end: "
              f"{data['daemon_rss_kib'] / 1024:.0f} MiB (stored data lives in tmpfs files, "
              "not in the daemon)."]
    if data["failures"]:
        lines += ["", "Failed runs (left out of the medians):"]
        lines += [f"- {failure}" for failure in data["failures"]]
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(data, indent=2))
    _chart(data, out / "results.png")
    return table


def _chart(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = list(data["results"])
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.2
    for i, target in enumerate(TARGETS):
        speeds = [data["bytes"] / statistics.median(data["results"][w][target]) / 2**30
                  if data["results"][w].get(target) else 0 for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], speeds, width, label=target)
    ax.set_xticks([x + 1.5 * width for x in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"tierfs vs tmpfs, disk and direct S3: {data['bytes'] / 2**30:.2f} GiB checkpoint")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2G", help="checkpoint size (default 2G)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--out", default="bench/results", help="where results go")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(report(run(args), out))


if __name__ == "__main__":
    main()
