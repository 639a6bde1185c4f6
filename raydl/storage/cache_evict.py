"""Eviction from the node cache: the least recently used entries removed until the ledger's total is at a
target, with the node-wide lock held for a bounded amount of work at a time.

Why this way. An eviction pass must find the entries used longest ago among all of the folder's, and the
folder holds an entry per sample (ten million on a large node). Listing, stat'ing and sorting all of them
under the lock, as one pass did, made every other writer on the node wait for it, and the evicting process
hold the whole list: another writer waited 0.9-1.7 s at 100,000 entries and 16-21 s at 1,000,000, and
the evicting process grew by 28 and 281 MiB (`raydl bench cache --eviction`, two runs on tmpfs here); at
ten million, minutes and about 3 GiB. The ways out:

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
from a random shard on, one shard's listing at a time: the entries used before the cutoff are gathered and
removed, oldest first, a step at a time, until the pass has freed what it set out to free (the total's
excess over its target when it began: what others write meanwhile is their room, not more work). The
walk keeps aside the RESERVE oldest entries past the cutoff and removes them next, oldest first, if it
ends short (the estimate came out low); a new sample and walk follow only if that is not enough (at most
ROUNDS). When the sample is the whole folder (at most SAMPLE entries) it is the exact least-recently-used
order, removed as such. Held in memory: the sample, the reserve and one shard's listing (N/4,096 entries:
2,400 at ten million). The pass reads the folder about once, as one pass under the lock did, but outside
it: on a thread of its own after a write past the high-water mark, or in the thread of a write that
does not fit (raydl/storage/node_cache.py); `raydl bench cache --eviction` measures both.

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
import heapq
import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from raydl.storage.cache_folder import EVICTING, CacheFolder, Ledger

__all__ = ["RESERVE", "ROUNDS", "SAMPLE", "STEP", "claimed", "evict"]

SAMPLE = 16_384  # entries read to estimate the cutoff (and the whole order of a cache this small)
STEP = 64  # entries removed per hold of the lock
RESERVE = 4096  # the oldest entries past the cutoff a walk keeps aside, to finish with if the cutoff was low
ROUNDS = 3  # sample-and-walk rounds a pass tries before it gives up on reaching its goal

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


class _Goal:
    """What a pass still has to do: free `to_free` bytes (fixed when it starts: what others write meanwhile
    is their room, not more work for this pass), or stop early once the total is at `target`."""

    def __init__(self, target: float, to_free: float) -> None:
        self.target, self.to_free = target, to_free

    def met(self, led: Ledger) -> bool:
        return self.to_free <= 0 or led.total <= self.target


def evict(folder: CacheFolder, locked: Locked, target: float, *, everything: bool = False) -> int:
    """Remove the least recently used entries until they free what the ledger's total was over `target`
    when the pass began (or the total is at `target`), in steps of at most STEP removals under `locked()`;
    with `everything`, every entry of the cache's own. How many were removed. Call it holding `claimed`."""
    with locked() as led:
        total, added = led.total, led.added
    if total <= target:
        return 0
    # listed after `added` is read: an entry in a shard made later is in the bytes added since, one made
    # earlier is in a shard listed here (listed before, a new shard's entry would be in neither)
    shards = folder.shards()
    random.shuffle(shards)
    if everything:
        return _walk(folder, locked, shards, None, _Goal(target, float("inf")), unused=False)
    removed = 0
    goal = None
    for _ in range(ROUNDS):
        sample, complete = _sample(folder, shards)
        if complete:  # the whole folder: its exact total, and its exact order
            total = _rebase(locked, sum(size for _, size, _, _ in sample), added)
            goal = goal or _Goal(target, total - target)
            return removed + _remove(folder, locked, sorted(sample), goal, unused=True)[0]
        goal = goal or _Goal(target, total - target)
        cutoff = _cutoff(sample, goal.to_free / total if total > 0 else 1.0)
        del sample
        removed += _walk(folder, locked, shards, cutoff, goal, unused=True)
        with locked() as led:
            if goal.met(led):
                break
            total, added = led.total, led.added
        shards = folder.shards()
        random.shuffle(shards)
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


def _walk(folder: CacheFolder, locked: Locked, shards: list[str], cutoff: int | None, goal: _Goal, *,
          unused: bool) -> int:  # fmt: skip
    """Every shard in turn: its entries used at or before `cutoff` (None: all) gathered, and removed STEP at
    a time (a step may span shards) until the goal is met. The oldest RESERVE entries past the cutoff are
    kept aside, and removed next, oldest first, when the walk ends short of its goal (the cutoff came out
    low). A walk that reaches the end has seen every entry: it sets the ledger's total from what it left.
    How many it removed."""
    with locked() as led:
        added = led.added
    known = set(shards)  # and the shards made since they were listed: their entries are not in `added`
    shards = shards + [s for s in folder.shards() if s not in known]
    removed = left = 0
    pending: list[Item] = []
    reserve: list[tuple[int, int, str, str]] = []  # a max-heap of (-mtime, ...): the oldest past the cutoff
    for i, shard in enumerate(shards):
        for m, size, name in folder.scan_shard(shard):
            if cutoff is None or m <= cutoff:
                pending.append((m, size, shard, name))
                continue
            left += size
            if len(reserve) < RESERVE:
                heapq.heappush(reserve, (-m, size, shard, name))
            elif -reserve[0][0] > m:
                heapq.heapreplace(reserve, (-m, size, shard, name))
        if len(pending) >= STEP or i == len(shards) - 1:
            pending.sort()
            n, rest, done = _remove(folder, locked, pending, goal, unused=unused)
            removed, left, pending = removed + n, left + rest, []
            if done:
                return removed
    aside = sorted((-m, size, shard, name) for m, size, shard, name in reserve)
    n, rest, done = _remove(folder, locked, aside, goal, unused=unused)
    _rebase(locked, left - (sum(size for _, size, _, _ in aside) - rest), added)
    return removed + n


def _remove(folder: CacheFolder, locked: Locked, items: list[Item], goal: _Goal, *,
            unused: bool) -> tuple[int, int, bool]:  # fmt: skip
    """`items` removed in order, STEP per hold of the lock, each re-checked (the cache's own; with `unused`,
    not used since it was read), until the goal is met. (removed, bytes of the items left, whether the goal
    was met)."""
    removed = 0
    left = sum(size for _, size, _, _ in items)
    met = False  # with no item, nothing was removed: only others' writes moved the total, upwards
    for at in range(0, len(items), STEP):
        fds: dict[str, int] = {}
        try:
            with locked() as led:
                for mtime, size, shard, name in items[at : at + STEP]:
                    if goal.met(led):
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
                        goal.to_free -= got
                        removed += 1
                        left -= size
                met = goal.met(led)
        finally:
            for fd in fds.values():
                os.close(fd)
        if met:
            break
    return removed, left, met


def _rebase(locked: Locked, left: int, added: int) -> int:
    """After reading every shard: the total is the bytes seen and left plus those added since the reading
    began (an entry added meanwhile and seen too is counted twice: the total errs above, never below).
    The total after."""
    with locked() as led:
        if led.added >= added:
            led.total = left + (led.added - added)
        return led.total
