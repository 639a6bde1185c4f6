"""Which samples form batch k of rank r in epoch e: pure functions, no Ray.

An epoch's global order is a permutation of the sample ids that depends only
on (catalog fingerprint, seed, epoch, shuffle) - never on world_size, actor
count or timing. Ranks take batches of that order in turn: in round k, rank r
gets positions [(k*W + r)*B, (k*W + r + 1)*B). When the order does not divide
into whole rounds:

- drop_last=True: the incomplete last round is dropped, so every sample is
  delivered at most once and every rank gets the same number of full batches.
- drop_last=False: the last round gives each rank ceil(rem / W) positions; the
  few positions past the end wrap around to the start of the order (pad rows),
  so every sample is delivered at least once, only pad rows repeat, and every
  rank still gets the same number of batches. With W=1 nothing is padded: the
  last batch is just shorter.

A plan can start part-way through the order (`start`), which is how a resume
at another world size re-deals the rest of an epoch.

Each sample's augmentation seed is a pure function of (seed, epoch, sample id).

Aspect-ratio buckets (`bucket_batches`) make every batch hold one bucket's
samples: within each bucket the ids are shuffled and cut into batches (a
bucket's last batch is shorter, or dropped with drop_last), then the order of
all the batches is shuffled. The ranks deal those batches exactly as they deal
samples above, with one batch as the unit (EpochPlan with batch_size=1): equal
counts per rank, padding by wrapping (a pad is a whole batch of one bucket
again) and the re-deal at another world size carry over unchanged.

The order is a keyed bijection of [0, n) (a Feistel network with cycle
walking), evaluated only at the positions asked for: a rank computes the ids
of its own batches in O(batch_size) and never the whole permutation, so the
plan's cost per batch does not grow with world size or dataset size
(docs/benchmarks.md, "The control plane at scale").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raydl.options import positive_int
from raydl.util.splitmix import GAMMA, MASK64, mix64, mix64_array

__all__ = [
    "BucketBatches",
    "EpochOrder",
    "WindowedOrder",
    "EpochPlan",
    "augmentation_seeds",
    "bucket_batch_count",
    "bucket_batches",
    "epoch_order",
    "substitute_id",
]

_ROUNDS = 6  # Feistel rounds (even); 4 already make a pseudorandom permutation (Luby-Rackoff)


def _positions(positions, n: int) -> np.ndarray:
    """`positions` as int64, each in [0, n) (an IndexError otherwise)."""
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise IndexError(f"positions must be in [0, {n})")
    return pos


class EpochOrder:
    """An epoch's global sample order, a pure function of (n, seed, epoch, shuffle, fingerprint).

    `order[positions]` gives the sample ids at those positions (an int64 array),
    computed for those positions only; `np.asarray(order)` gives the whole order.
    The permutation is a Feistel network on [0, 2**m), 2**m < 2n, its halves of
    floor(m/2) and ceil(m/2) bits trading places every round, restricted to
    [0, n) by cycle walking (a value past n goes through the network again).
    """

    def __init__(self, num_samples: int, *, seed: int, epoch: int, shuffle: bool, fingerprint: str) -> None:
        self.num_samples = positive_int("num_samples", num_samples)
        self.shuffle = shuffle
        m = max(2, (num_samples - 1).bit_length())
        self._widths = (m // 2, m - m // 2)  # (left, right) bits; an even number of rounds restores them
        fp = int(fingerprint[:16], 16) if fingerprint else 0
        self._keys = [
            np.uint64(k) for k in np.random.SeedSequence([seed, epoch, fp]).generate_state(_ROUNDS, np.uint64)
        ]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, positions) -> np.ndarray:
        pos = _positions(positions, self.num_samples)
        if not self.shuffle:
            return pos.copy()
        out = self._permute(pos.astype(np.uint64))
        n = np.uint64(self.num_samples)
        walk = np.flatnonzero(out >= n)
        while walk.size:  # cycle walking: each value past n goes round again until it lands in [0, n)
            out[walk] = self._permute(out[walk])
            walk = walk[out[walk] >= n]
        return out.astype(np.int64)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        order = self[np.arange(self.num_samples)]
        return order if dtype is None else order.astype(dtype)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        a, b = self._widths
        left, right = x >> np.uint64(b), x & np.uint64((1 << b) - 1)
        for key in self._keys:  # (L: a bits, R: b bits) -> (R: b bits, L ^ F(R): a bits)
            left, right = right, left ^ (mix64_array(right ^ key) & np.uint64((1 << a) - 1))
            a, b = b, a
        return (left << np.uint64(b)) | right


class WindowedOrder:
    """An epoch's order that reads a few parts at a time: the parts (Parquet row groups, shards) in a seeded
    order, cut into windows of `window` consecutive parts, and the samples of each window in a keyed order
    (an EpochOrder of its own). A pure function of (part counts, window, seed, epoch, fingerprint), a
    bijection of [0, n) evaluated at the positions asked for, like EpochOrder, so the plan, resume and the
    re-deal at another world size work unchanged.

    A batch of consecutive positions then draws from about one window's parts, not from all of them: a
    source that must decode a whole part to cut one sample out (a Parquet row group) decodes each part
    about once an epoch, instead of once per batch that touches it.
    """

    def __init__(self, counts: np.ndarray, window: int, *, seed: int, epoch: int, fingerprint: str) -> None:
        counts = np.asarray(counts, np.int64)
        self.window = positive_int("window", window)
        self.num_samples = positive_int("num_samples", int(counts.sum()))
        part_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._perm = _rng(seed, epoch, fingerprint, 0x57).permutation(len(counts))  # the parts' order
        shuffled = counts[self._perm]
        self._starts = np.concatenate([[0], np.cumsum(shuffled)])  # positions where each shuffled part starts
        self._part_starts = part_starts[self._perm]  # sample id of each shuffled part's first sample
        self._windows = self._starts[:: self.window]  # positions where each window starts
        if self._windows[-1] != self.num_samples:
            self._windows = np.append(self._windows, self.num_samples)
        self._args = (seed, epoch, fingerprint)
        self._orders: dict[int, EpochOrder] = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, positions) -> np.ndarray:
        pos = _positions(positions, self.num_samples)
        win = np.searchsorted(self._windows, pos, side="right") - 1
        out = np.empty_like(pos)
        for w in np.unique(win).tolist():
            rows = np.flatnonzero(win == w)
            lo = int(self._windows[w])
            out[rows] = lo + self._order(w, int(self._windows[w + 1]) - lo)[pos[rows] - lo]
        part = np.searchsorted(self._starts, out, side="right") - 1  # the shuffled part each position is in
        return self._part_starts[part] + (out - self._starts[part])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        order = self[np.arange(self.num_samples)]
        return order if dtype is None else order.astype(dtype)

    def _order(self, w: int, size: int) -> EpochOrder:
        order = self._orders.get(w)
        if order is None:
            seed, epoch, fingerprint = self._args
            if len(self._orders) > 64:  # a rank walks the windows in order: keep a few
                self._orders.clear()
            # the window's own key: its index mixed into the seed (the same window of another epoch differs)
            order = EpochOrder(
                size,
                seed=int(mix64(seed ^ (w * GAMMA & MASK64))),
                epoch=epoch,
                shuffle=True,
                fingerprint=fingerprint,
            )
            self._orders[w] = order
        return order


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool, fingerprint: str) -> np.ndarray:
    """The epoch's whole global sample order (int64 ids), independent of world size (see EpochOrder)."""
    return np.asarray(
        EpochOrder(num_samples, seed=seed, epoch=epoch, shuffle=shuffle, fingerprint=fingerprint)
    )


