"""Which S3 client should upload a committed step? One run, same SeaweedFS, same files:

* `classic`: boto3's classic client as `S3Backend.put_file` uses it now (its own multipart
  upload: 16 MiB parts streamed from the file, 4 requests in flight in all, low-priority
  threads) and its transfer manager as tierfs used it before issue 14 (a manager per file, 4
  parts per file), 4 files at once as the uploader sends them;
* `boto3-crt`: boto3's `TransferConfig(preferred_transfer_client="crt")` (needs `boto3[crt]`);
* `crt`: the same CRT transfer manager (`s3transfer.crt`) built for a custom endpoint;
* `s3torchconnector`: its client's streaming `put_object`, 4 files at once;
* `direct DCP save`: s3torchconnector's `S3StorageWriter`, 4 threads (the goal to meet).

For each: wall seconds, this process's CPU seconds (user + system, all threads) per GiB, and
the S3 server's (SeaweedFS shares this machine's cores: what it spends per GiB is what a client
costs the store).

    python bench/persist_clients.py --size 1G --files 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BUCKET = "persist-clients"
FILES_AT_ONCE = 4


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(label: str, size: int, store_pid: int,
            func: Callable[[], object]) -> dict[str, object]:
    from run import cpu_seconds as process_cpu_seconds  # bench/run.py, beside this script

    cpu, store, wall = cpu_seconds(), process_cpu_seconds(store_pid), time.perf_counter()
    try:
        func()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
        return {"client": label, "error": f"{type(exc).__name__}: {exc}"[:400]}
    wall = time.perf_counter() - wall
    cpu = cpu_seconds() - cpu
    store = process_cpu_seconds(store_pid) - store
    gib = size / 2**30
    return {"client": label, "seconds": wall, "gib_per_s": gib / wall, "cpu_s_per_gib": cpu / gib,
            "store_cpu_s_per_gib": store / gib}


def in_parallel(put: Callable[[Path, str], None], files: list[Path], prefix: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(FILES_AT_ONCE) as pool:
        for future in [pool.submit(put, path, f"{prefix}/{path.name}") for path in files]:
            future.result()


def main() -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from tierfs.devtools.seaweed import SeaweedS3
    from tierfs.mount_helper.config import parse_size
    from tierfs.s3tier.s3_backend import S3Backend

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="persist-clients-"))
    step = Path(tempfile.mkdtemp(prefix="persist-clients-", dir="/dev/shm"))
    files = []
    for i in range(args.files):
        path = step / f"__{i}_0.distcp"
        path.write_bytes(os.urandom(size // args.files))
        files.append(path)
    state = {f"t{i}": torch.randn(size // args.files // 4) for i in range(args.files)}
    s3 = SeaweedS3(work / "seaweed", volumes=2000)  # room for every client's copy
    s3.start()
    try:
        s3.client().create_bucket(Bucket=BUCKET)
        os.environ.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s3.endpoint)
        clients = _clients(S3Backend, s3.endpoint)
        store_pid = s3.pid
        assert store_pid is not None
        for rep in range(args.reps):
            for label, put in clients.items():
                print(measure(label, size, store_pid, lambda p=put, r=rep, n=label: in_parallel(
                    p, files, f"{_slug(n)}-{r}")), flush=True)
            print(measure("direct DCP save (S3StorageWriter, 4 threads)", size, store_pid,
                          lambda r=rep: dcp.save(state, storage_writer=_dcp_writer(r))),
                  flush=True)
    finally:
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(step, ignore_errors=True)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


def _dcp_writer(rep: int) -> object:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(region="us-east-1", path=f"s3://{BUCKET}/dcp-{rep}",
                           s3client_config=S3ClientConfig(force_path_style=True), thread_count=4)


def _clients(backend_class: type, endpoint: str) -> dict[str, Callable[[Path, str], None]]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    classic = backend_class(BUCKET, "", endpoint)
    clients: dict[str, Callable[[Path, str], None]] = {
        "classic boto3 (S3Backend.put_file)": lambda path, key: classic.put_file(key, path)}
    boto_client = boto3.client("s3", endpoint_url=endpoint)
    per_file = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20,
                              max_concurrency=4)

    def put_classic_per_file(path: Path, key: str) -> None:  # S3Backend before issue 14
        boto_client.upload_file(str(path), BUCKET, key, Config=per_file)

    clients["classic boto3, a transfer manager per file"] = put_classic_per_file
    boto_crt = TransferConfig(preferred_transfer_client="crt")

    def put_boto3_crt(path: Path, key: str) -> None:
        boto_client.upload_file(str(path), BUCKET, key, Config=boto_crt)

    try:
        clients["s3transfer CRT, custom endpoint"] = _crt_put(endpoint)
        clients["boto3 preferred_transfer_client=crt"] = put_boto3_crt
    except ImportError as exc:  # awscrt (boto3[crt]) is not among tierfs's dependencies
        print(f"skipped the CRT clients: {exc}", flush=True)
    clients["s3torchconnector put_object"] = _s3torch_put(endpoint)
    return clients


def _crt_put(endpoint: str) -> Callable[[Path, str], None]:
    import botocore.session
    from s3transfer.crt import (
        BotocoreCRTCredentialsWrapper,
        BotocoreCRTRequestSerializer,
        CRTTransferManager,
        create_s3_crt_client,
    )

    session = botocore.session.Session()
    credentials = BotocoreCRTCredentialsWrapper(session.get_credentials())
    crt_client = create_s3_crt_client("us-east-1", credentials.to_crt_credentials_provider(),
                                      use_ssl=endpoint.startswith("https"),
                                      part_size=16 << 20)
    serializer = BotocoreCRTRequestSerializer(session, {"region_name": "us-east-1",
                                                        "endpoint_url": endpoint})
    manager = CRTTransferManager(crt_client, serializer)

    def put(path: Path, key: str) -> None:
        manager.upload(str(path), BUCKET, key).result()

    return put


def _s3torch_put(endpoint: str) -> Callable[[Path, str], None]:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    client = S3Client("us-east-1", endpoint=endpoint,
                      s3client_config=S3ClientConfig(force_path_style=True))

    def put(path: Path, key: str) -> None:
        with open(path, "rb") as source, client.put_object(BUCKET, key) as sink:
            while chunk := source.read(16 << 20):
                sink.write(chunk)

    return put


if __name__ == "__main__":
    main()
