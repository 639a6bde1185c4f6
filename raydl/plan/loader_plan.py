"""LoaderPlan: everything that decides a loader's epochs, built once, asked by every rank. Pure: no Ray.

A plan holds the order (raydl/plan/orders.py: plain, windowed, bucketed or mixed, behind one protocol),
the data's fingerprint, the settings that shape batches, and the error policy. It answers:

    batches_per_rank(epoch)   the same on every rank
    check_epoch()             a ValueError when an epoch would deliver no batch
    task(rank, epoch, k)      batch k of `rank`: its rows and their augmentation seeds (a BatchTask)
    state(...)                where a rank stands, as plain JSON values
    check_state(state)        where a rank resumes from a state, after checking each of its fields' type
                              and range and that the state fits this plan

`start` (a position in the epoch's order) is where a re-dealt epoch begins after a resume at another
world size; 0 otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from raydl.options import LoaderConfig
from raydl.plan.failures import ErrorPolicy, Failure
from raydl.plan.order import EpochPlan, augmentation_seeds
from raydl.plan.orders import Order
from raydl.plan.state import check_mix_state
from raydl.plan.tasks import BatchTask
from raydl.util.values import brief, integer

__all__ = ["LoaderPlan", "Position"]

STATE_VERSION = 1
_EPOCHS_KEPT = 2  # epoch orders a plan keeps computed (a rank reads one epoch at a time; ranks may lag one)


class Position(NamedTuple):
    """Where a rank stands: its epoch, where that epoch's dealt order starts, and its next batch."""

    epoch: int
    start: int
    next: int


