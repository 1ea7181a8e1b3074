"""A thin typed wrapper over etcd v3 for trio, through etcd's JSON gateway (`/v3/`, etcd 3.4+)
spoken with httpx, which runs on trio: requests are cancelled cleanly, never left in a thread.

Endpoints are tried in order, starting with the last one that answered; when none answers the
call raises `EtcdUnavailable`, the one error callers are expected to ride out
(`retry_unavailable`). TLS (https, the server checked against --etcd-cacert, a client
certificate if etcd asks for one) and user/password auth come from `EtcdSecurity`: the auth
token etcd hands out is sent with every request and fetched again when etcd says it expired.
A TLS handshake that fails (a wrong CA, an expired certificate) is an `EtcdError`, not
unavailability: retrying cannot fix it.

Keys and values travel base64-encoded in JSON; callers see `str` keys and `bytes` values.
A watch is a long-lived streamed HTTP response read line by line; it resumes after the last
revision it delivered when the stream breaks (an etcd restart), so no event is lost or
repeated, unless etcd compacted that history meanwhile (`WatchCompacted`: read the prefix
again). `follow_prefix` packages that: a `Snapshot`, then batches of `WatchEvent`s.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import httpx
import trio

from tierfs.replication.certificates import dates_problem
from tierfs.replication.coordination.url import (  # noqa: F401  (re-exported: the etcd layer's one import)
    ClusterUrl,
    ClusterUrlError,
    Endpoint,
    EtcdSecurity,
    parse_cluster_url,
)
from tierfs.retry import RetryPolicy, retry

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_TIMEOUT = 2.0  # seconds per request; a lease of a few seconds must survive one timeout
PAGE_SIZE = 1000  # keys per range request: a 16,000-file step is read in pages, not one reply
# A watch stream silent this long is reopened (from where it was, so nothing is lost): a stream
# to an endpoint that vanished without closing the connection must not hang for hours.
WATCH_IDLE_REOPEN = 60.0
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
# Bytes of keys and values per transaction: etcd refuses requests over --max-request-bytes
# (1.5 MiB by default; the gateway sees them base64-encoded, 4/3 larger).
MAX_TXN_BYTES = 768 << 10
POOL_SIZE = 40  # connections kept to etcd for calls (watches have a pool of their own)
# The transactions of one call over many keys (`put_all`, `get_all`...) in flight at once: etcd
# syncs its log to disk once for the writes that reach it together, and one after the other
# each paid a disk sync of its own (the holders of a 20,000-file step added 2.9 s -> 1.85 s).
TXNS_AT_ONCE = 8
WATCH_POOL_SIZE = 16  # streams open at once (a daemon follows a handful of prefixes)
RETRY_FIRST_DELAY = 0.05
RETRY_MAX_DELAY = 1.0  # short: commits must resume within about a second of etcd coming back


GRPC_NOT_FOUND = 5  # etcd's status code for e.g. "requested lease not found"
GRPC_UNAUTHENTICATED = 16
# HTTP statuses of the gateway that mean "not now" (no leader, timed out), not a refusal
UNAVAILABLE_STATUSES = (408, 503, 504)


class EtcdError(Exception):
    """etcd answered, but refused or failed the request; `code` is its gRPC status code."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered (refused, timed out, or etcd has no leader)."""


class LeaseExpired(EtcdError):
    """The lease is gone (expired or revoked), and with it every key attached to it."""


