"""One batch being made from its task: the reads, the decodes and the error policy, step by step. No Ray.

A task names its samples and their augmentation seeds. The member's source says where the samples are
(`Source.locate`: byte ranges of shards, loading a shard's index block where the source keeps one);
neighbouring ranges are coalesced into blocks and fetched on the IO pool (`io_concurrency` threads: many
for S3, a few for disk; several blocks per IO task when a batch has many, as an image folder's one-file
blocks). Through a node cache, a batch first reads what the cache holds (`Storage.hits_only`) on a small
pool of its own (as many threads as local disk's), and each block the cache lacks goes on to the IO pool's
many tasks as it is found missing. As each block lands, its samples are cut out and queued for the decode
threads, so IO and decode overlap within a batch; decode threads take the queued samples a chunk at a time,
decode a chunk's JPEGs in one native call (libjpeg-turbo and the C kernel, the GIL released once per chunk)
and write straight into each sample's slot of the batch's preallocated arrays.

A sample that fails is settled by the error policy: replaced by a substitute drawn from its slot's seed
("replace"), or left out of the batch and recorded in the result for the iterator to skip or raise.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, as_completed
from concurrent.futures import wait as futures_wait

import numpy as np

from raydl.batch.collate import collate, infer_field
from raydl.batch.member import MemberReader
from raydl.batch.whole import WholeBatchRun
from raydl.describe.fields import Field
from raydl.errors import DataSourceError, DecodeError, LoaderError
from raydl.plan.failures import Failure, Replaced
from raydl.plan.tasks import BatchResult, BatchTask
from raydl.storage.base import NotCached, Storage
from raydl.storage.fetch import Block, coalesce

__all__ = ["BatchRun", "run_together"]

IO_TASKS_PER_THREAD = 4  # a batch's blocks go to this many IO tasks per IO thread (fewer when there are few)
# Samples a decode thread takes at once (one native call); fewer as the batch's queue drains.
DECODE_CHUNK = 16


def run_together(jobs: list[tuple[MemberReader, BatchTask, dict[str, np.ndarray]]]) -> list[BatchResult]:
    """Make a batch's runs at once (one member's, or each member's rows of one batch):
    every one's reads start before any is waited for. On a failure, raise once none of their tasks still
    runs."""
    rows = sum(len(task.ids) for _w, task, _i in jobs) or 1
    runs = [
        WholeBatchRun(member, task, _per_sample(member, task, images, len(task.ids) / rows))
        if member.reads_batches
        else BatchRun(member, task, images, len(task.ids) / rows)
        for member, task, images in jobs
    ]
    try:
        for run in runs:
            run._start_fetches()
        for run in runs:
            run._wait()
    except BaseException:
        # The batch fails and its buffer goes back to the pool: none of its tasks may still be writing there.
        for run in runs:
            run._wait_io(raise_first=False)
            futures_wait(list(run._decode_tasks))
        raise
    return [run._result() for run in runs]


def _per_sample(member: MemberReader, task: BatchTask, images: dict[str, np.ndarray], share: float):
    """How a batch the source reads whole is read sample by sample when its `read_batch` fails: None where
    the source only reads whole batches."""
    if member.source.reads_batches:
        return None
    return lambda: BatchRun(member, task, images, share)


class BatchRun:
    """One batch being made, from its task to its BatchResult (a batch maker makes one per member of a batch).

    Its steps: `fetch` (an IO task) reads blocks and cuts their samples out; `enqueue` queues the samples
    for the decode pool and starts a `drain` when fewer than `threads` are on them; a `drain` decodes the
    queue a chunk per native call; `finish` settles each sample as the error policy says. A failed drain
    stops the batch: nothing more of it is read or decoded.
    """

    def __init__(
        self, member: MemberReader, task: BatchTask, images: dict[str, np.ndarray], share: float = 1.0
    ) -> None:
        self._member, self._task, self._images = member, task, images  # images: field -> (n, ...) slots
        self._program, self._policy = member.spec.program, member.spec.policy
        self._ids = task.ids.astype(np.int64, copy=True)  # substitutes are written into it
        self._located = member.source.locate(member.catalog, self._ids)
        loc = self._located
        self._keys = list(loc.key)
        # Each slot's fields besides the decoded images (all of them after the user's map/pad stages)
        self._values: list[dict] = [{} for _ in range(len(task.ids))]
        self._slot_cache: dict[tuple[str, int], np.ndarray] = {}
        self._where = np.stack([loc.shard, loc.offset, loc.length, loc.row], axis=1).astype(np.int64)
        self._sizes = loc.size if loc.size is not None else loc.length  # a sample's own bytes
        shard_ids = np.unique(self._where[:, 0])
        self._shards = dict(zip(shard_ids.tolist(), member.shard_infos(shard_ids), strict=True))
        self._failed: list[Failure | None] = [None] * len(task.ids)
        self._replaced: list[Replaced] = []
        # Samples whose bytes are in, waiting for a decode thread. A drain task takes them a chunk at a time
        # and decodes a chunk in one native call; at most `threads` drains of this batch run or wait at once.
        self._ready: deque[tuple[int, dict]] = deque()
        self._lock = threading.Lock()
        self._drains = 0  # drain tasks of this batch submitted and not yet finished
        # Set when a drain failed, so the batch fails: no more reading or decoding for it.
        self._stop = threading.Event()
        # `share`: this run's share of a batch that several runs make at once (a mix's members); its IO tasks
        # are that share of the pool's, so the runs together make as many as one batch would. Its decode
        # drains are not cut: the last run to finish would decode its tail on one thread.
        self._share = share
        self._threads = member.pools.threads
        # Through a node cache: this batch's reads counted apart, their entries written behind
        self._storage = member.storage.scoped(behind=True)
        # Every IO task and every decode-pool task of this batch: a failed batch waits for them all.
        self._io_tasks: list[Future] = []
        self._decode_tasks: list[Future] = []

    def _start_fetches(self) -> None:
        # Several blocks per IO task, each handed to the decode threads as it lands: an image folder has one
        # block per file, and a task (and a thread wake-up) per file cost more CPU than reading it. There are
        # still IO_TASKS_PER_THREAD tasks per IO thread to spread the requests over.
        io = self._member.pools.io
        todo = np.arange(len(self._where))
        if self._located.errors:  # their shard's index block could not be had: nothing to read
            self._unlocated(self._located.errors)
            todo = np.setdiff1d(todo, np.fromiter(self._located.errors, np.int64))
        # Where the catalog knows each sample's size, never read one that is too big.
        if self._member.source.range_is_sample:
            sizes = np.asarray(self._sizes)[todo]
            for i in todo[sizes > self._member.spec.max_sample_bytes].tolist():
                self._submit(
                    self.finish,
                    i,
                    self._member.too_big(int(self._task.ids[i]), self._uri(i), self._sizes[i]),
                )
            todo = todo[sizes <= self._member.spec.max_sample_bytes]
        blocks = coalesce(self._where[todo, :3].tolist())
        if len(todo) < len(self._where):  # members index the rows read, not the batch's rows
            blocks = [
                Block(b.shard, b.offset, b.length, tuple(todo[list(b.members)].tolist())) for b in blocks
            ]
        self._per_task = self._blocks_per_task(len(blocks), io.concurrency)
        hits = self._storage.hits_only()
        if hits is None:
            for k in range(0, len(blocks), self._per_task):
                self._submit_io(self.fetch, blocks[k : k + self._per_task])
            return
        # One task per thread of the view's, on a pool of that many threads shared by the batches a worker
        # makes at once: hits are local reads, and more threads at them only wait for the GIL
        concurrency = hits.default_io_concurrency
        pool = self._member.pools.hits_io(concurrency)
        per = max(1, len(blocks) // max(1, round(concurrency * self._share)))
        for k in range(0, len(blocks), per):
            self._submit_io(self.fetch_hits, hits, blocks[k : k + per], pool=pool)

    def _blocks_per_task(self, blocks: int, concurrency: int) -> int:
        return max(1, blocks // max(1, round(IO_TASKS_PER_THREAD * concurrency * self._share)))

    def _submit_io(self, fn, *args, pool=None) -> None:
        future = (pool or self._member.pools.io).submit(fn, *args)
        with self._lock:
            self._io_tasks.append(future)

    def _wait(self) -> None:
        """Until every IO task, then every decode task, has ended; the first error of one is raised here."""
        self._wait_io(raise_first=True)
        for f in self._decode_tasks:  # complete: only the IO tasks, all done now, submit decode tasks
            f.result()  # a LoaderError (not the sample's fault) fails the batch here

    def _wait_io(self, *, raise_first: bool) -> None:
        """Until every IO task has ended, those that IO tasks submit included (a cache's misses, submitted by
        the task that found them missing before it ends); with `raise_first`, the first error is raised."""
        seen = 0
        while True:
            with self._lock:
                pending = self._io_tasks[seen:]
            if not pending:
                return
            seen += len(pending)
            if not raise_first:
                futures_wait(pending)
                continue
            for done in as_completed(pending):
                done.result()

    # -- the steps ------------------------------------------------------------------------
    def fetch(self, blocks: list[Block]) -> None:
        """One IO task: read `blocks` one after the other, each one's samples queued for decode as it
        lands."""
        for block in blocks:
            if self._stop.is_set():
                return
            data = self._read(block)
            if data is not None:
                self.enqueue(self._cut(block, data))

    def fetch_hits(self, hits: Storage, blocks: list[Block]) -> None:
        """One IO task through a node cache: read `blocks` from the cache's `hits` view, each one's samples
        queued for decode as it lands; the blocks it does not hold go to IO tasks of their own (`fetch`), as
        many blocks a task as a batch of them all would give, each submitted once that many are missing."""
        missed: list[Block] = []
        for block in blocks:
            if self._stop.is_set():
                return
            try:
                # No piece is settled as unreadable and then read again: the view raises NotCached only for a
                # ranged read, which never fails with a DataSourceError (a bad entry is a miss), and a block's
                # pieces all share its shard, so they are all ranged reads or all a compressed shard's.
                got = [(piece, self._read(piece, hits)) for piece in self._pieces(block)]
            except NotCached:
                missed.append(block)
                if len(missed) >= self._per_task:
                    self._submit_io(self.fetch, missed)
                    missed = []
                continue
            # the block's samples queued at once, as a block read from the store queues them
            samples = [one for piece, data in got if data is not None for one in self._cut(piece, data)]
            if samples:
                self.enqueue(samples)
        if missed:
            self._submit_io(self.fetch, missed)

    def _pieces(self, block: Block) -> list[Block]:
        """The block as its samples' own ranges, one block per range (with the members that share it): the
        cache keeps each range apart, so a hit is cut from its own bytes, never pasted into a block first."""
        if len(block.members) == 1:
            return [block]
        by_range: dict[tuple[int, int], list[int]] = {}
        for i in block.members:
            by_range.setdefault((int(self._where[i, 1]), int(self._where[i, 2])), []).append(i)
        if len(by_range) == 1:
            return [block]
        return [Block(block.shard, o, n, tuple(m)) for (o, n), m in by_range.items()]

    def enqueue(self, samples: list[tuple[int, dict]]) -> None:
        """Queue the samples for the decode threads; start a drain task if fewer than `threads` are on it."""
        with self._lock:
            if self._stop.is_set():
                return
            self._ready.extend(samples)
            if self._drains >= self._threads:
                return
            self._drains += 1
        self._submit(self.drain)

    def drain(self) -> None:
        """One decode task: decode the queued samples a chunk at a time until the queue is empty."""
        try:
            while chunk := self._take():
                self._decode(chunk)
        except BaseException:
            with self._lock:
                self._drains -= 1
                self._stop.set()
                self._ready.clear()
            raise

    def finish(self, i: int, failure: Failure | None) -> None:
        """Settle slot i: decoded (no failure), substituted, or left failed for the iterator, as the policy
        says."""
        if failure is None:
            return
        if self._policy.action(failure) != "replace":
            self._failed[i] = failure
            return
        sid, seed = int(self._task.ids[i]), int(self._task.seeds[i])
        self._ids[i], self._keys[i], self._values[i] = self._member.substitute(failure, seed, self._slots(i))
        self._replaced.append(Replaced(sid, failure.uri, failure.reason, int(self._ids[i])))

    # -- inside the steps -----------------------------------------------------------------
    def _read(self, block: Block, storage: Storage | None = None) -> bytes | None:
        """The block's bytes read through `storage` (the batch's by default); None when they cannot be read,
        its samples then settled as unreadable. NotCached from a cache's `hits_only` view goes to the
        caller."""
        shard = self._shards[block.shard]
        storage = self._storage if storage is None else storage
        if storage.uses_plans and len(block.members) > 1:  # a cache keeps a block as its samples' ranges
            where = self._where[list(block.members), 1:3]
            storage.plan(shard.uri, block.offset, block.length, sorted(set(map(tuple, where.tolist()))))
        try:
            return self._member.source.read_block(storage, shard, block.offset, block.length)
        except DataSourceError as exc:
            self._unreadable(block.members, shard.uri, exc)
            return None

    def _cut(self, block: Block, data: bytes) -> list[tuple[int, dict]]:
        """Each sample's bytes cut out of its block's; a sample that cannot be cut is settled as the source's
        error says (a failed read, a missing field, a field that does not decode)."""
        uri = self._shards[block.shard].uri
        samples = []
        if self._member.source.cut_views:  # it copies out what it keeps: no copy here
            data = memoryview(data)
        for i in block.members:
            _, offset, length, _ = (int(v) for v in self._where[i])
            start = offset - block.offset
            piece = data if (start == 0 and length == len(data)) else data[start : start + length]
            try:
                record = self._member.source.cut(self._located, i, piece)
            except DataSourceError as exc:
                self._unreadable([i], uri, exc)
                continue
            except DecodeError as exc:  # a field's bytes are malformed (JSON, .npy, gzip)
                failure = Failure.decode_failed(
                    int(self._task.ids[i]), self._uri(i), exc, worker=self._member.name
                )
                self._submit(self.finish, i, failure)
                continue
            big = self._member.too_big(int(self._task.ids[i]), self._uri(i), self._member.image_bytes(record))
            if big is not None:  # a Parquet cell, whose size only its decoded row group tells
                self._submit(self.finish, i, big)
                continue
            samples.append((i, record))
        return samples

    def _unlocated(self, errors: dict[int, DataSourceError]) -> None:
        for i, exc in errors.items():
            self._unreadable([i], self._shards[int(self._where[i, 0])].uri, exc)

    def _unreadable(self, members: list[int], uri: str, exc: DataSourceError) -> None:
        """Settle samples the source could not give: a failed read of shard `uri`, or a field the sample
        lacks, which is its own defect (Failure.source_failed tells them apart). Settled on the decode pool:
        under "replace" a substitute is read and decoded there, not on an IO thread."""
        for i in members:
            failure = Failure.source_failed(int(self._task.ids[i]), uri, self._uri(i), exc)
            self._submit(self.finish, i, failure)

    def _take(self) -> list[tuple[int, dict]]:
        """The next chunk of the queue (fewer samples as it drains, so every drain gets some); [] when it is
        empty, and the calling drain ends."""
        with self._lock:
            if not self._ready:
                self._drains -= 1
                return []
            take = min(len(self._ready), DECODE_CHUNK, -(-len(self._ready) // self._threads))
            return [self._ready.popleft() for _ in range(take)]

    def _decode(self, chunk: list[tuple[int, dict]]) -> None:
        """Decode a chunk (its JPEGs in one native call), each sample's images into its slots, then finish
        each sample."""
        seeds, ids = self._task.seeds, self._task.ids
        items = [(int(ids[i]), self._uri(i), rec, int(seeds[i]), self._slots(i)) for i, rec in chunk]
        for (i, _), (failure, values) in zip(chunk, self._member.make_samples(items), strict=True):
            self._values[i] = values
            self.finish(i, failure)

    def _slots(self, i: int) -> dict[str, np.ndarray]:
        """Slot i of each decoded image field (the same view objects each time: `_result` tells by identity
        whether the user's stages kept them)."""
        out = {}
        for name, arr in self._images.items():
            view = self._slot_cache.get((name, i))
            if view is None:
                view = self._slot_cache[(name, i)] = arr[i]
            out[name] = view
        return out

    def _uri(self, i: int) -> str:
        """Slot i's sample as errors name it."""
        return self._member.source.sample_uri(self._shards[int(self._where[i, 0])].uri, self._keys[i])

    def _submit(self, fn, *args) -> None:
        """Run fn(*args) on the decode pool, as a task of this batch."""
        self._decode_tasks.append(self._member.pools.decode(fn, *args))

    def _result(self) -> BatchResult:
        """The batch without its failed rows, and what failed or was replaced in it."""
        member = self._member
        ok = np.array([f is None for f in self._failed], dtype=bool)
        bad = [f for f in self._failed if f is not None]
        rows = np.flatnonzero(ok).tolist()
        full = len(rows) == len(ok)  # the batch gets shorter by the failed rows (maybe to 0), keeps its place
        values = [self._values[i] for i in rows]

        def uri_of(row: int) -> str:
            return self._uri(rows[row])

        batch: dict = {}
        if member.spec.sample_stages:  # the records the user's stages returned make the batch
            names = list(values[0]) if values else [f.name for f in member.source.fields]
            kinds = {f.name: f for f in member.source.fields}
            for row, v in enumerate(values):
                if list(v) != names:
                    raise LoaderError(
                        f"loader worker {member.name}: the records of one batch have different fields: "
                        f"{names} in {uri_of(0)}, {list(v)} in {uri_of(row)}"
                    )
            for name in names:
                column = [v[name] for v in values]
                image = self._images.get(name)
                if image is not None and all(
                    c is s for c, s in zip(column, self._slot_views(name, rows), strict=True)
                ):
                    batch[name] = image if full else image[ok]  # the user's stage kept the slot itself
                    continue
                field = kinds.get(name)
                if field is None or field.kind == "image":
                    field = infer_field(name, column[0]) if column else Field(name)
                batch[name] = collate(field, column, uri_of)
        else:
            for field in member.source.fields:
                image = self._images.get(field.name)
                if image is not None:
                    batch[field.name] = image if full else image[ok]
                else:
                    batch[field.name] = collate(field, [v[field.name] for v in values], uri_of)
        batch["id"] = self._ids if full else self._ids[ok]
        batch["key"] = [self._keys[i] for i in rows]
        if self._task.bucket is not None:
            batch["bucket"] = tuple(self._task.bucket)
        if member.spec.batch_stages:
            batch = member.batch_stages(batch, self._task)
        return BatchResult(
            batch=batch,
            skipped=[f for f in bad if not f.unreadable],
            unreadable=[f for f in bad if f.unreadable],
            replaced=sorted(self._replaced, key=lambda r: r.sample_id),
            cache=self._cache_counts(),
        )

    def _cache_counts(self) -> dict[str, int]:
        """The node cache's counters of this batch's reads, and of the worker's own since its last batch
        (footers, index blocks, substitutes: every count lands in exactly one batch); {} without a
        cache. The entries this batch's misses write behind are on disk once it returns."""
        self._storage.flush()
        mine, shared = self._storage.take_cache_counts(), self._member.storage.take_cache_counts()
        return {k: mine[k] + shared[k] for k in mine}

    def _slot_views(self, name: str, rows: list[int]):
        """The slot views `_slots` handed to the user's stages (compared by identity: kept or replaced)."""
        return [self._slot_cache.get((name, i)) for i in rows]
