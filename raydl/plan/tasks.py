"""What a rank asks a loader worker for (BatchTask) and what comes back (BatchResult).

A task is the plan's answer for one batch (which samples, with which
augmentation seeds, in which bucket); the iterator makes it, any worker runs
it. Both travel through Ray, so they are small dataclasses of plain values
and numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raydl.plan.failures import Failure, Replaced

__all__ = ["BatchResult", "BatchTask", "batch_rows"]


@dataclass(frozen=True)
class BatchTask:
    """Batch `index` of `rank` in `epoch`: the samples, in order, their seeds, and their bucket (H, W) if
    any. `ahead`: the samples of a later batch of the same rank, whose parts a source that `reads_ahead`
    may start reading now (None: no hint)."""

    rank: int
    epoch: int
    index: int
    ids: np.ndarray
    seeds: np.ndarray
    bucket: tuple[int, int] | None = None
    ahead: np.ndarray | None = None


@dataclass
class BatchResult:
    """A finished batch, without the failed samples that were not replaced: those that could not be
    decoded (`skipped`) and those the source could not give (`unreadable`: bytes that could not be read,
    or a field the sample lacks), which the iterator skips or raises as the error policy says; and the
    replaced ones.
    `membership` is the coordinator's worker-list version as this worker last
    heard it: a rank that holds an older list asks the coordinator for the new one.
    `cache` counts the node cache's hits, misses, bytes and evictions while the batch was made."""

    batch: dict
    skipped: list[Failure]
    unreadable: list[Failure]
    replaced: list[Replaced] = field(default_factory=list)
    membership: int = 0
    cache: dict[str, int] = field(default_factory=dict)  # node cache counters of this batch ({}: no cache)


def batch_rows(batch: dict) -> int:
    """How many rows a batch has: its "id"s, else (a map_batches that changed the rows and left id out) its
    first column's length."""
    if "id" in batch:
        return len(batch["id"])
    return next((len(v) for k, v in batch.items() if k != "bucket" and hasattr(v, "__len__")), 0)
