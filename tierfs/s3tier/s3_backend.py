"""The S3 backend (boto3): any S3-compatible store, AWS's credential chain, path-style
addressing when an endpoint is given. Files larger than a part go up as multipart uploads, each
part a request of its own (`start_parts`, `put_part`, `finish_parts`) streamed from the file,
so that memory stays bounded whatever the file size and the uploader can retry a refused part
alone: retrying a whole file needs every one of its requests to pass at once, which under
steady throttling (SlowDown) a file of many parts never does.

Every request that sends a file's bytes runs in a pool of threads per backend, shared by every
file being uploaded at once, at a lower CPU priority (`UPLOAD_NICE`): a training job's loads and
compute on the same node come first, and uploads take the CPU left over (issue 14: a load during
an upload ran at 0.44x tmpfs). Parts and files larger than `SMALL_FILE` run `PARALLEL_PARTS` at
a time; small files in a pool of `SMALL_IN_FLIGHT` of their own, whose bytes in flight stay
as few, and whose round trips overlap.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bce
from botocore.config import Config
from botocore.utils import determine_content_length
from s3transfer.utils import ReadFileChunk

from tierfs.s3tier.interface import (
    SMALL_FILE,
    SMALL_IN_FLIGHT,
    Backend,
    BackendError,
    NotFound,
    ObjectInfo,
    UploadGone,
)

T = TypeVar("T")

PART_SIZE = 16 << 20
COPY_WHOLE_MAX = 5 << 30  # S3's limit of one CopyObject; larger objects copy in parts
COPY_PART_SIZE = 1 << 30
PARALLEL_PARTS = 4
UPLOAD_NICE = 10  # added to the daemon's nice value for the upload threads


def _lower_priority() -> None:
    """Run the calling thread at a lower priority (Linux: nice is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + UPLOAD_NICE))


class _UploadThreads(concurrent.futures.ThreadPoolExecutor):
    """Threads that send files' bytes, at a lower priority (see the module docstring)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, thread_name_prefix="tierfs-upload",
                         initializer=_lower_priority)


def _no_wait_for_small(params: dict[str, Any], model: Any, **_kwargs: Any) -> None:
    """No `Expect: 100-continue` on a PutObject of a small body (botocore asks it of every
    body): the store's answer to the headers is a round trip more before the bytes, most of a
    small file's time, to save sending at most SMALL_FILE bytes to a store that refuses them.
    Runs after botocore's handler, which adds it."""
    if model.name != "PutObject":
        return
    length = determine_content_length(params.get("body"))
    if length is not None and length <= SMALL_FILE:
        params["headers"].pop("Expect", None)


# Error codes that retrying can fix; everything else (NoSuchBucket, AccessDenied, ...) is final.
_TEMPORARY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                    "503", "500", "502", "504"}
_TEMPORARY_EXCEPTIONS = (bce.EndpointConnectionError, bce.ConnectionClosedError,
                         bce.ReadTimeoutError, bce.ConnectTimeoutError,
                         bce.ResponseStreamingError, ConnectionError, TimeoutError)


