"""How long a rank's iterator waits for a batch when `iter_batches(timeout_s=None)`: a pure function of what
it has seen so far.

The default is finite, so a training job whose loader stalls fails with a BatchTimeoutError naming the rank,
the batch and the worker instead of hanging with no word. It is generous on purpose: never less than the
floor, `LoaderConfig.batch_timeout_s` (300 s by default: longer than one S3 read's whole retry budget at the
default S3Options, 30 s × 5 tries, so a stalled store is reported as its own DataSourceError first), and at
least FACTOR times the longest this iterator has waited for one batch so far, so a pipeline whose batches
are slow (large images, a slow store) never trips it. The first batch also waits for the actors to start
and for the first reads (seconds on a warm cluster, minutes when nodes are still joining), so it gets
FIRST_FACTOR × the floor.
"""

from __future__ import annotations

import math

__all__ = ["FACTOR", "FIRST_FACTOR", "batch_timeout"]

FACTOR = 10.0
FIRST_FACTOR = 2.0


def batch_timeout(floor_s: float, longest_wait_s: float | None) -> tuple[float, str]:
    """(seconds, how they were chosen) for the next batch; `longest_wait_s` is None before the first batch.
    An infinite floor waits forever."""
    if math.isinf(floor_s):
        return math.inf, "batch_timeout_s=inf"
    if longest_wait_s is None:
        return (
            FIRST_FACTOR * floor_s,
            f"the first batch's default, {FIRST_FACTOR:g} × batch_timeout_s={floor_s:g}",
        )
    scaled = FACTOR * longest_wait_s
    if scaled > floor_s:
        return (
            scaled,
            f"the default, {FACTOR:g} × the longest wait for a batch so far ({longest_wait_s:.3g} s)",
        )
    return floor_s, f"the default, batch_timeout_s={floor_s:g}"
