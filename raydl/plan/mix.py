"""Weighted mixing and per-sample weights: which source's sample fills each slot of an epoch. Pure functions.

A mix of k sources has `epoch_size` slots per epoch. Source s gets
`shares[s]` of them: weight x epoch_size, rounded by largest remainder so that
the shares sum to epoch_size. Its slots t = 0 .. shares[s]-1 are filled from
its *stream* (SourceStream):

- a source without per-sample weights walks one fixed permutation of its
  samples, `shares[s]` a epoch, wrapping round: epoch e takes the samples at
  permutation positions [e*share, (e+1)*share) mod n, in an order of its own
  (a keyed shuffle of the slots). A source smaller than its share repeats:
  every sample comes floor(share/n) or ceil(share/n) times. A larger one is
  subsampled without replacement, a different run of the permutation each
  epoch, so over ceil(n/share) epochs every sample is seen.
- a source with per-sample weights draws each slot with replacement, with
  probability proportional to its weight: the inverse CDF at a uniform that is
  a pure function of (seed, epoch, source fingerprint, slot).

Batching:

- "stratified": every batch of `batch_size` positions holds floor or ceil of
  batch_size x share/epoch_size rows of each source (`stratified_counts`),
  interleaved evenly within the batch. The ranks deal positions as for one
  dataset (EpochPlan), so resume at another world size and node loss work
  unchanged; the batches themselves depend on batch_size.
- "per_source": each source's slots are cut into batches of `batch_size` (its
  last one shorter, or dropped with drop_last), and the batches of all sources
  are interleaved evenly in proportion to their counts (`per_source_batches`).
  The ranks deal whole batches (EpochPlan with a batch as the unit), as for
  aspect buckets.

Every slot has a global number (`slot_offsets[s] + t`), which seeds its
augmentation: a sample repeated in an epoch is augmented differently each
time. Ids handed to the workers are encoded as `id_offsets[s] + local id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raydl.describe.mixing import BATCHINGS
from raydl.options import positive_int
from raydl.plan.order import EpochOrder, WindowedOrder
from raydl.util.splitmix import GAMMA, MASK64, mix64, mix64_array

__all__ = [
    "MixEpoch",
    "MixPlan",
    "SourcePlan",
    "SourceStream",
    "apportion",
    "mix_shares",
    "per_source_batches",
    "stratified_counts",
    "weighted_draw",
]

# Orders of at most this many positions are computed whole, once (the fixed permutation once per process, the
# slots' order once per epoch): looked up per batch they cost 16x a one-dataset plan (small arrays through
# the Feistel rounds and the cycle walk); a whole order of 2**20 takes about 0.1 s and 8 MiB.
EAGER_ORDER = 1 << 20
_BASE_EPOCH = 0x6D6978  # the fixed permutation a source's stream walks: keyed apart from any real epoch
_WEIGHTED_STREAM = 0x77  # the draws of a weighted source


def apportion(total: int, quotas: np.ndarray) -> np.ndarray:
    """`total` split in proportion to `quotas` (non-negative, not all zero) by largest remainder: floor of
    each exact share, then one more to the largest remainders (ties: the lower index). Sums to `total`."""
    q = np.asarray(quotas, dtype=np.float64)
    exact = total * q / q.sum()
    out = np.floor(exact).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        order = np.lexsort((np.arange(len(q)), -(exact - out)))
        out[order[:short]] += 1
    return out


def _apportion_int(total: int, shares: np.ndarray, n: int) -> np.ndarray:
    """`total` split in proportion to integer `shares` summing to `n`, exactly (integer largest remainder)."""
    num = total * shares
    out = num // n
    short = total - int(out.sum())
    if short > 0:
        order = np.lexsort((np.arange(len(shares)), -(num % n)))
        out[order[:short]] += 1
    return out


def mix_shares(weights, epoch_size: int) -> np.ndarray:
    """Each source's slots in an epoch of `epoch_size`: weight x epoch_size, rounded to sum to epoch_size."""
    positive_int("epoch_size", epoch_size)
    w = np.asarray(weights, dtype=np.float64)
    return apportion(epoch_size, w)


