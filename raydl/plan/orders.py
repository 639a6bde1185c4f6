"""The epoch's order behind one small protocol: what the ranks deal, and which rows a dealt position holds.

Every loader deals *units* to its ranks in turn (`EpochPlan`, raydl/plan/order.py): samples, or whole
batches. Three shapes of dataset give three orders, and nothing above this module tells them apart:

    SampleOrder   one dataset: a keyed permutation of its samples (EpochOrder), or a window of parts at a
                  time (WindowedOrder, for sources that decode a whole part to cut a sample out)
    BucketOrder   one dataset with aspect buckets: bucket-pure batches, each a unit
    MixOrder      several datasets (or one drawn by per-sample weights): raydl/plan/mix.py's epoch,
                  positions (stratified) or whole batches (per_source)

Each is a pure function of its inputs: `epoch()` computes the epoch's order once (seed, epoch, shuffle),
`rows()` gives the rows at dealt positions, `state()` what a resume state records of the order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from raydl.plan.mix import MixEpoch, MixPlan
from raydl.plan.order import EpochOrder, WindowedOrder, bucket_batch_count, bucket_batches

__all__ = ["BucketOrder", "MixOrder", "Order", "Rows", "SampleOrder"]


class Rows(NamedTuple):
    """The rows of one batch: sample ids (encoded as `Order.id_offsets` says), what seeds each row's
    augmentation (the sample id, or a mix's slot number, so that a sample repeated in an epoch differs each
    time), and the batch's aspect bucket (H, W) or None."""

    ids: np.ndarray
    slots: np.ndarray
    bucket: tuple[int, int] | None = None


class Order(Protocol):
    """How one loader's epochs are ordered and dealt."""

    #: units the ranks deal in an epoch: samples, or whole batches
    units: int
    #: whether a unit is a whole batch (else a sample: batch_size of them make a batch)
    deals_batches: bool
    #: where each member's ids start in the ids handed to the workers ((0, n) for one dataset)
    id_offsets: tuple[int, ...]
    #: why a resume must keep the batch size ("aspect buckets", "a mix": the batches themselves depend on
    #: it); None where a resume may change it
    fixed_batch_size: str | None

    def epoch(self, *, seed: int, epoch: int, shuffle: bool) -> Any:
        """The epoch's order, computed once per epoch (evaluated lazily at the positions asked for)."""
        ...

    def rows(self, epoch_order: Any, positions: np.ndarray) -> Rows:
        """The rows at `positions` of the dealt order (one batch's positions)."""
        ...

    def state(self) -> dict[str, Any]:
        """What a resume state records of this order: "buckets", "shuffle_window" and "mix"."""
        ...


@dataclass(frozen=True)
class SampleOrder:
    """One dataset's samples, dealt one by one: all shuffled together, or a window of parts at a time
    (`window` > 0, with the parts' sample counts)."""

    num_samples: int
    fingerprint: str  # seeds the shuffle: the same files give the same order wherever they are stored
    window: int = 0
    part_counts: np.ndarray | None = field(default=None, compare=False, repr=False)
    fixed_batch_size: str | None = None

    deals_batches = False

    @property
    def units(self) -> int:
        return self.num_samples

    @property
    def id_offsets(self) -> tuple[int, ...]:
        return (0, self.num_samples)

    def epoch(self, *, seed: int, epoch: int, shuffle: bool) -> EpochOrder | WindowedOrder:
        if shuffle and self.window:
            return WindowedOrder(
                self.part_counts, self.window, seed=seed, epoch=epoch, fingerprint=self.fingerprint
            )
        return EpochOrder(
            self.num_samples, seed=seed, epoch=epoch, shuffle=shuffle, fingerprint=self.fingerprint
        )

    def rows(self, epoch_order: EpochOrder | WindowedOrder, positions: np.ndarray) -> Rows:
        ids = epoch_order[positions]
        return Rows(ids, ids)

    def state(self) -> dict[str, Any]:
        return {"buckets": None, "shuffle_window": self.window, "mix": None}


@dataclass(frozen=True)
class BucketOrder:
    """One dataset in aspect-ratio buckets: each unit is a whole bucket-pure batch (`bucket_of[id]`: the
    sample's bucket, -1 for none)."""

    bucket_of: np.ndarray = field(compare=False, repr=False)
    buckets: tuple[tuple[int, int], ...]
    batch_size: int
    drop_last: bool
    fingerprint: str
    window: int = 0  # recorded in resume states as one dataset's part window (0 for image folders)
    fixed_batch_size: str | None = "aspect buckets"
    units: int = field(init=False)

    def __post_init__(self) -> None:
        units = bucket_batch_count(self.bucket_of, len(self.buckets), self.batch_size, self.drop_last)
        object.__setattr__(self, "units", units)

    deals_batches = True

    @property
    def id_offsets(self) -> tuple[int, ...]:
        return (0, len(self.bucket_of))

    def epoch(self, *, seed: int, epoch: int, shuffle: bool):
        return bucket_batches(
            self.bucket_of,
            num_buckets=len(self.buckets),
            batch_size=self.batch_size,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            drop_last=self.drop_last,
            fingerprint=self.fingerprint,
        )

    def rows(self, epoch_order, positions: np.ndarray) -> Rows:
        j = int(positions[0])
        ids = epoch_order.batch(j)
        return Rows(ids, ids, self.buckets[int(epoch_order.bucket[j])])

    def state(self) -> dict[str, Any]:
        return {"buckets": [list(b) for b in self.buckets], "shuffle_window": self.window, "mix": None}


@dataclass(frozen=True)
class MixOrder:
    """A mix's epochs (raydl/plan/mix.py): positions dealt one by one (stratified batches) or whole batches
    of one source (per_source). `recorded` is what a resume state records of the mix (its sources,
    weights, epoch size, batching, weights' digests and data fingerprints)."""

    mix: MixPlan
    recorded: dict[str, Any] = field(compare=False)
    fixed_batch_size: str | None = "a mix"
    units: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", self.mix.units)

    @property
    def deals_batches(self) -> bool:
        return self.mix.per_source

    @property
    def id_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.mix.id_offsets)

    def epoch(self, *, seed: int, epoch: int, shuffle: bool) -> MixEpoch:
        return self.mix.epoch(seed=seed, epoch=epoch, shuffle=shuffle)

    def rows(self, epoch_order: MixEpoch, positions: np.ndarray) -> Rows:
        if self.mix.per_source:
            j = int(positions[0])
            ids, slots = epoch_order.batch(j)
            return Rows(ids, slots, epoch_order.bucket(j))
        ids, slots = epoch_order.rows(positions)
        return Rows(ids, slots)

    def state(self) -> dict[str, Any]:
        buckets = None
        if self.mix.buckets is not None:  # the aspect buckets the mix's sources are buckets of
            buckets = [list(b) for b in sorted(set(self.mix.buckets))]
        return {"buckets": buckets, "shuffle_window": 0, "mix": self.recorded}
