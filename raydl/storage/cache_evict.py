"""Eviction from the node cache: the least recently used entries removed until the ledger's total is at a
target, with the node-wide lock held for a bounded amount of work at a time.

Why this way. An eviction pass must find the entries used longest ago among all of the folder's, and the
folder holds an entry per sample (ten million on a large node). Listing, stat'ing and sorting all of them
under the lock, as one pass did, made every other writer on the node wait for it (0.45-6.9 s at 100,000
entries here, minutes at ten million) and made the evicting process hold the whole list (about 300 bytes
an entry). The ways out:

* a size ledger: kept (PATH/state, updated under the lock by every add and removal), so that no one
  counts the folder to know its total; but it does not say which entries are the oldest;
* an on-disk LRU list: every hit of every process would write it, under a lock, where a hit now only
  touches its file's mtime;
* sharded folders alone: entries already sit in 4,096 folders by their URI's hash, which bounds a step
  that reads one folder by N/4,096 entries, not by a constant;
* chosen: the entries are found OUTSIDE the lock, and removed under it in steps of at most STEP. A step
  takes the lock, re-checks each of its files (lstat: still a regular file of the cache's own, its
  mtime unchanged since it was read, so not used since), unlinks it, subtracts its size from the
  ledger, and lets go. No step reads a folder; its work under the lock is constant in the cache's size.

How the oldest are found with bounded memory. A sample: whole shard folders read in a random order until
SAMPLE entries are in hand. The URI hash spreads entries over the shards regardless of when they were
used, so the sample's ages are drawn like the folder's, and its byte-weighted quantile at the share to
free estimates the cutoff: the last use before which the entries to remove were last used. Then a walk,
from a random shard on, one shard's listing at a time: a shard's entries used before the cutoff are
removed, oldest first, and the walk stops as soon as the ledger is at the target. A walk that ends above
it (the estimate came out low) is followed by another sample and walk (at most ROUNDS). When the sample
is the whole folder (at most SAMPLE entries) it is the exact least-recently-used order, removed as such.
Held in memory: the sample and one shard's listing (N/4,096 entries: 2,400 at ten million).

The ledger stays right. A writer adds to the ledger before its rename and a remover subtracts after its
unlink, so a process killed between the two leaves the total above the folder's bytes, never below (the
cache then holds a little less than max_bytes). A pass that read every shard (a sample that is the whole
folder, or a walk to the end) knows the bytes there; with the bytes others added meanwhile (the ledger's
`added`), it sets the total from the folder again, so such an excess lasts one pass at most.

One process evicts at a time: it holds PATH/evicting (an fcntl lock, `claimed`). Writers that still fit
under max_bytes write on while it works; raydl/storage/node_cache.py says who starts a pass and what a
writer that does not fit does.
"""

from __future__ import annotations

import fcntl
import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from raydl.storage.cache_folder import EVICTING, CacheFolder, Ledger

__all__ = ["ROUNDS", "SAMPLE", "STEP", "claimed", "evict"]

SAMPLE = 16_384  # entries read to estimate the cutoff (and the whole order of a cache this small)
STEP = 64  # entries removed per hold of the lock
ROUNDS = 3  # sample-and-walk rounds a pass tries before it gives up on reaching its target

Locked = Callable[[], AbstractContextManager[Ledger]]
Item = tuple[int, int, str, str]  # (mtime_ns, size, shard, name)


@contextmanager
def claimed(folder: CacheFolder, thread_lock: threading.Lock, *, wait: bool) -> Iterator[bool]:
    """Whether this thread is the node's one evicting thread (PATH/evicting's fcntl lock, and `thread_lock`
    between this process's threads): without `wait`, False at once when another holds it."""
    if not thread_lock.acquire(blocking=wait):
        yield False
        return
    try:
        fd = folder.open_lock(EVICTING)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                got = False
            else:
                got = True
            yield got
        finally:
            os.close(fd)  # releases the flock
    finally:
        thread_lock.release()


