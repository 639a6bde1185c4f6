"""IteratorStats: what one rank's iterator has done so far."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["IteratorStats"]


@dataclass
class IteratorStats:
    """What one rank's iterator has done so far (all epochs). `unit` says what a sample is: "windows"
    (read_tokens), "rows" (Parquet without an image field), "images" (a source with one), or "samples" (any
    other source, or a mix of kinds); `samples_per_s` is the rate in that unit."""

    rank: int
    epoch: int = 0
    batches: int = 0
    samples_delivered: int = 0
    samples_skipped: int = 0
    samples_replaced: int = 0  # on_error="replace": failed samples that a substitute stood in for
    wait_s: float = 0.0
    time_to_first_batch_s: float | None = None
    elapsed_s: float = 0.0
    retries: int = 0
    local_batches: int = 0  # made by an actor on this rank's node (read from the object store without a copy)
    driver_batches: int = (
        0  # made in this process while the loader's workers started (counted in local_batches)
    )
    # The node cache (LoaderConfig.cache) while this rank's batches were made: entries (a sample's range, or a
    # whole read) served from the node's disk and missing there, the bytes from each, entries evicted for room
    # and entries found corrupt (refetched).
    cache_hits: int = 0
    cache_misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_store: int = 0
    cache_evictions: int = 0
    cache_corrupt: int = 0
    skipped_uris: list[str] = field(default_factory=list, repr=False)
    replaced_uris: list[str] = field(default_factory=list, repr=False)
    unit: str = "samples"

    def add_cache(self, counts: dict[str, int]) -> None:
        """Add one batch's node cache counters (BatchResult.cache)."""
        for name, value in counts.items():
            attr = name if name.startswith("bytes_") else f"cache_{name}"
            setattr(self, attr, getattr(self, attr) + value)

    @property
    def samples_per_s(self) -> float:
        """Samples (of `unit`) delivered per second of this rank's iteration."""
        return self.samples_delivered / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        """`samples_per_s` under the name image loops read (the same figure whatever the unit)."""
        return self.samples_per_s

    def __str__(self) -> str:
        ttfb = "-" if self.time_to_first_batch_s is None else f"{self.time_to_first_batch_s:.2f} s"
        rows = [
            ("rank", str(self.rank)),
            ("epoch", str(self.epoch)),
            ("batches", str(self.batches)),
            ("samples delivered", str(self.samples_delivered)),
            ("samples skipped", str(self.samples_skipped)),
            ("samples replaced", str(self.samples_replaced)),
            (f"{self.unit}/s", f"{self.samples_per_s:.1f}"),
            ("time to first batch", ttfb),
            ("consumer wait", f"{self.wait_s:.2f} s"),
            ("retried batches", str(self.retries)),
            ("local batches", f"{self.local_batches}/{self.batches}"),
        ]
        if self.cache_hits or self.cache_misses:
            rows.append(
                (
                    "node cache",
                    f"{self.cache_hits} hits ({self.bytes_from_cache / 1e6:.1f} MB), "
                    f"{self.cache_misses} misses ({self.bytes_from_store / 1e6:.1f} MB from the store), "
                    f"{self.cache_evictions} evicted, "
                    f"{self.cache_corrupt} corrupt",
                )
            )
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