def stratified_counts(shares: np.ndarray, batch_size: int) -> np.ndarray:
    """(batches, sources) rows of each source in each batch of `batch_size` consecutive positions.

    Each batch b holds floor or ceil of b x share/N of each source (N = the shares' sum; the last batch may
    be shorter), and the columns sum to the shares exactly. The full batches hold floor(B x share/N) each
    plus the remaining rows, dealt round the batches one source after the other (a source's extras fall in
    different batches, as it has fewer of them than there are batches).
    """
    shares = np.asarray(shares, dtype=np.int64)
    n, B = int(shares.sum()), positive_int("batch_size", batch_size)
    J = -(-n // B)
    last = n - (J - 1) * B
    counts = np.zeros((J, len(shares)), np.int64)
    counts[-1] = _apportion_int(last, shares, n)
    if J > 1:
        base = (B * shares) // n
        extras = shares - counts[-1] - (J - 1) * base
        if extras.min() < 0 or extras.max() > J - 1:  # cannot happen (see the docstring); never deal wrongly
            raise AssertionError(f"stratified_counts: extras {extras.tolist()} for {J - 1} batches")
        counts[:-1] = base
        owners = np.repeat(np.arange(len(shares)), extras)
        np.add.at(counts, (np.arange(len(owners)) % (J - 1), owners), 1)
    return counts


def _interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, index within its owner) of items with `counts[s]` of each owner, spread evenly: owner s's u-th
    item at (u + 0.5) / counts[s], ties to the lower owner."""
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    index = np.arange(len(owner)) - start[owner]
    order = np.lexsort((owner, (index + 0.5) / counts[owner]))
    return owner[order], index[order]


def per_source_batches(shares: np.ndarray, batch_size: int, drop_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """(source, index among its batches) of each batch of a per_source epoch: ceil(share / B) batches of each
    source (floor with drop_last), interleaved evenly in proportion to their counts."""
    shares = np.asarray(shares, np.int64)
    B = positive_int("batch_size", batch_size)
    nb = shares // B if drop_last else -(-shares // B)
    return _interleave(nb)


def _uniform(slots: np.ndarray, key: int) -> np.ndarray:
    """A uniform in [0, 1) per slot, a pure function of (key, slot)."""
    bits = mix64_array(np.asarray(slots, np.uint64) * np.uint64(GAMMA) ^ np.uint64(key))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def weighted_draw(cdf: np.ndarray, slots: np.ndarray, key: int) -> np.ndarray:
    """Sample ids drawn with replacement with probability weight / sum, one per slot: the inverse of the
    cumulative weights `cdf` at each slot's uniform."""
    u = _uniform(slots, key) * cdf[-1]
    ids = np.searchsorted(cdf, u, side="right")
    return np.minimum(ids, len(cdf) - 1).astype(np.int64)


def _key(*parts: int) -> int:
    z = 0
    for p in parts:
        z = mix64((z ^ (int(p) & MASK64)) * GAMMA & MASK64)
    return z