def _rng(seed: int, epoch: int, fingerprint: str, *stream: int) -> np.random.Generator:
    fp = int(fingerprint[:16], 16) if fingerprint else 0
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, fp, *stream])))


@dataclass(frozen=True)
class BucketBatches:
    """One epoch's bucket-pure batches in global order: batch j is ids[offsets[j]:offsets[j+1]], all of
    bucket[j]."""

    ids: np.ndarray
    offsets: np.ndarray
    bucket: np.ndarray

    def __len__(self) -> int:
        return len(self.bucket)

    def batch(self, j: int) -> np.ndarray:
        return self.ids[self.offsets[j] : self.offsets[j + 1]]


def bucket_batch_count(bucket_of: np.ndarray, num_buckets: int, batch_size: int, drop_last: bool) -> int:
    """How many batches bucket_batches makes (the same every epoch)."""
    counts = np.bincount(bucket_of[bucket_of >= 0], minlength=num_buckets)
    full = counts // batch_size
    return int(full.sum() if drop_last else (full + (counts % batch_size > 0)).sum())


def bucket_batches(
    bucket_of: np.ndarray,
    *,
    num_buckets: int,
    batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
    fingerprint: str,
) -> BucketBatches:
    """Batches of one bucket each, for samples whose bucket is `bucket_of[id]` (-1: in no batch).

    Within each bucket the ids are shuffled and chunked into batches of
    `batch_size`; a bucket's last partial batch is kept short, or dropped with
    drop_last; then the order of the batches is shuffled. Without shuffle,
    buckets and ids keep ascending order.
    """
    positive_int("batch_size", batch_size)
    bucket_of = np.asarray(bucket_of, dtype=np.int64)
    rng = _rng(seed, epoch, fingerprint, 1) if shuffle else None
    batches: list[np.ndarray] = []
    owners: list[int] = []
    for b in range(num_buckets):
        members = np.flatnonzero(bucket_of == b)
        if rng is not None:
            members = members[rng.permutation(len(members))]
        stop = len(members) - len(members) % batch_size if drop_last else len(members)
        for first in range(0, stop, batch_size):
            batches.append(members[first : first + batch_size])
            owners.append(b)
    if not batches:
        return BucketBatches(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))
    order = rng.permutation(len(batches)) if rng is not None else np.arange(len(batches))
    batches = [batches[j] for j in order]
    offsets = np.zeros(len(batches) + 1, np.int64)
    np.cumsum([len(x) for x in batches], out=offsets[1:])
    return BucketBatches(
        np.concatenate(batches).astype(np.int64), offsets, np.asarray(owners, dtype=np.int64)[order]
    )