@dataclass(frozen=True)
class LoaderPlan:
    """The plan of one loader (see the module). `unsized`: samples in no aspect bucket (their size could
    not be read), which rank 0 reports each epoch; `batch_bytes`: about what one batch takes;
    `image_fields`: the decoded image fields (not masks), which one torch dtype covers; `sample_unit`: what a
    sample is, for rates ("windows", "rows", "images" or "samples": raydl.plan.build.sample_unit);
    `read_ahead`: how far ahead of its batches a task names the samples its source may start reading
    (raydl.plan.build.read_ahead)."""

    config: LoaderConfig
    order: Order
    num_samples: int
    fingerprint: str
    policy: ErrorPolicy
    unsized: tuple[Failure, ...] = ()
    batch_bytes: int = 1
    image_fields: tuple[str, ...] = ()
    sample_unit: str = "samples"
    read_ahead: int = 0  # a task names the samples of the batch this many after its last (0: none)
    _epochs: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Without the epoch orders computed here: a Loader pickles into handles, which compute their own."""
        return {k: v for k, v in self.__dict__.items() if k != "_epochs"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _epochs={})

    # -- dealing --------------------------------------------------------------------------
    def deal(
        self, *, start: int = 0, world_size: int | None = None, batch_size: int | None = None
    ) -> EpochPlan:
        """How the epoch's units are dealt to the ranks, from position `start` (another world size or batch
        size: how a state saved under them dealt it)."""
        c = self.config
        per_batch = 1 if self.order.deals_batches else (c.batch_size if batch_size is None else batch_size)
        world = c.world_size if world_size is None else world_size
        return EpochPlan(self.order.units, world, per_batch, c.drop_last, start=start)

    def batches_per_rank(self, epoch: int = 0, *, start: int = 0) -> int:
        """Batches every rank gets in `epoch` (from `start`)."""
        return self.deal(start=start).batches_per_rank

    def check_epoch(self) -> None:
        """A ValueError saying why and what to change when an epoch would deliver no batch (every epoch
        deals the same number of units, so epoch 0 stands for all)."""
        if self.order.units > 0 and self.batches_per_rank(0) > 0:
            return
        c, units = self.config, self.order.units
        if self.order.deals_batches:  # aspect buckets, or a mix's per-source batches: units are whole batches
            have = (
                f"the data makes {units} full batch{'' if units == 1 else 'es'} of batch_size {c.batch_size} "
                f"({self.order.fixed_batch_size})"
            )
            if not c.drop_last or units == 0:
                raise ValueError(f"an epoch of this loader would deliver no batch: {have}")
            raise ValueError(
                f"an epoch of this loader would deliver no batch: with drop_last=True each of the "
                f"world_size {c.world_size} ranks needs a full batch, and {have}; lower batch_size or "
                "world_size, or set drop_last=False"
            )
        samples = f"{units} sample{'' if units == 1 else 's'}"
        if not c.drop_last or units == 0:
            raise ValueError(f"an epoch of this loader would deliver no batch: the data has {samples}")
        fix = (
            f"lower batch_size to at most {units // c.world_size}"
            if units >= c.world_size
            else f"use at most {units} ranks"
        )
        raise ValueError(
            f"an epoch of this loader would deliver no batch: with drop_last=True a round of batches needs "
            f"batch_size {c.batch_size} x world_size {c.world_size} = {c.batch_size * c.world_size}, and the "
            f"data has {samples}; {fix}, or set drop_last=False"
        )

    def epoch_order(self, epoch: int):
        """The order of `epoch`, computed once (the last few are kept)."""
        got = self._epochs.get(epoch)
        if got is None:
            c = self.config
            got = self.order.epoch(seed=c.seed, epoch=epoch, shuffle=c.shuffle)
            for old in sorted(self._epochs)[: max(0, len(self._epochs) - _EPOCHS_KEPT + 1)]:
                self._epochs.pop(old, None)
            self._epochs[epoch] = got
        return got

    def task(self, rank: int, epoch: int, k: int, *, start: int = 0) -> BatchTask:
        """Batch k of `rank` in `epoch`: which rows, with which augmentation seeds, in which bucket."""
        return self.tasks(rank, epoch, k, 1, start=start)[0]

    def tasks(self, rank: int, epoch: int, k: int, n: int, *, start: int = 0) -> list[BatchTask]:
        """Batches k, ..., k + n - 1 of `rank` in `epoch`, as `task` gives each. Where the order deals
        samples one by one, their ids and seeds are worked out for all n batches at once: the order's cost
        is mostly numpy's per call, not per position."""
        deal, order = self.deal(start=start), self.epoch_order(epoch)
        seed = self.config.seed
        ahead = None  # the first task carries the hint: the samples of batch k + n - 1 + read_ahead
        if self.read_ahead and k + n - 1 + self.read_ahead < deal.batches_per_rank:
            ahead = self.order.rows(order, deal.positions(rank, k + n - 1 + self.read_ahead)).ids
        if self.order.deals_batches or n == 1:
            out = []
            for j in range(k, k + n):
                rows = self.order.rows(order, deal.positions(rank, j))
                seeds = augmentation_seeds(rows.slots, seed=seed, epoch=epoch)
                out.append(
                    BatchTask(
                        rank=rank,
                        epoch=epoch,
                        index=j,
                        ids=rows.ids,
                        seeds=seeds,
                        bucket=rows.bucket,
                        ahead=ahead if j == k else None,
                    )
                )
            return out
        positions = [deal.positions(rank, j) for j in range(k, k + n)]
        rows = self.order.rows(order, np.concatenate(positions))
        seeds = augmentation_seeds(rows.slots, seed=seed, epoch=epoch)
        out, at = [], 0
        for j, pos in enumerate(positions, start=k):
            end = at + len(pos)
            ids, batch_seeds = (
                rows.ids[at:end].copy(),
                seeds[at:end].copy(),
            )  # a task carries its own rows only
            out.append(
                BatchTask(
                    rank=rank,
                    epoch=epoch,
                    index=j,
                    ids=ids,
                    seeds=batch_seeds,
                    bucket=rows.bucket,
                    ahead=ahead if j == k else None,
                )
            )
            at = end
        return out

    # -- resume ---------------------------------------------------------------------------
    def state(self, *, rank: int, position: Position) -> dict[str, Any]:
        """Where `rank` stands, as plain JSON-serializable values (see docs/loader.md, Resume)."""
        c = self.config
        return {
            "version": STATE_VERSION,
            "epoch": position.epoch,
            "batches_done": position.next,
            "start": position.start,
            "rank": rank,
            "world_size": c.world_size,
            "batch_size": c.batch_size,
            "seed": c.seed,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "num_samples": self.num_samples,
            "fingerprint": self.fingerprint,
            **self.order.state(),
        }

    def check_state(self, state: dict[str, Any]) -> Position:
        """Where a rank resumes from `state`: the same position, or at another world size or batch size the
        rest of the epoch re-dealt. A state is input like any other: every field is checked for its type
        and range first (see `_state_fields`); a state of other data or other settings is a ValueError
        naming what differs."""
        c = self.config
        got = _state_fields(state)
        order = self.order.state()
        check_mix_state(got["mix"], order["mix"])
        mine = {
            "fingerprint": self.fingerprint,
            "num_samples": self.num_samples,
            "seed": c.seed,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "buckets": order["buckets"],
            "shuffle_window": order["shuffle_window"],
        }
        for key, value in mine.items():
            if got[key] != value:
                raise ValueError(
                    f"cannot resume: the state's {key} is {brief(state.get(key))}, this loader's is "
                    f"{brief(value)}; build the loader over the same data with the same settings"
                )
        why = self.order.fixed_batch_size
        world, batch_size = got["world_size"], got["batch_size"]
        if why is not None and batch_size != c.batch_size:
            raise ValueError(
                f"cannot resume: the state's batch_size is {brief(state['batch_size'])}, this loader's is "
                f"{c.batch_size!r}; with {why} the batches themselves depend on it"
            )
        # Same data and settings from here on: the state's start and batches_done must lie in its epoch.
        start = _in_range(got, "start", 0, self.order.units, "a position in the epoch's order")
        old = self.deal(start=start, world_size=world, batch_size=batch_size)
        done = _in_range(got, "batches_done", 0, old.batches_per_rank, "its epoch's batches on a rank")
        epoch = got["epoch"]
        if (world, batch_size) == (c.world_size, c.batch_size):
            return Position(epoch, old.start, done)
        start = old.consumed(done)  # re-deal the rest of the epoch
        if start >= self.order.units or self.batches_per_rank(epoch, start=start) == 0:
            return Position(epoch + 1, 0, 0)
        return Position(epoch, start, 0)


