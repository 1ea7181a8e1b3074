"""The persistent tier on a real S3 server (SeaweedFS): a DCP checkpoint written through the
mount reaches S3 as plain objects plus a manifest, loads back through the mount after leaving
RAM, loads with s3torchconnector and with FileSystemReader after a plain download, survives an
S3 outage, and mount-time mistakes are one clear line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tests.conftest import MountFactory, tierfs, wait_until
from tests.test_crash import save
from tests.test_torch import assert_state_equal
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = [pytest.mark.fuse, pytest.mark.filterwarnings("ignore::UserWarning")]


def training_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"embedding": torch.randn(2048, 1024, generator=generator),  # 8 MiB
            "head.weight": torch.randn(1024, 256, generator=generator),
            "step": torch.tensor([seed])}


def persist_args(s3: SeaweedS3, bucket: str, *extra: str) -> list[str]:
    return ["--persist", f"s3://{bucket}/ckpt", "--s3-endpoint", s3.endpoint, *extra]


def test_dcp_checkpoint_through_s3_and_back(mounts: MountFactory, s3_server: SeaweedS3,
                                            bucket: str, s3_env: dict[str, str],
                                            tmp_path: Path) -> None:
    mnt = mounts.mount(*persist_args(s3_server, bucket, "--keep-ram", "1"), env=s3_env)
    states = {n: training_state(n) for n in (100, 200)}
    for number, state in states.items():
        dcp.save(state, storage_writer=FileSystemWriter(mnt / f"run/step_{number}",
                                                         thread_count=2))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)
    client = s3_server.client()
    keys = {o["Key"]: o["Size"] for o in
            client.list_objects_v2(Bucket=bucket, Prefix="ckpt/run/step_100/")["Contents"]}
    assert "ckpt/run/step_100/.tierfs-manifest" in keys and "ckpt/run/step_100/.metadata" in keys
    step = mnt.step("run/step_100")
    assert step["persisted"] and not step["ram"]  # --keep-ram 1: only step_200 stays in RAM
    for name in os.listdir(mnt / "run/step_100"):
        body = client.get_object(Bucket=bucket, Key=f"ckpt/run/step_100/{name}")["Body"].read()
        assert body == (mnt / "run/step_100" / name).read_bytes()  # fetched back, verified

    # loads back through the mount after it left RAM
    restored = {k: torch.zeros_like(v) for k, v in states[100].items()}
    dcp.load(restored, storage_reader=FileSystemReader(mnt / "run/step_100"))
    assert_state_equal(states[100], restored)

    # plain download of the objects, then the stock FileSystemReader, without tierfs
    local = tmp_path / "download"
    local.mkdir()
    for key in keys:
        if not key.endswith(".tierfs-manifest"):
            client.download_file(bucket, key, str(local / key.rsplit("/", 1)[1]))
    restored = {k: torch.zeros_like(v) for k, v in states[100].items()}
    dcp.load(restored, storage_reader=FileSystemReader(local))
    assert_state_equal(states[100], restored)


def test_s3torchconnector_reads_a_persisted_step(mounts: MountFactory, s3_server: SeaweedS3,
                                                 bucket: str, s3_env: dict[str, str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    mnt = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    state = training_state(7)
    dcp.save(state, storage_writer=FileSystemWriter(mnt / "job/step_7"))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL"):
        monkeypatch.setenv(name, s3_env[name])
    reader = S3StorageReader(region="us-east-1", path=f"s3://{bucket}/ckpt/job/step_7",
                             s3client_config=S3ClientConfig(force_path_style=True))
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=reader)
    assert_state_equal(state, restored)


def test_s3_outage_during_upload_loses_nothing(mounts: MountFactory, s3_env: dict[str, str],
                                              tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "outage") as s3:
        s3.client().create_bucket(Bucket="outage-test")
        env = dict(s3_env, AWS_ENDPOINT_URL=s3.endpoint)
        mnt = mounts.mount(*persist_args(s3, "outage-test", "--keep-ram", "1"), env=env)
        files = {n: {"shard": os.urandom(48 << 20), ".metadata": b"m%d" % n} for n in (1, 2)}
        save(mnt / "run/step_1", files[1])
        s3.stop()  # S3 goes away while step_1 is being uploaded
        save(mnt / "run/step_2", files[2])
        # until the uploader failed a few times against the dead endpoint (its status says)
        wait_until(lambda: (mnt.step("run/step_1")["persist_wait"] or {}).get("failures", 0)
                   >= 2, timeout=30, interval=0.1)
        status = {s["path"]: s for s in mnt.status()["steps"]}
        assert not status["run/step_1"]["persisted"] and status["run/step_1"]["ram"]
        assert mnt.status()["persist"]["pending_steps"] == 2
        assert (mnt / "run/step_1/shard").read_bytes() == files[1]["shard"]
        s3.start()
        tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=env)
        assert "retrying" in mnt.log()
        client = s3.client()
        for number, content in files.items():
            for name, data in content.items():
                body = client.get_object(Bucket="outage-test",
                                         Key=f"ckpt/run/step_{number}/{name}")["Body"].read()
                assert body == data
        wait_until(lambda: not mnt.step("run/step_1")["ram"])  # safe in S3: may leave RAM
        assert (mnt / "run/step_1/shard").read_bytes() == files[1]["shard"]


def test_mount_time_s3_mistakes(mounts: MountFactory, s3_server: SeaweedS3, bucket: str,
                                s3_env: dict[str, str], tmp_path: Path) -> None:
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    ram = str(mounts.new_ram_dir())

    def refused(env: dict[str, str], *args: str) -> str:
        done = tierfs("mount", str(mountpoint), "--ram-dir", ram, *args, check=False, env=env)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        return done.stderr

    assert "bucket no-such-bucket does not exist" in refused(
        s3_env, *persist_args(s3_server, "no-such-bucket"))
    assert "access denied" in refused(dict(s3_env, AWS_SECRET_ACCESS_KEY="wrong"),
                                      *persist_args(s3_server, bucket))
    assert "unreachable" in refused(s3_env, "--persist", f"s3://{bucket}/x",
                                    "--s3-endpoint", "http://127.0.0.1:9")