def augmentation_seeds(ids: np.ndarray, *, seed: int, epoch: int) -> np.ndarray:
    """One uint64 seed per sample id: same (seed, epoch, id), same augmentation."""
    base = mix64_array(np.array([(seed * GAMMA + epoch) & MASK64], dtype=np.uint64))[0]
    return mix64_array(np.asarray(ids, dtype=np.uint64) ^ base)


def substitute_id(slot_seed: int, attempt: int, num_samples: int) -> int:
    """The sample standing in for a failed one under on_error="replace": try `attempt` (0, 1, ...).

    A pure function of the failed slot's augmentation seed (itself a function of
    seed, epoch and sample id), so a failure gets the same substitute in every run.
    """
    positive_int("num_samples", num_samples)
    return mix64((int(slot_seed) + (attempt + 1) * GAMMA) & MASK64) % num_samples


@dataclass(frozen=True)
class EpochPlan:
    """The batches of every rank for one epoch, from position `start` of the order."""

    num_samples: int
    world_size: int
    batch_size: int
    drop_last: bool
    start: int = 0

    def __post_init__(self) -> None:
        for name in ("num_samples", "world_size", "batch_size"):
            positive_int(name, getattr(self, name))
        if not 0 <= self.start <= self.num_samples:
            raise ValueError(f"start must be in [0, {self.num_samples}], got {self.start}")

    @property
    def _remaining(self) -> int:
        return self.num_samples - self.start

    @property
    def _full_rounds(self) -> int:
        return self._remaining // (self.batch_size * self.world_size)

    @property
    def _last_round_batch(self) -> int:
        """Rows per rank in the incomplete last round (0 when there is none)."""
        if self.drop_last:
            return 0
        rem = self._remaining - self._full_rounds * self.batch_size * self.world_size
        return -(-rem // self.world_size)

    @property
    def batches_per_rank(self) -> int:
        return self._full_rounds + (1 if self._last_round_batch else 0)

    @property
    def samples_per_rank(self) -> int:
        """Rows every rank receives over the epoch (pad rows included)."""
        return self._full_rounds * self.batch_size + self._last_round_batch

    def positions(self, rank: int, k: int) -> np.ndarray:
        """Positions in the epoch order (already wrapped) of batch k of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if not 0 <= k < self.batches_per_rank:
            raise IndexError(f"batch {k} out of range: rank {rank} has {self.batches_per_rank} batches")
        B, W = self.batch_size, self.world_size
        if k < self._full_rounds:
            first = self.start + (k * W + rank) * B
            return np.arange(first, first + B, dtype=np.int64)
        b = self._last_round_batch
        first = self.start + self._full_rounds * B * W + rank * b
        return np.arange(first, first + b, dtype=np.int64) % self.num_samples

    def batch_ids(self, order: np.ndarray, rank: int, k: int) -> np.ndarray:
        """Sample ids of batch k of `rank`, given the epoch's order."""
        return order[self.positions(rank, k)]

    def consumed(self, batches_done: int) -> int:
        """Positions of the order fully dealt once every rank has taken `batches_done` batches."""
        if not 0 <= batches_done <= self.batches_per_rank:
            raise ValueError(f"batches_done must be in [0, {self.batches_per_rank}], got {batches_done}")
        full = min(batches_done, self._full_rounds)
        dealt = self.start + full * self.batch_size * self.world_size
        if batches_done > self._full_rounds:
            dealt = self.num_samples
        return dealt