def evict(folder: CacheFolder, locked: Locked, target: float, *, everything: bool = False) -> int:
    """Remove the least recently used entries until the ledger's total is <= `target`, in steps of at most
    STEP removals under `locked()`; with `everything`, every entry of the cache's own. How many were
    removed. Call it holding `claimed`."""
    shards = folder.shards()
    removed = 0
    for _ in range(1 if everything else ROUNDS):
        with locked() as led:
            total, added = led.total, led.added
        if total <= target:
            break
        random.shuffle(shards)
        cutoff = None
        if not everything:
            sample, complete = _sample(folder, shards)
            if complete:  # the whole folder: its exact order, and its exact total
                _rebase(locked, sum(size for _, size, _, _ in sample), added)
                removed += _remove(folder, locked, sorted(sample), target, True)[0]
                break
            cutoff = _cutoff(sample, (total - target) / total if total > 0 else 1.0)
            del sample
        n, left, done = _walk(folder, locked, shards, cutoff, target, not everything)
        removed += n
        if done:
            break
        _rebase(locked, left, added)
    return removed


def _sample(folder: CacheFolder, shards: list[str]) -> tuple[list[Item], bool]:
    """Whole shards' entries, in `shards`' order, until SAMPLE are in hand; and whether that is all."""
    sample: list[Item] = []
    for i, shard in enumerate(shards):
        sample.extend((m, size, shard, name) for m, size, name in folder.scan_shard(shard))
        if len(sample) >= SAMPLE and i < len(shards) - 1:
            return sample, False
    return sample, True


def _cutoff(sample: list[Item], share: float) -> int:
    """The last use (mtime_ns) such that the sample's entries used at or before it hold `share` of its
    bytes."""
    sample.sort()
    want = share * sum(size for _, size, _, _ in sample)
    got = 0
    for mtime, size, _, _ in sample:
        got += size
        if got >= want:
            return mtime
    return sample[-1][0] if sample else 0


def _walk(folder: CacheFolder, locked: Locked, shards: list[str], cutoff: int | None, target: float,
          unused: bool) -> tuple[int, int, bool]:  # fmt: skip
    """Every shard in turn: remove its entries used at or before `cutoff` (None: all), oldest first, until the
    ledger is at `target`. (removed, bytes of the entries seen and left, whether the target was reached)."""
    removed = left = 0
    for shard in shards:
        entries = folder.scan_shard(shard)
        old = sorted((m, size, shard, name) for m, size, name in entries if cutoff is None or m <= cutoff)
        left += sum(size for _, size, _ in entries) - sum(size for _, size, _, _ in old)
        n, rest, done = _remove(folder, locked, old, target, unused)
        removed += n
        left += rest
        if done:
            return removed, left, True
    return removed, left, False


def _remove(folder: CacheFolder, locked: Locked, items: list[Item], target: float,
            unused: bool) -> tuple[int, int, bool]:  # fmt: skip
    """`items` removed in order, STEP per hold of the lock, each re-checked (the cache's own; with `unused`,
    not used since it was read), until the ledger is at `target`. (removed, bytes of the items left,
    whether the target was reached)."""
    removed = 0
    left = sum(size for _, size, _, _ in items)
    reached = False  # with no item, nothing was removed: only others' writes moved the total, upwards
    for at in range(0, len(items), STEP):
        fds: dict[str, int] = {}
        try:
            with locked() as led:
                for mtime, size, shard, name in items[at : at + STEP]:
                    if led.total <= target:
                        return removed, left, True
                    fd = fds.get(shard)
                    if fd is None:
                        try:
                            fd = fds[shard] = folder.open_shard(shard)
                        except FileNotFoundError:
                            continue
                    got = folder.remove(fd, name, mtime_ns=mtime if unused else None)
                    if got is not None:
                        led.total -= got
                        removed += 1
                        left -= size
                reached = led.total <= target
        finally:
            for fd in fds.values():
                os.close(fd)
    return removed, left, reached


def _rebase(locked: Locked, left: int, added: int) -> None:
    """After a walk of every shard: the total is the bytes the walk left plus those added since it began
    (an entry added during the walk and seen by it is counted twice: the total errs above, never below)."""
    with locked() as led:
        if led.added >= added:
            led.total = left + (led.added - added)
