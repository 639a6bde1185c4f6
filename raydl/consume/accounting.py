"""What becomes of a batch's failed samples on the rank that gets it: each settled by the error policy
(left out, logged once per URI and counted; or raised), replaced ones noted, and the node cache's counters
added to the rank's stats."""

from __future__ import annotations

import logging

import numpy as np

from raydl.consume.stats import IteratorStats
from raydl.plan.failures import ErrorPolicy, Failure
from raydl.plan.tasks import BatchResult, batch_rows

logger = logging.getLogger("raydl.consume.iterator")  # the iterator's warnings, under its name

__all__ = ["Accounting"]


class Accounting:
    """One rank's settling of failed samples, into `stats`."""

    def __init__(self, policy: ErrorPolicy, stats: IteratorStats, rank: int) -> None:
        self._policy, self._stats, self._rank = policy, stats, rank
        self._logged: set[str] = set()  # URIs of failed samples logged so far (each once)

    def batch(self, result: BatchResult, k: int, epoch: int) -> None:
        """Settle batch k's failed samples as the error policy says (raise, or skip), note its replaced ones,
        and warn when it came out empty."""
        failed = [*result.unreadable, *result.skipped]  # an unreadable sample is named first
        left_out = self._policy.settle(failed, rank=self._rank, epoch=epoch, batch=k)
        self.skip(left_out)
        for r in result.replaced:
            self.warn_once(
                r.uri,
                "raydl: replaced sample %d (%s) by sample %d: %s",
                r.sample_id,
                r.uri,
                r.substitute_id,
                r.reason,
            )
            self._stats.replaced_uris.append(r.uri)
        self._stats.samples_replaced += len(result.replaced)
        self._stats.add_cache(result.cache)
        if left_out and batch_rows(result.batch) == 0:  # a sample lacking a field is left out too
            shapes = ", ".join(
                f"{name} {v.dtype} {tuple(v.shape)}"
                for name, v in result.batch.items()
                if isinstance(v, np.ndarray) and v.ndim > 1
            )
            logger.warning(
                "raydl: rank %d: batch %d of epoch %d has no rows: all %d of its samples failed "
                "(on_error='skip'); it is yielded empty%s, so that ranks stay in step "
                "(on_error='replace' keeps batches full)",
                self._rank,
                k,
                epoch,
                len(left_out),
                f" ({shapes})" if shapes else "",
            )

    def unsized(self, failures) -> None:
        """Samples whose size could not be read at listing are in no bucket: rank 0 reports them each
        epoch."""
        self.skip(self._policy.settle(failures))

    def skip(self, failures: list[Failure]) -> None:
        """Failed samples left out of their batches: each logged once per URI, and counted."""
        for f in failures:
            self.warn_once(f.uri, "raydl: skipped sample %d (%s): %s", f.sample_id, f.uri, f.reason)
            self._stats.skipped_uris.append(f.uri)
        self._stats.samples_skipped += len(failures)

    def warn_once(self, uri: str, message: str, *args: object) -> None:
        if uri not in self._logged:
            self._logged.add(uri)
            logger.warning(message, *args)