@dataclass(frozen=True)
class SourcePlan:
    """One source of a mix as the plan sees it: its samples, its fingerprint (seeds its order), its parts'
    sample counts when it is shuffled a window of parts at a time (window > 0), and per-sample weights."""

    num_samples: int
    fingerprint: str
    window: int = 0
    part_counts: np.ndarray | None = field(default=None, compare=False, repr=False)
    weights: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: the dataset's own ids of this source's samples (an aspect bucket of a dataset); None: 0 .. n-1
    ids: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        positive_int("num_samples", self.num_samples)

    def __getstate__(self) -> dict:
        """Without what this process computed from it (the weights' CDF, whole orders): a Loader pickles
        into handles, and they compute their own."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def cdf(self) -> np.ndarray | None:
        if self.weights is None:
            return None
        cdf = self.__dict__.get("_cdf")
        if cdf is None:
            cdf = np.cumsum(self.weights)
            object.__setattr__(self, "_cdf", cdf)
        return cdf


class SourceStream:
    """The samples source `index` gives its `share` slots in one epoch: `stream[slots]` -> local ids."""

    def __init__(self, src: SourcePlan, share: int, index: int, *, seed: int, epoch: int, shuffle: bool):
        self.src, self.share, self.epoch = src, int(share), epoch
        fp = int(src.fingerprint[:16], 16) if src.fingerprint else 0
        if src.weights is not None:
            self._key = _key(seed, epoch, fp, index, _WEIGHTED_STREAM)
            return
        n = src.num_samples
        if (
            src.window and shuffle
        ):  # read a window of parts at a time (Parquet row groups): keep that locality
            self._perm = WindowedOrder(
                src.part_counts, src.window, seed=seed, epoch=_BASE_EPOCH, fingerprint=src.fingerprint
            )
            chunk = max(1, src.window * n // max(1, len(src.part_counts)))  # about one window's samples
            pieces = np.full(share // chunk, chunk, np.int64)
            if share % chunk:
                pieces = np.append(pieces, share % chunk)
            self._slots = (
                WindowedOrder(pieces, 1, seed=seed ^ index, epoch=epoch, fingerprint=src.fingerprint)
                if share
                else None
            )
        else:
            self._perm = EpochOrder(
                n, seed=seed, epoch=_BASE_EPOCH, shuffle=shuffle, fingerprint=src.fingerprint
            )
            self._slots = (
                EpochOrder(
                    share,
                    seed=_key(seed, index) & 0x7FFFFFFF,
                    epoch=epoch,
                    shuffle=shuffle,
                    fingerprint=src.fingerprint,
                )
                if share
                else None
            )
        if share and share <= EAGER_ORDER:
            self._slots = np.asarray(self._slots)
        if n <= EAGER_ORDER:
            self._perm = _whole(src, (seed, shuffle), self._perm)

    def __getitem__(self, slots) -> np.ndarray:
        slots = np.asarray(slots, np.int64)
        if self.src.weights is not None:
            return weighted_draw(self.src.cdf, slots, self._key)
        if slots.size and (slots.min() < 0 or slots.max() >= self.share):
            raise IndexError(f"slots must be in [0, {self.share})")
        n = self.src.num_samples
        # the epoch's first slot, reduced in Python's ints: epoch * share can pass int64
        base = (self.epoch % n) * self.share % n
        at = (base + self._slots[slots]) % n
        return self._perm[at]


def _whole(src: SourcePlan, key: tuple, order) -> np.ndarray:
    """`order` computed whole, kept on `src` (the same for every epoch of this process)."""
    kept = src.__dict__.setdefault("_orders", {})
    got = kept.get(key)
    if got is None:
        got = kept[key] = np.asarray(order)
    return got


@dataclass(frozen=True)
class MixPlan:
    """A mix: its sources, each one's share of an epoch, and how batches are made. Pure and picklable."""

    sources: tuple[SourcePlan, ...]
    shares: tuple[int, ...]
    batching: str
    batch_size: int
    drop_last: bool
    #: with aspect buckets, each source is one bucket of one dataset: the dataset (its index) of each source,
    #: the bucket (H, W) of each, and each dataset's size. None: a source per dataset.
    owners: tuple[int, ...] | None = None
    buckets: tuple[tuple[int, int], ...] | None = None
    dataset_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}, got {self.batching!r}")
        if len(self.shares) != len(self.sources):
            raise ValueError("one share per source")
        if self.buckets is not None and self.batching != "per_source":
            raise ValueError("a mix of bucketed datasets batches per_source: a batch holds one bucket")

    @property
    def epoch_size(self) -> int:
        return int(sum(self.shares))

    @property
    def per_source(self) -> bool:
        return self.batching == "per_source"

    @property
    def id_offsets(self) -> np.ndarray:
        """Where each dataset's ids start in the encoded ids handed to the workers."""
        sizes = self.dataset_sizes or [s.num_samples for s in self.sources]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def slot_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.shares)]).astype(np.int64)

    @property
    def units(self) -> int:
        """What the ranks deal: positions (stratified), or whole batches (per_source)."""
        if not self.per_source:
            return self.epoch_size
        return len(per_source_batches(np.asarray(self.shares), self.batch_size, self.drop_last)[0])

    def epoch(self, *, seed: int, epoch: int, shuffle: bool) -> MixEpoch:
        return MixEpoch(self, seed=seed, epoch=epoch, shuffle=shuffle)


