"""The contract between a peer and the runner: what a peer is given, and how it is timed.

A peer calls `clock.start()` just before it constructs its loader and
`clock.batch(images)` for each batch in hand; the runner hooks its CPU and
memory sampler onto the start and the end of that window.

With `PeerSpec.epochs` = N > 1 a peer that can (`MULTI_EPOCH` in peers.py) runs N
epochs of the same loader. Every figure of the first epoch keeps its meaning; the
epochs after it are timed apart (`Measurement.later_images`, `later_s`), so that the
per-epoch cost of a long run shows without the one-off start-up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EpochClock", "Measurement", "PeerSpec", "digest", "process_start_time", "stand_in"]


def process_start_time() -> float:
    """This process's start as a time.time() value, to within a clock tick (10 ms).

    On Linux, from the start in ticks after boot (/proc/self/stat) and the time since boot
    (CLOCK_BOOTTIME). psutil's create_time adds those ticks to the boot time of /proc/stat, which is
    whole seconds: its start can be up to a second early, and every "from start" figure that long.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return psutil.Process().create_time()


def digest(rows) -> int:
    """The sum over the rows of a (B, L) integer batch (numpy or torch) of each row's weighted sum, with
    weights that depend on the column: the same for the same rows in any order."""
    import numpy as np

    rows = np.asarray(rows.numpy() if hasattr(rows, "numpy") else rows, np.int64)
    rows = rows.reshape(len(rows), -1)
    weights = (np.arange(rows.shape[1], dtype=np.int64) * 2654435761) % 1_000_003 + 1
    return sum(int(v) for v in rows @ weights)  # each row's sum fits an int64; their sum is Python's


def stand_in(n: int, shape: tuple[int, ...], dtype="uint8"):
    """A zero-byte (n, *shape) array for the clock, which reads only the shape and dtype of a batch."""
    import numpy as np

    return np.broadcast_to(np.zeros((), dtype), (n, *shape))


@dataclass(frozen=True)
class PeerSpec:
    """What every peer is given: one folder, one CPU budget, one batch size."""

    data: str
    cpus: int
    batch_size: int
    seed: int
    expected: int  # images in the folder; the batch that reaches it closes the clock
    workload: str = (
        "train"  # "train" (RandomResizedCrop 224, normalize) or "buckets" (aspect buckets 512, uint8)
    )
    source: str = "images"  # raydl only: "images", "webdataset" or "parquet"; data may be s3://
    endpoint_url: str | None = None  # raydl only: the S3 endpoint for s3:// data
    image_column: str = "image"  # parquet
    label_column: str | None = "label"  # parquet
    nodes: int = 1  # raydl only: > 1 runs it on a local ray.cluster_utils.Cluster of this many nodes
    epochs: int = 1  # epochs of the same loader; the first is the one measured, the rest are timed apart
    ray_address: str | None = None  # raydl only: connect to this running cluster instead of starting Ray
    seq_len: int = 0  # the tokens workload's windows: tokens a window's input ids hold
    checksum: bool = False  # sum a digest of every batch (EpochClock.checksum): slower, for tests


@dataclass(frozen=True)
class Measurement:
    images: int
    first_batch_s: float  # construction to the first batch in hand
    steady_images: int  # images delivered after the first batch
    steady_s: float  # first batch to last batch
    batch_shape: tuple[int, ...]
    batch_dtype: str
    batches: int = 0
    first_batch_at: float = (
        0.0  # wall-clock time (time.time()) of the first batch, to compare with process start
    )
    later_images: int = 0  # with epochs > 1: images of the epochs after the first
    later_s: float = 0.0  # ... from the first epoch's last batch to the last epoch's last batch

    @property
    def images_per_s(self) -> float:
        return self.steady_images / self.steady_s if self.steady_s > 0 else 0.0


class EpochClock:
    """Times one epoch. The hooks let the runner sample CPU exactly at the start and end."""

    def __init__(
        self,
        expected: int,
        on_start: Callable[[], None],
        on_finish: Callable[[], None],
        on_first: Callable[[], None] | None = None,
        *,
        epochs: int = 1,
        on_first_epoch: Callable[[], None] | None = None,
        checksum: bool = False,
    ):
        self._expected = expected
        # With checksum: the sum over the first epoch of each batch row's digest (`digest`), which every peer
        # delivering the same rows in any order and batching has in common.
        self.checksum: int | None = 0 if checksum else None
        self._epochs = epochs
        self._on_start, self._on_finish, self._on_first = on_start, on_finish, on_first
        self._on_first_epoch = on_first_epoch  # called at the first epoch's last batch (epochs > 1)
        self._epoch1: Measurement | None = None
        self._epoch1_last = 0.0
        self._t0 = self._first = self._last = None
        self._n = self._n_first = self._batches = 0
        self._first_wall = 0.0
        self._shape: tuple[int, ...] = ()
        self._dtype = ""
        self._finished = False
        self.extra: dict = {}  # what a peer wants in its JSON row besides the timings (e.g. raydl's memory)

    def start(self) -> None:
        self._on_start()
        self._t0 = time.perf_counter()

    def batch(self, images) -> None:
        now = time.perf_counter()
        n = int(images.shape[0])
        self._batches += 1
        if self._first is None:
            self._first, self._n_first, self._first_wall = now, n, time.time()
            if self._on_first is not None:
                self._on_first()
            self._shape = tuple(int(d) for d in images.shape)
            self._dtype = str(images.dtype).removeprefix("torch.")
        if self.checksum is not None and self._epoch1 is None:
            self.checksum += digest(images)
        self._n += n
        self._last = now
        if self._epoch1 is None and self._n >= self._expected:
            self._epoch1 = self._measure()
            if self._epochs > 1 and self._on_first_epoch is not None:
                self._on_first_epoch()
        # Close at the last expected batch, before the peer tears anything down:
        # torch's workers exit as soon as the iterator runs dry, taking their CPU times.
        if self._n >= self._expected * self._epochs:
            self.finish()

    def resume_later(self) -> None:
        """The later epochs' window starts now, not at the first epoch's last batch: the peer paused
        between them for a one-off start-up that a long run pays once (raydl's `refresh()`, which starts its
        coordinator if it has not started yet). Their time and the sampler's CPU baseline are taken again."""
        if self._epoch1 is not None and self._epochs > 1:
            self._epoch1_last = time.perf_counter()
            if self._on_first_epoch is not None:
                self._on_first_epoch()

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._on_finish()

    def result(self) -> Measurement:
        """The first epoch's figures (with the later epochs' images and time when there were more)."""
        self.finish()
        if self._first is None:
            raise RuntimeError("the peer delivered no batch")
        if self._epochs == 1 or self._epoch1 is None:  # one epoch, or fewer images than expected
            return self._measure()
        later = self._n - self._epoch1.images
        if later <= 0:
            return self._epoch1
        from dataclasses import replace

        return replace(self._epoch1, later_images=later, later_s=self._last - self._epoch1_last)

    def _measure(self) -> Measurement:
        self._epoch1_last = self._last
        return Measurement(
            images=self._n,
            first_batch_s=self._first - self._t0,
            steady_images=self._n - self._n_first,
            steady_s=self._last - self._first,
            batch_shape=self._shape,
            batch_dtype=self._dtype,
            batches=self._batches,
            first_batch_at=self._first_wall,
        )