class WatchCompacted(EtcdError):
    """The history a watch wanted to resume from was compacted; read the prefix again."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch history compacted up to revision {compact_revision}")
        self.compact_revision = compact_revision


# --- values --------------------------------------------------------------------------------


class KeyValue(NamedTuple):  # a tuple: a snapshot of 10,000 file records makes 10,000 of them
    key: str
    value: bytes
    version: int  # 1 when created, +1 per put; 0 in a delete event
    mod_revision: int
    create_revision: int = 0
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue  # for a delete: the key and the revision of the delete, no value


@dataclass(frozen=True)
class Snapshot:
    """Every key under a prefix at one revision; a watch from `revision + 1` continues it."""

    kvs: list[KeyValue]
    revision: int
    # Keys under the prefix at `revision`, those a read of changes only left out included.
    count: int = 0


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return binascii.a2b_base64(text)  # base64.b64decode without its checks of the argument


def _range_end(prefix: str) -> str:
    raw = prefix.encode()
    stripped = raw.rstrip(b"\xff")
    if not stripped:
        return _b64(b"\0")  # every key
    return _b64(stripped[:-1] + bytes([stripped[-1] + 1]))


def _kv(fields: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(fields["key"]).decode(),
                    value=_unb64(fields.get("value", "")),
                    version=int(fields.get("version", 0)),
                    mod_revision=int(fields.get("mod_revision", 0)),
                    create_revision=int(fields.get("create_revision", 0)),
                    lease=int(fields.get("lease", 0)))


def _revision(reply: dict[str, Any]) -> int:
    return int(reply.get("header", {}).get("revision", 0))


# --- the client ----------------------------------------------------------------------------


class Etcd:
    """etcd v3 through its JSON gateway; every method is async and runs its HTTP off the trio
    thread. Safe to share between tasks."""

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float = DEFAULT_TIMEOUT,
                 security: EtcdSecurity | None = None) -> None:
        """EtcdError if a file of `security` cannot be loaded."""
        security = security or EtcdSecurity()
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = tuple(endpoints)
        scheme = "https" if security.tls else "http"
        self._urls = [f"{scheme}://{endpoint}/v3/" for endpoint in self.endpoints]
        self._security = security
        self._auth_token: str | None = None
        self._auth_lock = trio.Lock()  # one token fetched at a time, shared by every call
        verify = _ssl_context(security) if security.tls else True
        # Watches are streams held open for minutes: in the calls' pool, a few of them would
        # leave the calls waiting for a connection (a PoolTimeout, taken for etcd down).
        self._http, self._watch_http = (
            httpx.AsyncClient(verify=verify,
                              trust_env=False,  # never route etcd through an environment proxy
                              timeout=timeout,
                              limits=httpx.Limits(max_connections=size,
                                                  max_keepalive_connections=size))
            for size in (POOL_SIZE, WATCH_POOL_SIZE))
        self.timeout = timeout  # seconds per request
        self._preferred = 0  # the endpoint that answered last: tried first
        # Why no endpoint answered the last request that failed so (None once one answers):
        # "127.0.0.1:2379: connection refused", for a person.
        self.last_failure: str | None = None

    # -- keys and values

    async def get(self, key: str) -> KeyValue | None:
        reply = await self._call("kv/range", {"key": _b64(key)})
        kvs = reply.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    async def get_all(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        """The keys that exist of `keys`, read in transactions of at most MAX_TXN_OPS ranges
        (each one consistent; a few requests, not one per key)."""
        found: dict[str, KeyValue] = {}
        for reply in await self._txns([
                _unconditional([{"request_range": {"key": _b64(key)}} for key in chunk])
                for chunk in _txn_chunks(keys, len)]):
            for response in reply.get("responses", []):
                for fields in response.get("response_range", {}).get("kvs", []):
                    kv = _kv(fields)
                    found[kv.key] = kv
        return found

    async def get_prefix(self, prefix: str, changed_after: int = 0) -> Snapshot:
        """Every key under prefix, read in pages at the revision of the first page; with
        `changed_after`, only the keys put after that revision (etcd filters them, and
        `count` still counts every key: a key deleted since shows as a lower count)."""
        kvs: list[KeyValue] = []
        start, revision, count = _b64(prefix), 0, 0
        while True:
            payload: dict[str, Any] = {"key": start, "range_end": _range_end(prefix),
                                       "limit": PAGE_SIZE}
            if revision:
                payload["revision"] = revision
            if changed_after:
                payload["min_mod_revision"] = changed_after + 1
            reply = await self._call("kv/range", payload)
            if not revision:  # the first page's: the later ones count from their start
                revision, count = _revision(reply), int(reply.get("count", 0))
            page = [_kv(fields) for fields in reply.get("kvs", [])]
            kvs.extend(page)
            if not reply.get("more") or not page:
                return Snapshot(kvs, revision, count)
            start = _b64(page[-1].key.encode() + b"\0")  # the next key after the last one

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Store value under key (attached to lease, if any); the revision of the write."""
        reply = await self._call("kv/put", self._put_fields(key, value, lease))
        return _revision(reply)

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store many keys in transactions of at most MAX_TXN_OPS puts and MAX_TXN_BYTES
        (each one atomic)."""
        await self._txns([_unconditional([{"request_put": self._put_fields(key, value, 0)}
                                          for key, value in chunk])
                          for chunk in _txn_chunks(items, lambda item: len(item[0]) +
                                                   len(item[1]))])

    async def delete_all(self, keys: Sequence[str]) -> None:
        """Delete many keys in transactions of at most MAX_TXN_OPS deletes (each atomic)."""
        await self._txns([_unconditional([{"request_delete_range": {"key": _b64(key)}}
                                          for key in chunk])
                          for chunk in _txn_chunks(keys, len)])

    async def _txns(self, txns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Their replies, in order: the transactions sent TXNS_AT_ONCE at a time (each is
        atomic on its own; none waits for another). The first failure is raised, the others
        cancelled."""
        if len(txns) <= 1:
            return [await self._call("kv/txn", txn) for txn in txns]
        replies: list[dict[str, Any]] = [{} for _ in txns]
        failures: list[EtcdError] = []
        limiter = trio.CapacityLimiter(TXNS_AT_ONCE)

        async def send(index: int, nursery: trio.Nursery) -> None:
            async with limiter:
                try:
                    replies[index] = await self._call("kv/txn", txns[index])
                except EtcdError as exc:
                    failures.append(exc)
                    nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for index in range(len(txns)):
                nursery.start_soon(send, index, nursery)
        if failures:
            raise failures[0]
        return replies

    async def put_all_if_version(self, items: Sequence[tuple[str, bytes, int]]) -> bool:
        """Write every (key, value) only if each key's version is still the one given, in
        transactions of at most MAX_TXN_OPS items and MAX_TXN_BYTES (etcd refuses a request
        over 1.5 MiB); each is all or nothing. False if a key of some transaction moved (that
        transaction wrote nothing; the others are written: the caller reads and tries again)."""
        replies = await self._txns([
            {"compare": [{"key": _b64(key), "target": "VERSION", "result": "EQUAL",
                          "version": version} for key, _value, version in chunk],
             "success": [{"request_put": self._put_fields(key, value, 0)}
                         for key, value, _version in chunk],
             "failure": []}
            for chunk in _txn_chunks(items, lambda item: len(item[0]) + len(item[1]))])
        return all(reply.get("succeeded", False) for reply in replies)

    async def delete_if_unchanged(self, items: Sequence[tuple[str, int]]) -> bool:
        """Delete each key of `items` ((key, mod_revision)) only if it was not written since
        that revision, in transactions of at most MAX_TXN_OPS keys (each all or nothing).
        False if a key of some transaction moved (that transaction deleted nothing)."""
        replies = await self._txns([
            {"compare": [{"key": _b64(key), "target": "MOD", "result": "EQUAL",
                          "mod_revision": revision} for key, revision in chunk],
             "success": [{"request_delete_range": {"key": _b64(key)}}
                         for key, _revision in chunk],
             "failure": []}
            for chunk in _txn_chunks(items, lambda item: len(item[0]))])
        return all(reply.get("succeeded", False) for reply in replies)

    async def delete(self, key: str) -> bool:
        reply = await self._call("kv/deleterange", {"key": _b64(key)})
        return int(reply.get("deleted", 0)) > 0

    async def delete_prefix(self, prefix: str) -> int:
        reply = await self._call("kv/deleterange", {"key": _b64(prefix),
                                                    "range_end": _range_end(prefix)})
        return int(reply.get("deleted", 0))

    async def put_if_absent(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Create key in one transaction that fails if it exists: of racing callers exactly
        one gets True."""
        return await self.put_if_version(key, value, 0, lease)

    async def put_if_version(self, key: str, value: bytes, version: int,
                             lease: int = 0) -> bool:
        """Write key only if its version is still `version` (0: absent); False if it moved."""
        txn = {"compare": [{"key": _b64(key), "target": "VERSION", "result": "EQUAL",
                            "version": version}],
               "success": [{"request_put": self._put_fields(key, value, lease)}],
               "failure": []}
        reply = await self._call("kv/txn", txn)
        return bool(reply.get("succeeded", False))

    # -- leases

    async def grant_lease(self, ttl: int) -> int:
        """A new lease of ttl seconds; its id."""
        reply = await self._call("lease/grant", {"TTL": ttl})
        if reply.get("error"):
            raise EtcdError(f"lease grant refused: {reply['error']}")
        return int(reply["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew the lease once; its TTL again. `LeaseExpired` if it is gone."""
        reply = await self._call("lease/keepalive", {"ID": lease})
        ttl = int(reply.get("result", {}).get("TTL", -1))
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease:x} has expired")
        return ttl

    async def revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys (a lease already gone is not an error)."""
        try:
            await self._call("kv/lease/revoke", {"ID": lease})
        except EtcdError as exc:
            if exc.code != GRPC_NOT_FOUND:
                raise

    # -- watches

    async def watch_prefix(self, prefix: str, start_revision: int,
                           send: trio.abc.SendChannel[list[WatchEvent]]) -> None:
        """Deliver every change under prefix from start_revision on, batch by batch, until
        cancelled. A broken stream is reopened after the last delivered revision (retrying
        while etcd is unavailable). Raises `WatchCompacted` if that history is gone."""
        next_revision = start_revision

        async def deliver(batch: list[WatchEvent]) -> None:
            nonlocal next_revision
            next_revision = batch[-1].kv.mod_revision + 1
            await send.send(batch)

        while True:
            try:
                await self._watch_once(prefix, next_revision, deliver)
            except EtcdUnavailable as exc:
                log.debug("watch on %s broke (%s); reopening at revision %d", prefix, exc,
                          next_revision)
            await trio.sleep(RETRY_FIRST_DELAY)  # never a busy loop on a watch that fails at once
            await retry_unavailable(self._probe, f"reopening the watch on {prefix}")

    async def follow_prefix(self, prefix: str,
                            send: trio.abc.SendChannel[Snapshot | list[WatchEvent]]) -> None:
        """Mirror a prefix: a `Snapshot` first, then batches of changes, until cancelled. After
        a compaction of the history, a new `Snapshot` replaces everything known before."""
        while True:
            snapshot = await retry_unavailable(lambda: self.get_prefix(prefix),
                                               f"reading {prefix}")
            await send.send(snapshot)
            try:
                await self.watch_prefix(prefix, snapshot.revision + 1, send)
            except WatchCompacted as exc:
                log.info("watch on %s: %s; reading it again", prefix, exc)

    # -- plumbing

    async def _probe(self) -> None:
        await self._call("maintenance/status", {})

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._post(path, payload, await self._headers())
        except EtcdError as exc:
            if not self._auth_expired(exc):
                raise
        self._auth_token = None  # etcd forgot it (a restart, its TTL): a new one, once
        return await self._post(path, payload, await self._headers())

    async def _headers(self) -> dict[str, str]:
        """The auth token etcd gave for the user and password, fetched when there is none
        (by one caller: the others wait for it rather than each asking for a token)."""
        security = self._security
        if security.user is None:
            return {}
        async with self._auth_lock:
            if self._auth_token is None:
                reply = await self._post("auth/authenticate",
                                         {"name": security.user,
                                          "password": security.password or ""}, {})
                self._auth_token = str(reply.get("token", ""))
            return {"Authorization": self._auth_token}

    async def aclose(self) -> None:
        """Close the connections to etcd (the client is not used after)."""
        await self._http.aclose()
        await self._watch_http.aclose()

    def _auth_expired(self, exc: EtcdError) -> bool:
        return self._security.user is not None and (
            exc.code == GRPC_UNAUTHENTICATED or "invalid auth token" in str(exc))

    async def _post(self, path: str, payload: dict[str, Any],
                    headers: dict[str, str]) -> dict[str, Any]:
        """POST to the first endpoint that answers."""
        count = len(self._urls)
        failures: list[str] = []
        for i in range(count):
            index = (self._preferred + i) % count
            try:
                response = await self._http.post(self._urls[index] + path, json=payload,
                                                  headers=headers)
                reply = response.json()
            except httpx.TransportError as exc:
                if _tls_failure(exc):
                    raise EtcdError(f"etcd at {self.endpoints[index]}: TLS: "
                                    f"{_tls_failure(exc)}") from None
                failures.append(f"{self.endpoints[index]}: {self._reason(exc)}")
                continue
            except ValueError:  # not JSON: a proxy's or the gateway's own plain text
                text = response.text.strip().splitlines()[0][:300] if response.text.strip() \
                    else f"HTTP {response.status_code}"
                if response.status_code in UNAVAILABLE_STATUSES or response.status_code == 200:
                    failures.append(f"{self.endpoints[index]}: {text}")
                    continue
                raise EtcdError(f"etcd at {self.endpoints[index]} refused {path}: {text}") \
                    from None
            if response.status_code in UNAVAILABLE_STATUSES:
                failures.append(f"{self.endpoints[index]}: {_message(reply)}")
                continue
            if response.status_code != 200:
                code = reply.get("code") if isinstance(reply, dict) else None
                raise EtcdError(f"etcd {path}: {_message(reply)}",
                                code if isinstance(code, int) else None)
            self._preferred = index
            self.last_failure = None
            return reply
        self.last_failure = "; ".join(failures)
        raise EtcdUnavailable("etcd unavailable: " + self.last_failure)

    def _reason(self, exc: BaseException) -> str:
        """Why an endpoint did not answer, in a few words."""
        detail = _detail(exc)
        if isinstance(exc, httpx.TimeoutException) or "timed out" in detail.lower():
            return f"no answer within {self.timeout:g} s"
        for cause in _causes(exc):  # the OS's reason under the HTTP client's and trio's
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "connection refused"
            if isinstance(cause, OSError) and cause.strerror:
                return cause.strerror.lower()
        return detail

    def _put_fields(self, key: str, value: bytes, lease: int) -> dict[str, Any]:
        fields: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            fields["lease"] = lease
        return fields

    async def _watch_once(self, prefix: str, start_revision: int,
                          deliver: Callable[[list[WatchEvent]], Awaitable[None]]) -> None:
        """One watch stream from `start_revision`, its batches given to `deliver`, until it
        breaks (EtcdUnavailable) or the caller is cancelled (which closes it)."""
        request = {"create_request": {"key": _b64(prefix), "range_end": _range_end(prefix),
                                      "start_revision": start_revision}}
        url = self._urls[self._preferred] + "watch"
        try:
            headers = await self._headers()
            async with self._watch_http.stream(
                    "POST", url, json=request, headers=headers,
                    timeout=httpx.Timeout(self.timeout, read=WATCH_IDLE_REOPEN)) as response:
                if response.status_code != 200:
                    raise EtcdUnavailable(f"watch: HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if line.strip():
                        events = self._watch_events(json.loads(line))
                        if events:
                            await deliver(events)
        except (httpx.HTTPError, ValueError) as exc:
            raise EtcdUnavailable(f"watch stream broke: {_detail(exc)}") from None
        except WatchCompacted:
            raise  # not a stream to reopen: the history is gone (`follow_prefix` reads again)
        except EtcdError as exc:  # the auth token, refused: a new one when it is reopened
            if self._auth_expired(exc):
                self._auth_token = None
            raise EtcdUnavailable(f"watch: {exc}") from None
        raise EtcdUnavailable("watch stream ended")

    def _watch_events(self, message: dict[str, Any]) -> list[WatchEvent]:
        if "error" in message:
            error = message["error"]
            raise EtcdUnavailable(f"watch: {error.get('message', error)}")
        result = message.get("result", {})
        if int(result.get("compact_revision", 0)):
            raise WatchCompacted(int(result["compact_revision"]))
        if result.get("canceled"):
            raise EtcdUnavailable(f"watch canceled: {result.get('cancel_reason', '')}")
        return [WatchEvent("delete" if e.get("type") == "DELETE" else "put", _kv(e["kv"]))
                for e in result.get("events", [])]


def _unconditional(operations: list[dict[str, Any]]) -> dict[str, Any]:
    return {"compare": [], "failure": [], "success": operations}


def _txn_chunks(items: Sequence[T], size: Callable[[T], int]) -> list[Sequence[T]]:
    """items cut into runs that fit one transaction (a single oversized item goes alone: etcd
    says why it refuses it)."""
    chunks: list[Sequence[T]] = []
    start, total = 0, 0
    for i, item in enumerate(items):
        total += size(item)
        if i > start and (i - start >= MAX_TXN_OPS or total > MAX_TXN_BYTES):
            chunks.append(items[start:i])
            start, total = i, size(item)
    if start < len(items):
        chunks.append(items[start:])
    return chunks


def _ssl_context(security: EtcdSecurity) -> ssl.SSLContext:
    """The TLS context of --etcd-cacert, --etcd-cert and --etcd-key (EtcdError if a file
    cannot be loaded)."""
    try:
        context = ssl.create_default_context(cafile=security.cacert)
        if security.cert:
            context.load_cert_chain(security.cert, security.key)
    except (OSError, ssl.SSLError) as exc:
        raise EtcdError(f"cannot load the etcd TLS files: {exc}") from None
    if security.cert and (problem := dates_problem(security.cert, "--etcd-cert")):
        raise EtcdError(problem)  # etcd would only answer `bad certificate`
    return context


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from, through exception groups (a few levels deep)."""
    found, pending = [], [exc]
    while pending and len(found) < 20:
        seen = pending.pop(0)
        found.append(seen)
        if isinstance(seen, BaseExceptionGroup):
            pending.extend(seen.exceptions)
        if (cause := seen.__cause__ or seen.__context__) is not None:
            pending.append(cause)
    return found


def _tls_failure(exc: BaseException) -> str | None:
    """What went wrong in a TLS handshake under `exc`, if that is what failed."""
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLError):
            reason = str(cause.reason or cause).replace("_", " ").lower()
            detail = getattr(cause, "verify_message", None)
            return f"{reason}: {detail}" if detail else reason
    return None


def _message(reply: Any) -> str:
    """The gateway's error message in a JSON answer."""
    if isinstance(reply, dict):
        return str(reply.get("message") or reply.get("error") or reply)[:300]
    return str(reply)[:300]


def _detail(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).strip()[:300]


ETCD_RETRIES = RetryPolicy(first_delay=RETRY_FIRST_DELAY, max_delay=RETRY_MAX_DELAY)


async def retry_unavailable(call: Callable[[], Awaitable[T]], what: str) -> T:
    """`call()` until etcd answers, by the one retry policy (`tierfs.retry`) with short
    pauses. Errors other than `EtcdUnavailable` propagate."""
    return await retry(call, what, retryable=lambda exc: isinstance(exc, EtcdUnavailable),
                       policy=ETCD_RETRIES)