# -- a resume state's fields, checked before use -----------------------------------------------
_MAX_EPOCH = 2**63 - 1  # epochs mix into 64-bit seeds, as the seed does
_MAX_COUNT = 2**31 - 1  # world sizes and batch sizes


def _state_fields(state: object) -> dict[str, Any]:
    """A state's fields, each checked for its type and range alone (what fits this plan is checked after):
    a ValueError naming the field. Fields a state may lack get their meaning then:
    shuffle_window 0 (the whole epoch shuffled together), buckets and mix None, rank unchecked."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"cannot resume: a state is the dict state_dict() returned, got {type(state).__name__}"
        )
    if integer(state.get("version")) != STATE_VERSION:
        raise ValueError(f"unsupported iterator state version {brief(state.get('version'))}")
    got: dict[str, Any] = {"version": STATE_VERSION}
    for name, lo, hi in (
        ("epoch", 0, _MAX_EPOCH),
        ("batches_done", 0, None),
        ("start", 0, None),
        ("world_size", 1, _MAX_COUNT),
        ("batch_size", 1, _MAX_COUNT),
        ("seed", 0, 2**63 - 1),
        ("num_samples", 0, None),
    ):
        _needs(state, name)
        got[name] = _in_range(state, name, lo, hi)
    for name in ("shuffle", "drop_last"):
        got[name] = _needs(state, name)
        if not isinstance(got[name], bool):
            _refuse(state, name, "true or false")
    got["fingerprint"] = _needs(state, "fingerprint")
    if not isinstance(got["fingerprint"], str):
        _refuse(state, "fingerprint", "a str")
    if "rank" in state:
        _in_range(state, "rank", 0, got["world_size"] - 1, "below its world_size")
    got["shuffle_window"] = _in_range(
        {"shuffle_window": state.get("shuffle_window", 0)}, "shuffle_window", 0, None
    )
    buckets = state.get("buckets")
    if buckets is not None and not (
        isinstance(buckets, list)
        and all(
            isinstance(b, list) and len(b) == 2 and all(integer(x) is not None for x in b) for b in buckets
        )
    ):
        _refuse(state, "buckets", "null or a list of [height, width] pairs")
    got["buckets"] = buckets
    got["mix"] = state.get("mix")
    if got["mix"] is not None and not isinstance(got["mix"], Mapping):
        _refuse(state, "mix", "null or a dict")
    return got


def _needs(state: Mapping, name: str) -> object:
    if name not in state:
        raise ValueError(f"cannot resume: the state has no {name}; a state is the dict state_dict() returned")
    return state[name]


def _in_range(fields: Mapping, name: str, lo: int, hi: int | None, note: str = "") -> int:
    """fields[name] as an int in [lo, hi] (hi None: no upper bound), else a ValueError naming it."""
    value = integer(fields[name])
    if value is None or value < lo or (hi is not None and value > hi):
        bounds = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        _refuse(fields, name, bounds + (f" ({note})" if note else ""))
    return value


def _refuse(fields: Mapping, name: str, what: str) -> None:
    raise ValueError(f"cannot resume: the state's {name} is {brief(fields[name])}; it must be {what}")
