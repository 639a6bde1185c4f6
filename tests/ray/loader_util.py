"""Helpers shared by the Ray loader tests (imported beside them, as tests/s3 does with s3_util)."""
from __future__ import annotations

__all__ = ["first_batch_ids"]


def first_batch_ids(iterators, n: int) -> list:
    """The ids of the first n batches of each iterator, rank after rank; each iterator is left after its n-th
    batch, mid-epoch, so its state_dict() is a resume point."""
    ids = []
    for it in iterators:
        for i, b in enumerate(it.iter_batches()):
            ids.append(b["id"])
            if i == n - 1:
                break
    return ids