class S3Backend(Backend):
    def __init__(self, bucket: str, prefix: str, endpoint: str | None) -> None:
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        self.url = f"s3://{bucket}/{prefix}"
        config = Config(
            # No SHA-256 of every byte sent for the request's signature: botocore signs the
            # payload over plain http unless told not to (a fifth of the upload's CPU in the
            # bench's profile); the body is still checked by the request's CRC32 checksum,
            # and every byte read back by its xxh3. Over https this is botocore's default.
            s3={"addressing_style": "path" if self.endpoint else "auto",
                "payload_signing_enabled": False},
            # One attempt per call: tierfs.s3tier.retry's policy retries every backend call
            # (botocore's would multiply the attempts, retry silently, and could not tell an
            # upload that is no longer wanted; standard mode with one attempt retries nothing).
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=5, read_timeout=30,
            max_pool_connections=SMALL_IN_FLIGHT + PARALLEL_PARTS * 4,
        )
        # A session of its own: credentials are resolved for this backend, not cached globally.
        self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint,
                                                      config=config)
        self._client.meta.events.register_last("before-call.s3", _no_wait_for_small)
        self.part_size = PART_SIZE
        self.copy_whole_max, self.copy_part_size = COPY_WHOLE_MAX, COPY_PART_SIZE
        # {small files?: threads}, made at first use: after a daemon forks
        self._threads: dict[bool, _UploadThreads] = {}
        self._threads_lock = threading.Lock()

    def _key(self, key: str) -> str:
        return self.prefix + key

    def check(self) -> bool:
        with self._errors("bucket " + self.bucket):
            self._client.head_bucket(Bucket=self.bucket)
        with self._errors("listing " + (self.prefix or "/")):
            reply = self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix,
                                                 MaxKeys=1)
        return not reply.get("Contents")

    def claim(self) -> None:
        """Nothing to mark: a prefix's objects say it was used, and a bucket does not come
        and go as a volume does."""

    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        """Any size in this one call: a file larger than a part goes up in parts, in parallel
        (the uploader sends parts itself, to retry each alone)."""
        path = os.fsdecode(path)
        with self._errors(key):
            size = os.stat(path).st_size
        if size <= self.part_size:
            self._in_upload_thread(self._put_whole, key, path, small=size <= SMALL_FILE)
            return
        upload_id = self.start_parts(key)
        try:
            pieces = [self._upload_threads().submit(self._put_part, key, upload_id, number,
                                                    path, offset, length)
                      for number, offset, length in self.parts(size)]
            self.finish_parts(key, upload_id, [piece.result() for piece in pieces])
        except BaseException:
            with contextlib.suppress(BackendError):
                self.abandon_parts(key, upload_id)
            raise

    def _put_whole(self, key: str, path: str) -> None:
        with self._errors(key), open(path, "rb") as body:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body)

    def start_parts(self, key: str) -> str:
        with self._errors(key):
            # CRC32 for every part, as boto3's transfer manager asks for by default.
            reply = self._client.create_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), ChecksumAlgorithm="CRC32")
        return str(reply["UploadId"])

    def put_part(self, key: str, upload_id: str, number: int,
                 path: str | bytes | os.PathLike[str], offset: int, length: int) -> object:
        return self._in_upload_thread(self._put_part, key, upload_id, number,
                                      os.fsdecode(path), offset, length)

    def _put_part(self, key: str, upload_id: str, number: int, path: str, offset: int,
                  length: int) -> dict[str, Any]:
        with self._errors(f"{key} part {number}"), ReadFileChunk.from_filename(
                path, offset, length, enable_callbacks=False) as body:
            reply = self._client.upload_part(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, PartNumber=number,
                Body=body, ChecksumAlgorithm="CRC32")
        receipt = {"ETag": reply["ETag"], "PartNumber": number}
        if "ChecksumCRC32" in reply:
            receipt["ChecksumCRC32"] = reply["ChecksumCRC32"]
        return receipt

    def finish_parts(self, key: str, upload_id: str, receipts: Sequence[object]) -> None:
        with self._errors(key):
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id,
                MultipartUpload={"Parts": list(receipts)})

    def abandon_parts(self, key: str, upload_id: str) -> None:
        with self._errors(key):
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key),
                                                UploadId=upload_id)

    def _upload_threads(self, small: bool = False) -> _UploadThreads:
        """The pool a request that sends a file's bytes runs in: the small files' or the
        others'."""
        with self._threads_lock:
            if small not in self._threads:
                self._threads[small] = _UploadThreads(SMALL_IN_FLIGHT if small else PARALLEL_PARTS)
            return self._threads[small]

    def _in_upload_thread(self, func: Callable[..., T], *args: object, small: bool = False) -> T:
        return self._upload_threads(small).submit(func, *args).result()

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def copy(self, source: str, key: str) -> None:
        origin = {"Bucket": self.bucket, "Key": self._key(source)}
        with self._errors(source):
            size = int(self._client.head_object(**origin)["ContentLength"])
        if size <= self.copy_whole_max:
            with self._errors(f"copy of {source} to {key}"):
                self._client.copy_object(Bucket=self.bucket, Key=self._key(key),
                                         CopySource=origin)
            return
        with self._errors(key):  # no checksum asked for: the parts are copies, not sent
            upload_id = str(self._client.create_multipart_upload(
                Bucket=self.bucket, Key=self._key(key))["UploadId"])
        try:
            receipts = []
            for number, offset in enumerate(range(0, size, self.copy_part_size), 1):
                last = min(size, offset + self.copy_part_size) - 1
                with self._errors(f"copy of {source} to {key} part {number}"):
                    reply = self._client.upload_part_copy(
                        Bucket=self.bucket, Key=self._key(key), UploadId=upload_id,
                        PartNumber=number, CopySource=origin,
                        CopySourceRange=f"bytes={offset}-{last}")
                receipts.append({"ETag": reply["CopyPartResult"]["ETag"],
                                 "PartNumber": number})
            self.finish_parts(key, upload_id, receipts)
        except BaseException:
            with contextlib.suppress(BackendError):
                self.abandon_parts(key, upload_id)
            raise

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        span = f"bytes={offset}-" if length < 0 else f"bytes={offset}-{offset + length - 1}"
        with self._errors(key):
            reply = self._client.get_object(Bucket=self.bucket, Key=self._key(key), Range=span)
            return reply["Body"].read()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._errors("listing " + (prefix or "/")):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][len(self.prefix):], item["Size"])

    def size(self, key: str) -> int | None:
        try:
            with self._errors(key):
                reply = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except NotFound:
            return None
        return int(reply["ContentLength"])

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            with self._errors("deleting objects"):
                reply = self._client.delete_objects(Bucket=self.bucket,
                                                    Delete={"Objects": batch, "Quiet": True})
            failed = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise BackendError(f"delete of {failed[0]['Key']} failed: {failed[0]['Code']}",
                                   temporary=True)

    def _errors(self, what: str) -> _Translate:
        return _Translate(self, what)


