"""read_* entry points and Dataset, the lazy description of a pipeline.

Nothing runs until `.loader(...)`: a Dataset is a catalog plus a tuple of
declarative stages, and printing it shows every stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from raydl.catalog import Catalog
from raydl.config import LoaderConfig, S3Options
from raydl.loader import Loader
from raydl.sources.images import list_image_folder
from raydl.storage import resolve
from raydl.transforms import (
    CenterCrop,
    Decode,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    Stage,
    compile_stages,
)

__all__ = ["Dataset", "read_images"]


def read_images(root: str, *, labels: str | None = "folder", s3: S3Options | None = None) -> Dataset:
    """An image folder, local or s3://bucket/prefix, listed once (recursively) into a catalog.

    Files ending .jpg/.jpeg/.png/.webp/.bmp are samples; sample ids are rows in
    sorted path order. labels="folder" numbers the top-level folders under root
    in sorted order (torchvision's ImageFolder); labels=None gives -1.
    Raises DataSourceError naming `root` when it is missing or holds no images,
    and ValueError naming an unsupported URL scheme.
    """
    storage, root = resolve(str(root), s3)
    return Dataset(list_image_folder(root, labels=labels, storage=storage))


@dataclass(frozen=True)
class Dataset:
    """A catalog and the stages every sample goes through. Immutable: each method returns a new one."""

    catalog: Catalog
    stages: tuple[Stage, ...] = ()

    def _with(self, stage: Stage) -> Dataset:
        return Dataset(self.catalog, self.stages + (stage,))

    def decode(self, *, fast: bool = False) -> Dataset:
        """Bytes to RGB uint8 pixels (any mode becomes RGB).

        By default the output stays within about a grey level of Pillow's (full
        decode, box crop, antialiased resize). fast=True opts into the shortcuts
        that change pixels for speed: a coarser DCT scale, libjpeg's IFAST IDCT
        and no fancy upsampling.
        """
        return self._with(Decode(fast=fast))

    def random_resized_crop(self, size, *, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> Dataset:
        """A random box of `scale` of the area and `ratio` aspect, resized to `size`."""
        return self._with(RandomResizedCrop(size, tuple(scale), tuple(ratio)))

    def resize(self, size) -> Dataset:
        """Short side to `size` (an int), or exactly (height, width)."""
        return self._with(Resize(size))

    def center_crop(self, size) -> Dataset:
        """The central `size` (int or (height, width)) window."""
        return self._with(CenterCrop(size))

    def random_hflip(self, p: float = 0.5) -> Dataset:
        """Mirror left-right with probability p."""
        return self._with(RandomHFlip(p))

    def normalize(self, mean="imagenet", std=None) -> Dataset:
        """(x / 255 - mean) / std; a preset name ("imagenet") or 3 means and 3 stds. Output float32 NCHW."""
        return self._with(Normalize.make(mean, std))

    def loader(
        self,
        *,
        batch_size: int,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        on_error: str = "skip",
        num_workers: int = 1,
        threads_per_worker: int | None = None,
        cpus_per_worker: float = 1.0,
        node_resource: str | None = None,
        prefetch_batches: int = 2,
        object_store_budget: int | None = None,
        io_concurrency: int | None = None,
    ) -> Loader:
        """Start loader actors on Ray (ray.init() first if needed) and return the Loader.

        on_error="skip" leaves undecodable samples out of their batch (which may
        then have 0 rows, with a warning) and counts them; "replace" puts in
        their place a substitute drawn from the failed slot's seed (the same in
        every run), so batches keep batch_size rows; "raise" stops the epoch
        with SampleDecodeError naming the file. Only decode errors (and, under
        "replace", unreadable files) are covered: any other failure is a LoaderError.
        num_workers actors start on every alive node that has cpus_per_worker
        CPUs (and the custom resource `node_resource`, when given), and on nodes
        that join later; each decodes on `threads_per_worker` threads (default:
        the CPUs it may run on). Each rank keeps at most prefetch_batches batch
        tasks in flight, fewer when the loader's batches would not fit
        `object_store_budget` bytes (default: a quarter of the smallest node's
        object store). Each actor fetches bytes on `io_concurrency` IO threads,
        apart from its decode threads (default: the storage's, 4 for local disk,
        `S3Options.max_concurrency` for S3).
        """
        config = LoaderConfig(
            batch_size=batch_size, world_size=world_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
            on_error=on_error, num_workers=num_workers, threads_per_worker=threads_per_worker,
            cpus_per_worker=cpus_per_worker, node_resource=node_resource, prefetch_batches=prefetch_batches,
            object_store_budget=object_store_budget, io_concurrency=io_concurrency,
        )
        return self.loader_from_config(config)

    def loader_from_config(self, config: LoaderConfig) -> Loader:
        """As `loader(...)`, with the settings in a LoaderConfig (e.g. from `load_loader_config`)."""
        return Loader(self.catalog, compile_stages(self.stages), config)

    def __len__(self) -> int:
        return len(self.catalog)

    def __repr__(self) -> str:
        c = self.catalog
        lines = [f"Dataset(source={c.source.name}, root={c.root!r}, samples={len(c)}, classes={len(c.classes)})"]
        lines += [f"  -> {st!r}" for st in self.stages]
        return "\n".join(lines)
