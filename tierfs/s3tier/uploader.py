"""The upload scheduler: committed steps that match `--persist-every` go to the persistent tier,
and `--keep-persist` retires old ones there.

One step at a time, its files in parallel, a file larger than the backend's part in parts, also
in parallel (`tierfs.s3tier.sending`): at most PARALLEL_REQUESTS requests at once, and besides
them SMALL_IN_FLIGHT files of at most SMALL_FILE bytes (one short request each, whose round trips
to the store overlap), read from
the RAM store's immutable committed objects so that nothing can change under an upload. Each
request is retried alone, a part as much as a whole file.
Order keeps "whole step or none" in the store: the old manifest object is deleted first, then the
files are replaced, then a step of many small files gets its packs (`tierfs.s3tier.packs`),
then the new manifest is written last, and objects of the old version that the new one does not
name go (packs not written again among them). Temporary failures retry without limit for as
long as the step is still the current version; the step stays in RAM meanwhile. A version that
is no longer current (deleted, saved again) makes no new request: its upload ends with the
requests in flight, and the steps queued behind it go on.

Whatever else fails a step's upload (a store that is unavailable, a refusal the store calls
final, the unforeseen) the whole step is tried again by the same policy, for as long as it is
the current version: a step is never left in RAM alone while the store is believed to have it.
Meanwhile the other steps go on. `troubles` says why each step is not up yet and since when,
for `tierfs status`.

A tracker file (`tierfs.trackers`: DeepSpeed's `latest`, Megatron-LM's
`latest_checkpointed_iteration.txt`) goes up only once the step it names is in the store: a
version naming a step not there yet waits (and goes up right after that step), one naming a
step `--persist-every` never selects is not due at all, and the store keeps the version it
has meanwhile, so a fresh node never reads a tracker that points past the store. A saver that
rewrites its tracker faster than its steps reach the store does not starve it: whenever a step
reaches the store, the version (current or older) naming the newest step the store holds goes
up (`tierfs.s3tier.tracker_versions`, whose `TrackerGate` decides which version waits and
which goes). Retention never removes the step that the store's tracker names.

Bytes the store holds already never travel again: a file whose object is there with the same
content (a version that changed only modes, owners or mtimes) is not sent, and then the old
manifest is simply replaced (whether the object is there is seen in a listing of the step at
that moment: the stored manifest says what was sent, not what the store still holds); a file
renamed under the mount whose old name the store still holds (`copy_sources`, from
`fs.lifecycle.deletes`) is copied inside the store (`Backend.copy`), after the old name's manifest,
read under that name's lock, says the object holds those bytes.

A deleted step is removed the same way round (`delete_step`: manifest first, then data), never
at the same time as an upload of the same path, so that a late upload cannot bring it back.
What the store holds, read and removed, is `tierfs.s3tier.stored_steps`.

In a cluster (`shares`, `tierfs.shared_uploads`) a step's upload is shared: this node sends the
files its plan gives it (those it wrote, or holds for a writer that is gone), deleting the old
manifest first as above, and marks them stored in the cluster's records; the node that writes
the manifest waits (without holding up the queue) until every other file is marked, then
writes it and records the version as persisted, which every node then shows. Whoever
uploads, the manifest goes last, after every file of the version is in the store.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import trio

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model import links as symlinks
from tierfs.observe import Events
from tierfs.s3tier import holdings, packs, segments
from tierfs.s3tier.interface import (
    MANIFEST_KEY,
    SMALL_FILE,
    SMALL_IN_FLIGHT,
    Backend,
    BackendError,
    NotFound,
)
from tierfs.s3tier.pack_uploads import PackUploads
from tierfs.s3tier.retry import POLICY, NoLongerWanted, retry
from tierfs.s3tier.sending import send_file
from tierfs.s3tier.stored_steps import StoredSteps
from tierfs.s3tier.tracker_versions import TrackerGate, TrackerVersion
from tierfs.shared_uploads import (
    PERSISTED,
    RETIRED,
    SharedUploads,
    SharesUnavailable,
    UploadPlan,
)
from tierfs.step_queue import StepQueue
from tierfs.trackers import TrackedStep

log = logging.getLogger(__name__)

PARALLEL_REQUESTS = 4
# Seconds the manifest's writer of a shared upload follows the records for the other nodes'
# files before it plans again (a sender may have gone meanwhile)
STORED_WAIT = 30.0


@dataclass
class UploadTrouble:
    """Why a version of a step is not in the store yet: the last failure, since when (wall
    clock, ns) the upload of this version fails, how many requests failed, and how many
    attempts of the whole step (the backoff before the next one)."""

    version: int
    reason: str
    since_ns: int
    failures: int = 0
    step_failures: int = 0


class UploadedSteps(Protocol):
    """What the uploader asks of the file system about the steps it uploads, and tells it of
    them, as one object (the daemon's `commit_pipeline.NamespaceSteps` over the namespace;
    a test's own)."""

    def object_path(self, xxh3: str) -> str:
        """Where the bytes of a committed object are read from (the RAM store)."""

    def step_number(self, name: str) -> int | None:
        """The step number of a directory's name (--step-pattern), None for no step."""

    def file_step_number(self, name: str) -> int | None:
        """The step number of a single-file step's name (--file-step-pattern), None else."""

    def is_current(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is still the committed version of its step (worth uploading)."""

    def persisted(self, manifest: mf.StepManifest) -> None:
        """This version of the step is in the store now."""

    def retired(self, relpath: str) -> None:
        """Retention removed the step from the store: never upload it again."""

    def tracked_step(self, manifest: mf.StepManifest, content: bytes | None = None
                     ) -> TrackedStep | None:
        """If this version is a tracker, the step it names (its upload waits for that step's);
        `content`: the tracker's bytes, else this version's."""

    def copy_sources(self, key: str) -> list[tuple[str, str]]:
        """Objects in the store that may hold the bytes of `key` (a renamed step's old names),
        as (step path, object key)."""

    def single_writer(self, manifest: mf.StepManifest) -> bool:
        """Whether the step's files were all written on one node (then it may be packed)."""

    async def users_quiet(self) -> None:
        """Returns once the mount's users pause (each file waits for it: users first)."""


class Uploader:
    def __init__(
        self,
        backend: Backend,
        steps: UploadedSteps,
        *,
        persist_every: int,
        keep_persist: int,
        events: Events,
        shares: SharedUploads | None = None,
    ) -> None:
        self.backend = backend
        self._events = events
        self._steps = steps  # the file system's side of each upload
        self.persist_every = persist_every
        self.keep_persist = keep_persist
        self.bytes_sent = 0  # file bytes sent to the store (not those it copied itself)
        self.bytes_copied = 0  # file bytes the store copied inside itself (renames)
        self.manifest_bytes_sent = 0  # the steps' manifests sent to the store
        self.queue = StepQueue()
        # What the store holds: compared with at each upload, read at mount (`startup`)
        self.stored = StoredSteps(backend, steps, shared=shares is not None,
                                  pending=self.queue.pending)
        self.trackers = TrackerGate(steps, queue=self.queue.put, due=self.due,
                                    store_url=backend.url)
        self._threads = trio.CapacityLimiter(PARALLEL_REQUESTS)
        self._small_requests = trio.CapacityLimiter(SMALL_IN_FLIGHT)  # files of SMALL_FILE or less
        # The thread of a request `_call` holds a `_threads` token for: bounded by that alone,
        # not by trio's default limiter as well (which other work of the daemon shares).
        self._token_held = trio.CapacityLimiter(math.inf)
        self._path_locks: dict[str, trio.Lock] = {}  # an upload and a delete of one path
        self._packs = PackUploads(backend, steps, self._threads, self._lock)
        self.troubles: dict[str, UploadTrouble] = {}
        self._uploading: str | None = None
        self._retries: trio.Nursery | None = None  # steps waiting to be tried again
        self._shares = shares  # in a cluster: each node uploads its share of a step
        # (path, version) of shared uploads waiting for other nodes' files (`_await_others`)
        self._awaiting: set[tuple[str, int]] = set()

    def _lock(self, path: str) -> trio.Lock:
        return self._path_locks.setdefault(path, trio.Lock())

    @property
    def pack_bytes_sent(self) -> int:
        """The steps' packs and their indexes sent to the store (`tierfs.s3tier.packs`)."""
        return self._packs.bytes_sent

    def wanted(self, manifest: mf.StepManifest) -> bool:
        if manifest.step != mf.NO_STEP:
            return self.due(manifest.step)
        return self.trackers.wanted(manifest)

    def due(self, number: int) -> bool:
        """Whether step `number` goes to the store (--persist-every)."""
        return number % self.persist_every == 0

    def submit(self, manifest: mf.StepManifest) -> None:
        """Queue a committed step (a newer version of a queued step replaces it)."""
        if manifest.step == mf.NO_STEP:
            queued = self.trackers.submitted(manifest)  # a loose file, maybe a tracker
        else:
            queued = self.due(manifest.step)
        if queued:
            self.queue.put(manifest)

    def _current(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is still worth uploading (`TrackerGate.worth_uploading`)."""
        return self.trackers.worth_uploading(manifest)

    def waiting(self, manifest: mf.StepManifest) -> tuple[str, int, int]:
        """Why a step due in the store is not there yet, since when (ns) and after how many
        failed requests: its last failure, else "uploading" or "queued" since its commit."""
        trouble = self.troubles.get(manifest.path)
        if trouble is not None and trouble.version == manifest.version:
            return trouble.reason, trouble.since_ns, trouble.failures
        number = self.trackers.waits_for(manifest)
        if number is not None:
            return f"waits for step {number} to be there", manifest.committed_ns, 0
        state = "uploading" if self._uploading == manifest.path else "queued"
        return state, manifest.committed_ns, 0

    async def run(self) -> None:
        async with trio.open_nursery() as retries:
            self._retries = retries
            retries.start_soon(self._remove_leftovers)
            await self.queue.serve(self._upload_or_retry)

    async def _remove_leftovers(self) -> None:
        """What uploads cut short before this start left in the store goes (in the
        background: a file:// store is walked)."""
        try:
            await trio.to_thread.run_sync(self.backend.remove_leftovers, limiter=self._threads)
        except BackendError as exc:
            log.warning("could not look for what uploads cut short left in %s: %s",
                        self.backend.url, exc)

    async def _upload_or_retry(self, manifest: mf.StepManifest) -> None:
        self._uploading = manifest.path
        try:
            async with self._lock(manifest.path):
                await self._upload(manifest)
        except* Exception as failures:  # files go up in parallel: errors come grouped
            self._retry_later(manifest, failures)
        finally:
            self._uploading = None

    def _retry_later(self, manifest: mf.StepManifest, failures: BaseExceptionGroup) -> None:
        """One line per failed attempt of a step, and the step tried again after the policy's
        pause (the uploader goes on with the next step meanwhile); a traceback only for the
        unforeseen, the first time."""
        if not self._steps.is_current(manifest) or failures.subgroup(NoLongerWanted) is not None:
            self._clear_trouble(manifest)
            log.info("upload of %s v%d dropped: the step changed or was removed", manifest.path,
                     manifest.version)
            return
        first = failures.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        trouble = self.troubles.get(manifest.path)
        if trouble is None or trouble.version != manifest.version or \
                not isinstance(first, BackendError):  # a request's failure was noted already
            trouble = self._note_trouble(manifest, first)
        trouble.step_failures += 1
        # (the predicate sees the groups too: a group is not in itself unforeseen)
        unforeseen = failures.subgroup(
            lambda e: not isinstance(e, (BackendError, SharesUnavailable, BaseExceptionGroup)))
        delay = POLICY.delay(trouble.step_failures)
        log.log(POLICY.level(trouble.step_failures),
                "upload of %s v%d failed (attempt %d), retrying in %.1f s: %s", manifest.path,
                manifest.version, trouble.step_failures, delay, first,
                exc_info=unforeseen if trouble.step_failures == 1 else None)
        assert self._retries is not None, "failures come from run()"
        self._retries.start_soon(self._submit_after, manifest, delay)

    async def _submit_after(self, manifest: mf.StepManifest, delay: float) -> None:
        await trio.sleep(delay)
        if self._steps.is_current(manifest):
            self.queue.put(manifest)
        else:
            self._clear_trouble(manifest)

    def _note_trouble(self, manifest: mf.StepManifest, failure: BaseException) -> UploadTrouble:
        trouble = self.troubles.get(manifest.path)
        if trouble is None or trouble.version != manifest.version:
            trouble = UploadTrouble(manifest.version, str(failure), time.time_ns())
            self.troubles[manifest.path] = trouble
        trouble.reason = str(failure) or type(failure).__name__
        trouble.failures += 1
        return trouble

    def _clear_trouble(self, manifest: mf.StepManifest) -> None:
        trouble = self.troubles.get(manifest.path)
        if trouble is not None and trouble.version == manifest.version:
            del self.troubles[manifest.path]

    async def _call(self, what: str, manifest: mf.StepManifest, func, *args,  # type: ignore[no-untyped-def]
                    limiter: trio.CapacityLimiter | None = None) -> object:
        """`func(*args)` in a thread once `limiter` (PARALLEL_REQUESTS' by default) lets it,
        retried by the policy while the version is wanted."""
        async def attempt() -> object:
            try:
                # Whether the version is still wanted is asked once a request's turn has
                # come, not before it queued: a step deleted or saved again stops after the
                # requests in flight, instead of sending every byte left (ahead of the steps
                # queued behind it, as a save's next step).
                async with limiter or self._threads:
                    if not self._current(manifest):
                        raise NoLongerWanted(what)
                    return await trio.to_thread.run_sync(func, *args,
                                                         limiter=self._token_held)
            except BackendError as exc:
                self._note_trouble(manifest, exc)
                raise

        return await retry(attempt, what, still_wanted=lambda: self._current(manifest))

    async def _upload(self, manifest: mf.StepManifest) -> None:
        if not self._steps.is_current(manifest):
            raise NoLongerWanted(manifest.path)
        ready = self.trackers.ready(manifest.path) if manifest.step == mf.NO_STEP else None
        if ready is not None:
            await self._upload_tracker(manifest, ready)
            return
        if self.trackers.holds_back(manifest):
            return
        tracked = self._steps.tracked_step(manifest) if manifest.step == mf.NO_STEP else None
        await self._put_version(manifest, tracks=tracked.number if tracked else None)

    async def _upload_tracker(self, current: mf.StepManifest, ready: TrackerVersion) -> None:
        """Put the tracker version `ready` (the one naming the newest step in the store) in
        the store, unless the store's tracker names that step or a newer one already; the
        current version goes up itself once its own step is there."""
        path = current.path
        stored = await self._call(f"read of {path}", current, self.stored.tracker, path)
        tracked = self._steps.tracked_step(current, stored) if stored is not None else None
        if tracked is not None and tracked.number >= ready.number:
            self.trackers.stored(path, tracked.number)
        elif ready.manifest is current:
            await self._put_version(current, ready.content, ready.number)
            return
        else:
            with self.trackers.uploading(ready):
                await self._put_version(ready.manifest, ready.content, ready.number)
            log.info("%s: its v%d (naming step %d, the newest in %s that it named) went up; "
                     "v%d follows its own step", path, ready.manifest.version, ready.number,
                     self.backend.url, current.version)
        if self._current(current) and not self.trackers.holds_back(current):
            # names a step in the store too: up it goes, in a round of its own (`StepQueue`:
            # the version being worked on, put again, is worked on once more)
            self.queue.put(current)

    async def _put_version(self, manifest: mf.StepManifest, content: bytes | None = None,
                           tracks: int | None = None) -> None:
        """The upload of one version (`content`: its one file's bytes, a tracker's, sent as
        they are instead of read from the RAM store; `tracks`: the step a tracker's names)."""
        started = time.monotonic()
        plan = await self._plan(manifest)
        if plan is None:
            return  # not the cluster's committed version: a newer one follows
        prefix = manifest.path
        manifest_key = layout.manifest_key(prefix, manifest.single_file)
        data_dir = layout.data_dir(prefix, manifest.single_file)
        stored = await self._call(f"read of {manifest_key}", manifest, self.stored.entries,
                                  prefix, manifest.single_file)
        if any(_held(stored.get(entry.name)) == _held(entry) for entry in manifest.files):
            # A file the stored manifest names as it is goes up only if its objects are not
            # there now: the manifest says what was sent, not what the store still holds.
            held = await self._call(f"listing of {prefix}", manifest, holdings.held_now,
                                    self.backend, manifest)
            stored = {name: entry for name, entry in stored.items() if name in held.files
                      or _held(entry) != _held(manifest.entry(name))}
        changed = [entry for entry in manifest.files if entry.name in plan.mine
                   and _held(stored.get(entry.name)) != _held(entry)]
        # A loose file appended since the stored version: only the new segments go, and the
        # stored version stays listed until the new manifest replaces it (fs.lifecycle.appends).
        start = await self._appended_from(manifest, stored) if changed else 0
        if changed and not start:  # objects are replaced: never seen half replaced
            await self._call(f"removing old manifest of {prefix}", manifest,
                             self.backend.delete, [manifest_key])
        checked: dict[str, dict[str, mf.FileEntry]] = {}  # what renames' sources hold
        # Small files SMALL_IN_FLIGHT at a time, the others PARALLEL_REQUESTS at a time, each
        # by a worker of its own that takes the next: a task per file was 10,000 tasks on the
        # loop for a step of many small files.
        small = [entry for entry in changed if _small(entry)] if content is None else []
        others = [entry for entry in changed if not _small(entry)] if content is None else changed

        async def send_next(files: Iterator[mf.FileEntry], limiter: trio.CapacityLimiter) -> None:
            for entry in files:
                if content is None:
                    await self._upload_file(manifest, data_dir, entry, checked, start, limiter)
                else:  # a tracker's version, sent as it was
                    key = layout.object_key(data_dir, entry.name)
                    await self._call(f"upload of {key}", manifest, self.backend.put_bytes, key,
                                     content)

        async with trio.open_nursery() as nursery:
            for files, limiter in ((small, self._small_requests), (others, self._threads)):
                queue = iter(files)
                for _ in range(min(limiter.total_tokens, len(files))):
                    nursery.start_soon(send_next, queue, limiter)
        if not self._current(manifest):  # deleted or re-saved meanwhile: never list it
            raise NoLongerWanted(prefix)
        await self._restrict(manifest, data_dir, changed, stored, plan.mine)
        if not await self._others_stored(manifest, plan, started):
            return
        if manifest.single_file and changed and (
                changed[0].segments or any(e.segments for e in stored.values())):
            await self._call(f"removing old segments of {prefix}", manifest,
                             self._remove_stale_segments, prefix, changed[0])
        # (a file gone since the stored version is a change too: no pack keeps its bytes)
        kept_packs = await self._packs.write(manifest, data_dir, bool(changed) or any(
            manifest.entry(name) is None for name in stored), self._caller(manifest))
        encoded = mf.encode(manifest)
        await self._call(f"upload of {manifest_key}", manifest,
                         self.backend.put_bytes, manifest_key, encoded)
        self.manifest_bytes_sent += len(encoded)
        await self._call(f"removing old files of {prefix}", manifest, self._remove_stale,
                         manifest, kept_packs)
        if self._shares is not None:
            await self._shares.note_store(manifest.path, manifest.version, PERSISTED)
        self._clear_trouble(manifest)
        self._events.persisted(manifest, self.backend.url, time.monotonic() - started)
        self._steps.persisted(manifest)
        if tracks is not None:
            self.trackers.stored(manifest.path, tracks)
        self.trackers.release()
        if self.keep_persist:
            await self._apply_retention(prefix.rpartition("/")[0])

    async def _plan(self, manifest: mf.StepManifest) -> UploadPlan | None:
        """This node's share of the upload: on a single node, everything."""
        if self._shares is None:
            return UploadPlan(frozenset(e.name for e in manifest.files), frozenset(),
                              writes_manifest=True)
        return await self._shares.plan(manifest)

    async def _others_stored(self, manifest: mf.StepManifest, plan: UploadPlan,
                             started: float) -> bool:
        """After this node sent its share of a shared upload: whether the manifest goes up
        now (every other file is stored and this node writes it). Otherwise its files are
        marked stored for the writer, and the writer waits for the others' files
        (`_await_others`)."""
        if self._shares is None:
            return True
        missing = set(plan.others)
        if plan.writes_manifest and not missing:
            return True  # every file went up from here, or was marked already
        if plan.mine:
            await self._shares.mark_stored(manifest, set(plan.mine))
            log.info("%s v%d: %d files sent to %s in %.1f s, for %s to write its manifest",
                     manifest.path, manifest.version, len(plan.mine), self.backend.url,
                     time.monotonic() - started,
                     "this node" if plan.writes_manifest else "another node")
        if not plan.writes_manifest:
            self._clear_trouble(manifest)
            return False
        senders = sorted({node or "no live node" for node in plan.others.values()})
        self._note_waiting(manifest, f"waits for {len(missing)} files from "
                                     f"{', '.join(senders)}")
        key = (manifest.path, manifest.version)
        if key not in self._awaiting:
            self._awaiting.add(key)
            assert self._retries is not None, "uploads run under run()"
            self._retries.start_soon(self._await_others, manifest, missing)
        return False

    async def _await_others(self, manifest: mf.StepManifest, names: set[str]) -> None:
        """Until the other nodes' files of a shared upload are stored (or STORED_WAIT passed:
        a sender may have gone, the plan is made again), then the step is queued again."""
        assert self._shares is not None
        try:
            await self._shares.wait_stored(manifest, names, trio.current_time() + STORED_WAIT)
        finally:
            self._awaiting.discard((manifest.path, manifest.version))
        if self._steps.is_current(manifest):
            self.queue.put(manifest)

    def _note_waiting(self, manifest: mf.StepManifest, reason: str) -> None:
        """Why the version is not in the store yet, where no request failed."""
        trouble = self.troubles.get(manifest.path)
        if trouble is None or trouble.version != manifest.version:
            trouble = UploadTrouble(manifest.version, reason, time.time_ns())
            self.troubles[manifest.path] = trouble
        trouble.reason = reason

    async def _restrict(self, manifest: mf.StepManifest, data_dir: str,
                        changed: list[mf.FileEntry], stored: dict[str, mf.FileEntry],
                        mine: frozenset[str]) -> None:
        """Before the manifest goes up: each file's objects readable in the store by no more
        users than the file under the mount (a store that can say so: file://), those sent
        now and those whose mode or group changed since the stored version; of a step several
        nodes upload, this node's share (`mine`)."""
        if not self.backend.restricts:
            return
        sent = {entry.name for entry in changed}
        objects = []
        for entry in manifest.files:
            if entry.name not in mine:
                continue
            old = stored.get(entry.name)
            if entry.name in sent or old is None or (old.mode, old.gid) != (entry.mode,
                                                                              entry.gid):
                key = layout.object_key(data_dir, entry.name)
                objects += [(piece, entry.mode, entry.gid)
                            for piece in layout.piece_keys(key, entry.segments)]
        if objects:
            await self._call(f"access of the files of {manifest.path}", manifest,
                             self.backend.restrict, objects)

    async def _appended_from(self, manifest: mf.StepManifest,
                             stored: dict[str, mf.FileEntry]) -> int:
        """Where the pieces of a loose file stored in segments that the store lacks start
        (0: all of them, or not such a file)."""
        entry = manifest.files[0]
        if not (manifest.single_file and entry.segments):
            return 0
        return await trio.to_thread.run_sync(segments.stored_start, stored.get(entry.name),
                                             entry, self._steps.object_path(entry.xxh3))

    def _remove_stale_segments(self, path: str, entry: mf.FileEntry) -> None:
        """Before the manifest of a single file goes up: no segment object it does not name
        stays (blocking; see `tierfs.s3tier.segments`)."""
        stale = segments.stale_segments(self.backend, path, entry)
        if stale:
            self.backend.delete(stale)

    def _caller(self, manifest: mf.StepManifest, limiter: trio.CapacityLimiter | None = None
                ) -> Callable[..., Awaitable[object]]:
        """`_call` for this version's requests, as `call(what, func, *args)`."""
        async def call(what: str, func, *args) -> object:  # type: ignore[no-untyped-def]
            return await self._call(what, manifest, func, *args, limiter=limiter)
        return call

    async def _upload_file(self, manifest: mf.StepManifest, data_dir: str,
                           entry: mf.FileEntry, checked: dict[str, dict[str, mf.FileEntry]],
                           start: int, limiter: trio.CapacityLimiter) -> None:
        await self._steps.users_quiet()  # the mount's users first (fs.lifecycle.foreground)
        await self._send_file(manifest, data_dir, entry, checked, start,
                              self._caller(manifest, limiter))

    async def _send_file(self, manifest: mf.StepManifest, data_dir: str, entry: mf.FileEntry,
                         checked: dict[str, dict[str, mf.FileEntry]], start: int,
                         call: Callable[..., Awaitable[object]]) -> None:
        key = layout.object_key(data_dir, entry.name)
        for old_path, old_key in [] if start else self._steps.copy_sources(key):
            if old_path != manifest.path and await self._copy(manifest, old_path, old_key, key,
                                                              entry, checked):
                self.bytes_copied += entry.size
                return
        if entry.segments:  # an appended loose file: its pieces from `start` on
            self.bytes_sent += await segments.send_pieces(
                self.backend, key, entry, self._steps.object_path(entry.xxh3), start, call,
                self._threads, still_wanted=lambda: self._current(manifest))
            return
        await send_file(self.backend, key, self._steps.object_path(entry.xxh3), entry.size, call,
                        self._threads, still_wanted=lambda: self._current(manifest))
        self.bytes_sent += entry.size

    async def _copy(self, manifest: mf.StepManifest, old_path: str, old_key: str, key: str,
                    entry: mf.FileEntry, checked: dict[str, dict[str, mf.FileEntry]]
                    ) -> bool:
        """Copy `old_key`, the object of a renamed file, to `key` inside the store if the old
        name's manifest there says it holds `entry`'s bytes; whether it did. Under the old
        name's lock: no upload or delete of that name changes the object meanwhile."""
        single_file = old_key == old_path
        name = old_key.rpartition("/")[2] if single_file else old_key[len(old_path) + 1:]
        async with self._lock(old_path):
            if old_path not in checked:
                checked[old_path] = await self._call(
                    f"read of the manifest of {old_path}", manifest, self.stored.entries,
                    old_path, single_file)
            if _held(checked[old_path].get(name)) != _held(entry):
                return False  # not those bytes, or not in the same pieces
            try:  # each piece: the object, and the segments of a file stored in segments
                for source, target in zip(layout.piece_keys(old_key, entry.segments),
                                          layout.piece_keys(key, entry.segments), strict=True):
                    await self._call(f"copy of {source} to {target}", manifest,
                                     self.backend.copy, source, target)
            except NotFound:
                return False
        return True

    def _remove_stale(self, manifest: mf.StepManifest, kept_packs: set[str] | None = None
                      ) -> None:
        """Objects under the step that its new version does not name (a re-save with other
        file names) take space for nothing: they go (blocking); so do packs other than
        `kept_packs` (None: whatever packs are there stay)."""
        prefix = f"{manifest.path}/"
        if manifest.single_file:
            return  # one object, replaced in place
        names = {entry.name for entry in manifest.files} | {MANIFEST_KEY} | (kept_packs or set())

        def is_stale(name: str) -> bool:
            return name not in names and (kept_packs is not None or
                                          not packs.is_pack_object(name))

        stale = [o.key for o in self.backend.list(prefix) if is_stale(o.key[len(prefix):])]
        if stale:
            self.backend.delete(stale)

    async def delete_step(self, path: str, committed_ns: int) -> None:
        """Remove a deleted step from the store: its manifest first, so it is never seen half
        gone, then its data. A version committed after the delete (saved again) stays.
        Raises BackendError while the store cannot do it."""
        async with self._lock(path):
            single_file, stored = await trio.to_thread.run_sync(self.stored.manifest, path)
            if stored is not None:
                with contextlib.suppress(mf.ManifestError):
                    if mf.decode(stored).committed_ns > committed_ns:
                        log.info("%s in %s was saved again after its delete: kept", path,
                                 self.backend.url)
                        return
            objects = await trio.to_thread.run_sync(self.stored.remove, path, single_file)
        log.info("deleted %s from %s (%d objects, %d bytes)", path, self.backend.url,
                 len(objects), sum(o.size for o in objects))

    async def _apply_retention(self, run_dir: str) -> None:
        """Delete all but the newest `keep_persist` steps of `run_dir` from the store (the
        next persisted step tries again if the store cannot list them now), never the step
        that a tracker in the store names: a fresh node resumes from it."""
        try:
            steps, tracker_paths = await self.stored.steps_in(run_dir)
            kept = set()
            for tracker in tracker_paths:
                kept |= await trio.to_thread.run_sync(self.stored.named_by_tracker, tracker,
                                                    steps)
        except BackendError as exc:
            log.warning("retention in %s could not list %s yet: %s", self.backend.url,
                        run_dir or ".", exc)
            return
        for path in sorted(steps, key=steps.__getitem__)[:-self.keep_persist]:
            if path in kept:
                log.info("retention keeps %s in %s: the tracker there names it", path,
                         self.backend.url)
                continue
            try:
                await self.retire(path)
            except BackendError as exc:
                log.warning("retention could not delete %s yet: %s", path, exc)

    async def retire(self, path: str) -> None:
        """Remove a step from the store: its manifest first, so it is never seen half gone."""
        objects = await trio.to_thread.run_sync(self.stored.remove, path)
        log.info("retention removed %s from %s (%d objects)", path, self.backend.url,
                 len(objects))
        self._steps.retired(path)
        if self._shares is not None:
            try:
                await self._shares.note_store(path, None, RETIRED)
            except SharesUnavailable as exc:
                log.warning("the other nodes do not know yet that %s left %s: %s", path,
                            self.backend.url, exc)


    # -- symbolic links (fs.model.links): one small object per directory ------------------------

    async def put_links(self, directory: str, links: dict[str, str]) -> None:
        """The store keeps these links of `directory` (none: its object goes). Raises
        BackendError while it cannot."""
        key = layout.join(directory, symlinks.LINKS_OBJECT)
        if links:
            await trio.to_thread.run_sync(self.backend.put_bytes, key, symlinks.encode(links),
                                          limiter=self._threads)
        else:
            await trio.to_thread.run_sync(self.backend.delete, [key], limiter=self._threads)


def _small(entry: mf.FileEntry) -> bool:
    """Whether the file goes up as one short request (not an appended file's segments)."""
    return entry.size <= SMALL_FILE and not entry.segments


def _held(entry: mf.FileEntry | None) -> tuple[int, str, tuple[int, ...]] | None:
    """What the store's objects of a file hold: its bytes, and the pieces they are in."""
    return None if entry is None else (entry.size, entry.xxh3, entry.segments)
