"""Fetching byte ranges: pure decisions (which ranges to merge, when to retry) and the IO pool that runs them.

Coalescing: a batch's samples become (shard, offset, length) ranges; ranges of
one shard that overlap or lie within `max_gap` bytes of each other merge into
one block (neighbouring tar members, one Parquet column chunk shared by many
rows), up to `max_block` bytes. Fewer, larger requests are what object stores
reward; the gap bytes read and thrown away are cheaper than a request.

Retry: a pure policy says whether an attempt that failed with a given kind of
error is tried again and after how long (exponential backoff with full
jitter), bounded in count and in total time, and how long each try may take:
its own limit, never more than what is left of the total.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from raydl.options import check_number

__all__ = ["Block", "IOPool", "RetryPolicy", "coalesce"]

DEFAULT_MAX_GAP = 64 << 10
DEFAULT_MAX_BLOCK = 16 << 20


@dataclass(frozen=True)
class Block:
    """One request: `length` bytes of shard `shard` from `offset`, serving the ranges numbered `members`."""

    shard: int
    offset: int
    length: int
    members: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.length


def coalesce(
    ranges: Sequence[tuple[int, int, int]],
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    max_block: int = DEFAULT_MAX_BLOCK,
) -> list[Block]:
    """Merge (shard, offset, length) ranges into blocks; every range lies wholly inside exactly one block.

    Ranges of one shard, sorted by offset, join the current block while the
    gap to it is at most `max_gap` and the block stays within `max_block`
    bytes (a single range longer than that is its own block). Identical and
    overlapping ranges share a block. Output is sorted by (shard, offset);
    `members` are indices into `ranges`, in offset order.
    """
    if max_gap < 0 or max_block <= 0:
        raise ValueError(f"max_gap must be >= 0 and max_block > 0, got {max_gap}, {max_block}")
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1], ranges[i][2]))
    blocks: list[Block] = []
    shard = start = end = -1
    members: list[int] = []
    for i in order:
        s, off, n = ranges[i]
        if off < 0 or n < 0:
            raise ValueError(f"range {i} has a negative offset or length: {ranges[i]}")
        if members and s == shard and off <= end + max_gap and max(end, off + n) - start <= max_block:
            end = max(end, off + n)
            members.append(i)
            continue
        if members:
            blocks.append(Block(shard, start, end - start, tuple(members)))
        shard, start, end, members = s, off, off + n, [i]
    if members:
        blocks.append(Block(shard, start, end - start, tuple(members)))
    return blocks


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed request is tried again.

    Only `retryable` failures are retried (throttling, 5xx, connection
    errors, stalls; never 403 or 404), at most `attempts` tries in all and not past
    `deadline_s` seconds after the first. The wait before try k+1 is drawn
    uniformly from [0, min(max_delay_s, base_delay_s * 2**k)] (full jitter).
    Each try may take `attempt_timeout_s` (None: no limit of its own), and never
    more than what is left of `deadline_s`.
    """

    attempts: int = 5
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    deadline_s: float = 30.0
    attempt_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_number("attempts", self.attempts, integer=True, at_least=1)
        for name in ("base_delay_s", "max_delay_s", "deadline_s"):
            check_number(name, getattr(self, name), at_least=0)
        check_number("attempt_timeout_s", self.attempt_timeout_s, above=0, optional=True)

    def time_left(self, elapsed_s: float) -> float:
        """Seconds the try starting `elapsed_s` after the first may take: its own limit, within the total."""
        left = max(0.0, self.deadline_s - elapsed_s)
        return left if self.attempt_timeout_s is None else min(self.attempt_timeout_s, left)

    def delay(self, attempt: int, *, retryable: bool, elapsed_s: float, rand: float) -> float | None:
        """Seconds to wait before the next try after try number `attempt` (0-based) failed, or None: give up.

        `rand` is a uniform draw in [0, 1) (the caller's RNG, so this stays pure).
        """
        if not retryable or attempt + 1 >= self.attempts:
            return None
        wait = rand * min(self.max_delay_s, self.base_delay_s * (2**attempt))
        if elapsed_s + wait >= self.deadline_s:  # the next try would have no time left
            return None
        return wait


def call_with_retries(
    fn: Callable[[float], object],
    policy: RetryPolicy,
    *,
    is_retryable: Callable[[BaseException], bool],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    rng: random.Random | None = None,
):
    """fn(time_left_s) under `policy`, each try told the seconds it may take (`RetryPolicy.time_left`; fn
    keeps to them): the last failure is re-raised when the policy gives up."""
    rng = rng or random.Random()
    start = clock()
    attempt = 0
    while True:
        try:
            return fn(policy.time_left(clock() - start))
        except Exception as exc:  # noqa: BLE001 - is_retryable decides; the rest re-raise unchanged
            wait = policy.delay(
                attempt, retryable=is_retryable(exc), elapsed_s=clock() - start, rand=rng.random()
            )
            if wait is None:
                raise
        sleep(wait)
        attempt += 1


class IOPool:
    """The worker's IO threads, separate from its decode threads: `concurrency` requests in flight at most."""

    def __init__(self, concurrency: int, *, initializer: Callable[[], None] | None = None) -> None:
        self.concurrency = concurrency
        self._pool = ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="raydl-io", initializer=initializer
        )

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