class MixEpoch:
    """One epoch of a mix: `rows(positions)` (stratified) or `batch(j)` (per_source) give the encoded ids and
    the global slot numbers (the augmentation seeds' input) of those rows."""

    def __init__(self, plan: MixPlan, *, seed: int, epoch: int, shuffle: bool) -> None:
        self.plan = plan
        shares = np.asarray(plan.shares, np.int64)
        self._streams = [
            SourceStream(src, int(share), i, seed=seed, epoch=epoch, shuffle=shuffle)
            for i, (src, share) in enumerate(zip(plan.sources, shares, strict=True))
        ]
        self._ids, self._slots = plan.id_offsets, plan.slot_offsets
        if plan.per_source:
            self._batch_source, self._batch_index = per_source_batches(
                shares, plan.batch_size, plan.drop_last
            )
        else:
            self._counts = stratified_counts(shares, plan.batch_size)
            self._before = np.concatenate([np.zeros((1, len(shares)), np.int64), np.cumsum(self._counts, 0)])
            self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def per_source(self) -> bool:
        return self.plan.per_source

    def __len__(self) -> int:
        return len(self._batch_source) if self.plan.per_source else self.plan.epoch_size

    def _encode(self, source: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.empty(len(source), np.int64)
        owners = self.plan.owners
        for s in np.unique(source).tolist():
            rows = np.flatnonzero(source == s)
            local = self._streams[s][slot[rows]]
            own = self.plan.sources[s].ids
            ids[rows] = self._ids[s if owners is None else owners[s]] + (local if own is None else own[local])
        return ids, self._slots[source] + slot

    def _layout(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch j's rows: (source, slot of that source) each, the sources interleaved evenly."""
        got = self._layouts.get(j)
        if got is None:
            owner, index = _interleave(self._counts[j])
            got = (owner, self._before[j][owner] + index)
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[j] = got
        return got

    def rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(encoded ids, global slots) at these positions of a stratified epoch."""
        pos = np.asarray(positions, np.int64)
        B = self.plan.batch_size
        source, slot = np.empty(len(pos), np.int64), np.empty(len(pos), np.int64)
        batch = pos // B
        for j in np.unique(batch).tolist():
            at = np.flatnonzero(batch == j)
            owner, slots = self._layout(j)
            source[at], slot[at] = owner[pos[at] - j * B], slots[pos[at] - j * B]
        return self._encode(source, slot)

    def batch(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(encoded ids, global slots) of batch j of a per_source epoch (all of one source)."""
        s, i = int(self._batch_source[j]), int(self._batch_index[j])
        B = self.plan.batch_size
        slot = np.arange(i * B, min((i + 1) * B, self.plan.shares[s]), dtype=np.int64)
        return self._encode(np.full(len(slot), s, np.int64), slot)

    def source_of(self, j: int) -> int:
        """The source of batch j of a per_source epoch."""
        return int(self._batch_source[j])

    def bucket(self, j: int) -> tuple[int, int] | None:
        """The aspect bucket (H, W) of batch j of a per_source epoch of bucketed datasets, else None."""
        buckets = self.plan.buckets
        return None if buckets is None else tuple(buckets[int(self._batch_source[j])])