class _Translate:
    """Turns boto3's many exception types into BackendError with the right `temporary`."""

    def __init__(self, backend: S3Backend, what: str) -> None:
        self.backend = backend
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, _tb: object) -> bool:
        if exc is None or isinstance(exc, BackendError):
            return False
        cause = exc
        # In case a library wraps the real error (boto3's transfer manager did).
        while cause.__cause__ is not None and not isinstance(cause, bce.ClientError):
            cause = cause.__cause__
        where = f"{self.backend.url}: {self.what}"
        if isinstance(cause, bce.ClientError):
            error = cause.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "NoSuchUpload":
                raise UploadGone(f"{where}: the multipart upload is gone (NoSuchUpload)") \
                    from None
            if code == "NoSuchBucket" or (status == 404 and self.what.startswith("bucket ")):
                raise BackendError(f"{self.backend.url}: bucket {self.backend.bucket} does not "
                                   "exist", temporary=False) from None
            if code in ("NoSuchKey", "404") or status == 404:
                raise NotFound(self.what) from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise BackendError(f"{where}: access denied ({code}): check the credentials",
                                   temporary=False) from None
            temporary = code in _TEMPORARY_CODES or status >= 500
            raise BackendError(f"{where}: {code or status} {error.get('Message', '')}".strip(),
                               temporary=temporary) from None
        if isinstance(cause, bce.NoCredentialsError):
            raise BackendError(f"{where}: no AWS credentials found", temporary=False) from None
        if isinstance(cause, _TEMPORARY_EXCEPTIONS) or isinstance(exc, _TEMPORARY_EXCEPTIONS):
            raise BackendError(f"{where}: {cause}", temporary=True) from None
        if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
            raise BackendError(f"{where}: {exc}", temporary=False) from None
        raise BackendError(f"{where}: {type(cause).__name__}: {cause}", temporary=True) from None
