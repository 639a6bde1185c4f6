"""read_* entry points, `mix`, and Dataset, the lazy description of a pipeline.

Nothing runs until `.loader(...)`: a Dataset is a catalog plus a tuple of
declarative stages, and printing it shows every stage. Every Dataset describes
a mixture of one or more members (`mixture()`): one dataset read as it is, one
drawn by per-sample weights (`with_weights`, a mix of one), or several mixed by
weight (`raydl.mix`); the loader reads every one of them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from raydl.describe.catalog import Catalog
from raydl.describe.mixing import Member, Mixture
from raydl.describe.records import Map, MapBatches, Pad, check_pipeline_order, compile_pipeline
from raydl.describe.transforms import (
    AspectBuckets,
    CenterCrop,
    Decode,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    Stage,
)
from raydl.execute.loader import Loader
from raydl.options import AzureOptions, GCSOptions, LoaderConfig, S3Options, keyword_signature, loader_config
from raydl.sources.images import list_image_folder
from raydl.storage import resolve, split_scheme, storage_for

__all__ = ["Dataset", "mix", "read_images", "read_parquet", "read_tokens", "read_webdataset"]


def read_images(
    root: str,
    *,
    labels: str | None = "folder",
    s3: S3Options | None = None,
    gcs: GCSOptions | None = None,
    azure: AzureOptions | None = None,
) -> Dataset:
    """An image folder, local or in an object store (s3://bucket/prefix, gs://bucket/prefix,
    az://container/prefix), listed once (recursively) into a catalog.

    Files ending .jpg/.jpeg/.png/.webp/.bmp are samples; sample ids are rows in
    sorted path order. labels="folder" numbers the top-level folders under root
    in sorted order (torchvision's ImageFolder); labels=None gives -1.
    Raises DataSourceError naming `root` when it is missing or holds no images,
    and ValueError naming an unsupported URL scheme. `s3`, `gcs`, `azure`: how to reach the store
    (docs/data.md, "Object stores").
    """
    storage, root = resolve(str(root), s3, gcs=gcs, azure=azure)
    return Dataset(list_image_folder(root, labels=labels, storage=storage))


def read_webdataset(
    urls: str | list[str],
    *,
    fields: str | dict[str, str] | list[str] | tuple[str, ...] | None = None,
    s3: S3Options | None = None,
    gcs: GCSOptions | None = None,
    azure: AzureOptions | None = None,
    image_fields: tuple[str, ...] = ("jpg", "jpeg", "png", "webp"),
    label_field: str | None = "cls",
    index: str = "auto",
    allow_pickle: bool = False,
) -> Dataset:
    """WebDataset tar shards, local or s3://, gs://, az://, listed by shard (a part each: its sample count,
    from its index).

    `urls`: a brace pattern ("shards/train-{000000..000127}.tar"), a glob, or a
    list of them. Members group into samples exactly as the webdataset library
    groups them, and batch["key"] is the webdataset key. Compressed shards
    (.tar.gz/.tgz) are read whole. A pattern that matches nothing, a malformed
    brace pattern or an unknown scheme is a ValueError naming it; a path with no
    pattern in it that does not exist a DataSourceError naming it; a corrupt or
    truncated shard a DataSourceError naming the shard and the offset.

    `fields`: which members reach the batch, and under which names.
    None: batch["image"] is the first of `image_fields` a sample has (samples
    with none are left out) and batch["label"] the integer in its
    `label_field` member (-1 without one). "all": every member, named by its
    extension as webdataset names them ("jpg", "txt", "txt.gz"), the fields
    of all the shards' samples. A dict {"image": "jpg;png", "caption": "txt"}
    selects members and renames them ("jpg;png": the first a sample has); a
    list ["jpg", "txt"] selects them under their own names. With fields given
    every sample counts, a sample lacking a selected field is that sample's
    defect (MissingFieldError naming the sample, the field and the shard),
    skipped under the default on_error="skip", and a field no
    sample has is a ValueError. Values are decoded by extension as
    webdataset's default decoder does: txt -> str, json -> parsed, cls/id/
    index -> int, npy -> ndarray, .gz decompressed first, image extensions
    and everything else -> bytes (docs/data.md lists them).

    `allow_pickle`: unpickle .pyd/.pickle/.pkl/.pth members (and object .npy
    arrays). Off by default: unpickling runs code from the shard, so turn it
    on only for shards you trust as you trust your own code.

    `index`: "auto" uses an index beside each shard (DALI's NAME.idx or
    NAME.tar.idx) or raydl's node cache, else reads each shard once (one
    streamed GET) and caches it under $RAYDL_CACHE_DIR; a path reads a raydl
    index file there (writes one when there is none; `raydl index` builds one
    ahead); a .json path (or `urls` itself) is a wids shard list whose counts
    are used as they are. Listing never makes a request per sample
    (docs/data.md says what it costs).
    """
    from raydl.sources.webdataset import list_webdataset

    stores = {"s3": s3, "gcs": gcs, "azure": azure}
    patterns, storage_of, names = _webdataset_args(
        urls, stores, fields, image_fields, label_field, allow_pickle
    )
    return Dataset(
        list_webdataset(
            patterns,
            storage_of=storage_of,
            image_fields=names,
            label_field=label_field,
            index=str(index),
            fields=fields,
            allow_pickle=allow_pickle,
        )
    )


def _webdataset_args(urls, stores, fields, image_fields, label_field, allow_pickle):
    """read_webdataset's arguments checked: (the shard patterns, storage_of(url), the image field names)."""
    defaults = tuple(image_fields) == ("jpg", "jpeg", "png", "webp") and label_field == "cls"
    if fields is not None and not defaults:
        raise ValueError(
            "read_webdataset: image_fields and label_field apply only with fields=None; with fields= name "
            "the members there, e.g. fields={'image': 'jpg;png', 'label': 'cls'}"
        )
    if not isinstance(allow_pickle, bool):
        raise ValueError(f"allow_pickle must be True or False, got {allow_pickle!r}")
    patterns = [urls] if isinstance(urls, str) else list(urls)
    schemes = {split_scheme(str(u))[0] for u in patterns}
    if len(schemes) > 1:
        raise ValueError(f"all shard URLs must use one scheme, got {sorted(schemes)} in {urls!r}")
    storage = storage_for(str(patterns[0]), **stores) if patterns else None

    def storage_of(url: str):
        storage_for(url, **stores)  # a ValueError naming an unknown scheme
        return storage

    names = (image_fields,) if isinstance(image_fields, str) else tuple(image_fields)
    if not names or not all(isinstance(f, str) and f for f in names):
        raise ValueError(f"image_fields must be a non-empty tuple of field names, got {image_fields!r}")
    patterns = [p[len("file://") :] if p.startswith("file://") else p for p in map(str, patterns)]
    return patterns, storage_of, names


def read_parquet(
    paths: str | list[str],
    *,
    columns: list[str] | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    s3: S3Options | None = None,
    gcs: GCSOptions | None = None,
    azure: AzureOptions | None = None,
) -> Dataset:
    """Parquet files, local or s3://, gs://, az://, one sample per row, a field per column:
    batch[<column name>].

    `paths`: files, folders or object-store prefixes ending in "/" (every *.parquet
    below), brace patterns or globs, or a list of them. Listing reads only
    each file's footer (one request per file) into a catalog of row groups;
    loader actors read the footers, and the selected columns' chunks of the
    row groups they need.

    `columns`: the columns that come through, in that order (None: all of
    them). `image_column`'s values are batch["image"] (a binary column, or a
    struct {"bytes", "path"} as Hugging Face datasets store images: its
    "bytes"), `label_column`'s batch["label"] (integers, null -> -1); both come
    through even when `columns` leaves them out. Without an image column, a
    struct {"bytes": binary, "path": string} column is an image field under its
    own name; a table need have no image at all. Numbers are numbers (null ->
    None), strings str, binary bytes, list<number> 1-D arrays,
    fixed_size_list<number> arrays, structs and maps dicts (docs/data.md).

    A column that does not exist, one named "id" or "key" (raydl's own batch
    columns), or one named "image"/"label" while the role is another column's
    is a ValueError naming the column and the file, before any actor starts.
    """
    from raydl.sources.parquet import list_parquet

    patterns = [paths] if isinstance(paths, str) else [str(p) for p in paths]
    if not patterns:
        raise ValueError("paths must name at least one Parquet file")
    schemes = {split_scheme(p)[0] for p in patterns}
    if len(schemes) > 1:
        raise ValueError(f"all Parquet paths must use one scheme, got {sorted(schemes)} in {paths!r}")
    storage = storage_for(patterns[0], s3, gcs=gcs, azure=azure)
    patterns = [p[len("file://") :] if p.startswith("file://") else p for p in patterns]
    catalog = list_parquet(
        patterns, storage=storage, columns=columns, image_column=image_column, label_column=label_column
    )
    return Dataset(catalog)


def read_tokens(
    paths: str | list[str],
    *,
    seq_len: int,
    column: str = "input_ids",
    eod: int | None = None,
    dtype: str = "int64",
    s3: S3Options | None = None,
    gcs: GCSOptions | None = None,
    azure: AzureOptions | None = None,
) -> Dataset:
    """A token corpus cut into windows of `seq_len` + 1 tokens: Megatron-LM indexed datasets and Parquet
    tables of token lists, local or s3://, gs://, az://.

    `paths`: one path, a pattern or a list of them. A path whose PATH.bin and PATH.idx exist is a
    Megatron-LM indexed dataset named by its prefix (a pattern may match the .bin files); a .parquet file
    is a table whose `column` is a list of integers, one document a row. Their documents, in the order
    given, are one token stream, with `eod` after every document where it is set. Window i is the stream's
    tokens [i*seq_len, i*seq_len + seq_len + 1), and the dataset has (tokens - 1) // seq_len of them.

    A batch holds input_ids (B, seq_len), a window's first seq_len tokens, labels (B, seq_len), its last
    seq_len, and position_ids (B, seq_len), each token's position in its document (from the index, never
    from looking for `eod`), all as `dtype` ("int64" or "int32"), with "id" and "key".

    Listing reads the .idx files and Parquet footers only. A bad index, a .bin shorter than its index, a
    column that is not a list of integers or fewer than seq_len + 1 tokens is an error naming the file
    (docs/data.md).
    """
    from raydl.sources.tokens import list_tokens

    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"read_tokens: seq_len must be an integer >= 1, got {seq_len!r}")
    if eod is not None and (isinstance(eod, bool) or not isinstance(eod, (int, np.integer)) or eod < 0):
        raise ValueError(f"read_tokens: eod must be None or a token id (an integer >= 0), got {eod!r}")
    if dtype not in ("int64", "int32"):
        raise ValueError(f"read_tokens: dtype must be 'int64' or 'int32', got {dtype!r}")
    if not isinstance(column, str) or not column:
        raise ValueError(f"read_tokens: column must be a column name, got {column!r}")
    patterns = [paths] if isinstance(paths, str) else [str(p) for p in paths]
    if not patterns:
        raise ValueError("read_tokens: paths must name at least one token corpus")
    schemes = {split_scheme(p)[0] for p in patterns}
    if len(schemes) > 1:
        raise ValueError(f"all token corpus paths must use one scheme, got {sorted(schemes)} in {paths!r}")
    storage = storage_for(patterns[0], s3, gcs=gcs, azure=azure)
    catalog = list_tokens(
        patterns,
        storage=storage,
        seq_len=int(seq_len),
        column=column,
        eod=None if eod is None else int(eod),
        dtype=dtype,
    )
    return Dataset(catalog)


@dataclass(frozen=True)
class Dataset:
    """A catalog and the stages every sample goes through. Immutable: each method returns a new one."""

    catalog: Catalog
    stages: tuple[Stage, ...] = ()
    #: per-sample weights (with_weights), one float64 per sample, and the epoch they draw; None: none
    weights: np.ndarray | None = field(default=None, compare=False, repr=False)
    epoch_size: int | None = None
    #: the mix this dataset is, made by `raydl.mix` (its members keep their own stages); None: one dataset
    mix: Mixture | None = field(default=None, repr=False)

    def _with(self, stage: Stage) -> Dataset:
        """This dataset with `stage` added; a ValueError naming the stage when it is out of order."""
        if self.mix is not None:
            raise ValueError(
                f".{stage.method}() on a mix: give each dataset its stages before raydl.mix(...) "
                "(each keeps its own)"
            )
        stages = self.stages + (stage,)
        check_pipeline_order(stages)  # here, at the call that makes the mistake, not at loader()
        return replace(self, stages=stages)

    def with_weights(self, weights, *, epoch_size: int | None = None) -> Dataset:
        """Draw each epoch's samples with replacement, with probability proportional to their weight.

        `weights`: one number per sample (an array or a list, in sample-id order), or the name of a numeric
        column (Parquet), read once here. They must be finite and >= 0, not all 0, and as many as the
        samples: a ValueError names the first bad one. An epoch draws `epoch_size` samples (default: as
        many as there are), a pure function of (catalog, weights, seed, epoch): the same draws in every
        run, exact and elastic resume as for any dataset; a resume state records a digest of the weights
        and refuses a loader with other ones. Composes with `raydl.mix` (the mix's weight gives the source
        its share; its samples are drawn by these weights).
        """
        from raydl.describe.mixing import check_sample_weights

        if self.mix is not None:
            raise ValueError("with_weights() on a mix: weight the datasets inside it, then mix them")
        what = f"with_weights() on {self.catalog.source.name} {self.catalog.root!r}"
        if isinstance(weights, str):
            from raydl.sources.parquet import ParquetSource, read_column

            if not isinstance(self.catalog.source, ParquetSource):
                raise ValueError(f"{what}: a column name ({weights!r}) works for Parquet only; pass an array")
            weights = read_column(self.catalog, weights)
        w = check_sample_weights(weights, len(self.catalog), what)
        if epoch_size is not None and (
            not isinstance(epoch_size, int) or isinstance(epoch_size, bool) or epoch_size < 1
        ):
            raise ValueError(f"{what}: epoch_size must be a positive int, got {epoch_size!r}")
        return replace(self, weights=w, epoch_size=epoch_size or len(self.catalog))

    def decode(
        self,
        *,
        fast: bool = False,
        max_pixels: int | None = None,
        fields: tuple[str, ...] | None = None,
        masks: tuple[str, ...] = (),
    ) -> Dataset:
        """Image fields' bytes to RGB uint8 pixels (any mode becomes RGB), and masks to label maps.

        fields: the image fields to decode (default: every image field; the others stay bytes). masks:
        image fields decoded as single-channel label maps (a palette index or grey value each, never RGB),
        resized with nearest-neighbour, never normalized: uint8 (B, H, W). Every image field of a sample
        gets the same crop and flip.

        By default the output stays within about a grey level of Pillow's (full
        decode, box crop, antialiased resize). fast=True opts into the shortcuts
        that change pixels for speed: a coarser DCT scale, libjpeg's IFAST IDCT
        and no fancy upsampling. max_pixels: the pixel limit of every image,
        checked from its header before anything is allocated; past it a sample
        is a DecodeError under on_error (default: Pillow's MAX_IMAGE_PIXELS
        when raydl was imported, about 89.5 M).
        """
        options: dict[str, Any] = {"fast": fast}
        if max_pixels is not None:
            options["max_pixels"] = max_pixels
        if fields is not None:
            options["fields"] = (fields,) if isinstance(fields, str) else tuple(fields)
        if masks:
            options["masks"] = (masks,) if isinstance(masks, str) else tuple(masks)
        return self._with(Decode(**options))

    def random_resized_crop(self, size, *, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> Dataset:
        """A random box of `scale` of the area and `ratio` aspect, resized to `size`."""
        return self._with(RandomResizedCrop(size, tuple(scale), tuple(ratio)))

    def resize(self, size) -> Dataset:
        """Short side to `size` (an int), or exactly (height, width)."""
        return self._with(Resize(size))

    def center_crop(self, size) -> Dataset:
        """The central `size` (int or (height, width)) window."""
        return self._with(CenterCrop(size))

    def aspect_buckets(
        self,
        size: int = 512,
        *,
        multiple: int = 32,
        min_ratio: float = 0.5,
        max_ratio: float = 2.0,
        crop: str = "center",
    ) -> Dataset:
        """Crop and resize every image into the aspect-ratio bucket nearest its own (datago's buckets).

        Buckets: with p = size // multiple and s = p*p, each pw from
        ceil(sqrt(s*min_ratio)) to floor(sqrt(s*max_ratio)) gives a bucket
        pw*multiple wide and (s // pw)*multiple high, plus the transposes. Each
        image is cropped to its bucket's ratio (crop="center" or a seeded
        "random" offset) and resized with antialiasing. Batches are
        bucket-pure: batch["image"] is (B, H_b, W_b, 3), batch["bucket"] is
        (H_b, W_b); a bucket's last batch is shorter (dropped with drop_last).
        Replaces random_resized_crop/resize/center_crop. Reads every image's
        size from its header here, once (image folders only: else ValueError).
        """
        stage = AspectBuckets(size, multiple, min_ratio, max_ratio, crop)
        added = self._with(stage)  # the order is checked before any size is read
        return replace(added, catalog=self.catalog.with_sizes())

    def bucket_counts(self) -> dict[tuple[int, int], int]:
        """How many images go to each bucket (H, W), from the images' sizes, in bucket order."""
        if self.mix is not None:
            raise ValueError("bucket_counts() on a mix: call it on each dataset before mixing")
        stage = next((st for st in self.stages if isinstance(st, AspectBuckets)), None)
        if stage is None:
            raise ValueError("bucket_counts() needs .aspect_buckets(...) in the pipeline")
        idx = stage.assign(self.catalog.column("width"), self.catalog.column("height"))
        counts = np.bincount(idx[idx >= 0], minlength=len(stage.buckets))
        return {b: int(c) for b, c in zip(stage.buckets, counts, strict=True)}

    def random_hflip(self, p: float = 0.5) -> Dataset:
        """Mirror left-right with probability p."""
        return self._with(RandomHFlip(p))

    def normalize(self, mean="imagenet", std=None) -> Dataset:
        """(x / 255 - mean) / std; a preset name ("imagenet") or 3 means and 3 stds. Output float32 NCHW."""
        return self._with(Normalize.make(mean, std))

    def map(self, fn) -> Dataset:
        """fn(record) -> record on each sample, in the loader's workers, after the native stages.

        `record` is a dict of the sample's fields (decoded images as arrays); the returned dict's fields make
        the batch. A `fn` whose signature has `rng` is called as fn(record, rng=Generator), the Generator
        seeded from the sample's augmentation seed (deterministic; resumes exactly). `fn` must pickle (a
        ValueError at loader() otherwise). An exception in `fn` fails the batch with a LoaderError naming the
        sample and the worker, with the traceback: never skipped. `fn` holds the GIL: num_workers scales it.
        """
        return self._with(Map(fn))

    def map_batches(self, fn) -> Dataset:
        """fn(batch) -> batch on each numpy batch (a dict of columns), in the loader's workers, after the
        per-sample stages. As `map`: fn(batch, rng=...) gets a Generator seeded from the batch's seeds; an
        exception fails the batch with a LoaderError naming it. "id" and "key" are kept when fn leaves them
        out and keeps the rows."""
        return self._with(MapBatches(fn))

    def pad(self, field: str, length: int, value=0) -> Dataset:
        """Pad (with `value`) or truncate `field` (token lists, arrays) to `length` along its first axis,
        and add `<field>_length`: how many of its values are the sample's own (at most `length`)."""
        stage = Pad(field, length, value)
        names = [f.name for f in self.catalog.source.fields]
        if field not in names and not any(isinstance(st, Map) for st in self.stages):
            raise ValueError(
                f".pad({field!r}, ...): the source has no field {field!r}; its fields are {names}"
            )
        return self._with(stage)

    def loader(self, **options: Any) -> Loader:
        """Start loader actors on Ray and return the Loader. A process not connected to Ray starts a local
        one (`ray.init(address="local")`), or joins the cluster RAY_ADDRESS names.

        Takes the fields of `raydl.options.LoaderConfig` as keywords, each documented there with its
        default: `batch_size` (required), `world_size`, `seed`, `shuffle`, `drop_last`, `on_error`,
        `num_workers`, `threads_per_worker`, `cpus_per_worker`, `node_resource`, `prefetch_batches`,
        `object_store_budget`, `io_concurrency`, `max_sample_bytes`, `batch_timeout_s`, `shuffle_window`,
        `cache`. A keyword that is not one of them is a TypeError naming it.
        """
        return self.loader_from_config(loader_config(options, caller="Dataset.loader()"))

    def loader_from_config(self, config: LoaderConfig) -> Loader:
        """As `loader(...)`, with the settings in a LoaderConfig (e.g. from `load_loader_config`)."""
        return Loader(self.mixture(), None, config)

    def mixture(self) -> Mixture:
        """What this dataset describes: its members, their weights, the epoch size and the batching."""
        if self.mix is not None:
            return self.mix
        if self.weights is not None:  # a weighted draw is a mix of one member
            return Mixture((self._member("0"),), (1.0,), self.epoch_size, labelled=False)
        return Mixture.one(self.catalog, compile_pipeline(self.stages))

    def _member(self, name: str) -> Member:
        return Member(name, self.catalog, compile_pipeline(self.stages), self.weights)

    def __len__(self) -> int:
        """Samples in an epoch: the catalog's, with_weights' epoch_size, or the mix's."""
        if self.mix is not None:
            return self.mix.epoch_size
        return len(self.catalog) if self.epoch_size is None else self.epoch_size

    def __repr__(self) -> str:
        if self.mix is not None:
            return _mix_repr(self.mix)
        c = self.catalog
        classes = str(len(c.classes))
        # Labels without names: counted where the driver has them (image folders), else read with the samples
        # (WebDataset, Parquet: "?"), unless the source reads none (no label field or column: 0).
        labelled = c.distinct_labels()
        unlabelled = not c.source.reads_labels
        if not c.classes and labelled:
            classes = f"?, distinct_labels={labelled}"
        elif not c.classes and labelled is None and not unlabelled:
            classes = "?"
        lines = [f"Dataset(source={c.source.name}, root={c.root!r}, samples={len(c)}, classes={classes})"]
        lines += [f"  -> {st!r}" for st in self.stages]
        return "\n".join(lines)


def mix(
    datasets: dict[str, Dataset],
    weights: dict[str, float] | None = None,
    *,
    epoch_size: int | None = None,
    batching: str = "stratified",
) -> Dataset:
    """Several datasets mixed by weight into one, each keeping its own stages; batch["source"] names each
    row's dataset.

    `weights`: {name: weight} for every dataset (any non-negative scale; None: by size). An epoch has
    `epoch_size` samples (default: the datasets' sizes summed); a dataset's share is weight x epoch_size,
    rounded so that the shares sum to epoch_size. A dataset smaller than its share repeats (each sample
    floor(share/size) or ceil(share/size) times an epoch); a larger one is subsampled without replacement,
    another subset each epoch, so that over epochs every sample is seen. One with `with_weights` draws its
    share by its per-sample weights.

    `batching`: "stratified" (every batch holds each dataset's share of the batch, within one sample; the
    datasets must give the same fields, dtypes and shapes) or "per_source" (each batch from one dataset,
    the datasets' batches in proportion to their weights; the same field names, any shapes).

    The plan stays a pure function of (datasets, weights, seed, epoch): the same batches and pixels in every
    run, exact resume, resume at another world size (with the same batch_size), node loss and equal batches
    per rank, as for one dataset. A resume state records the mix and refuses a loader whose weights,
    datasets or epoch differ, naming what changed. A ValueError names the dataset and field that do not fit,
    before any actor starts. Bucketed datasets (all with the same aspect_buckets) mix per_source, a bucket
    of one dataset a batch (docs/data.md).
    """
    if not isinstance(datasets, dict) or not datasets:
        raise ValueError(f"mix() takes a non-empty dict {{name: dataset}}, got {type(datasets).__name__}")
    for name, ds in datasets.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"mix(): dataset names must be non-empty strings, got {name!r}")
        if isinstance(ds, Dataset) and ds.mix is not None:
            raise ValueError(f"mix(): {name!r} is a mix itself; mix its datasets in one raydl.mix() call")
        if not isinstance(ds, Dataset):
            raise ValueError(f"mix(): {name!r} is a {type(ds).__name__}, not a raydl Dataset")
    if weights is None:
        weights = {name: float(len(ds)) for name, ds in datasets.items()}
    if not isinstance(weights, dict):
        raise ValueError(f"mix(): weights must be a dict {{name: weight}}, got {type(weights).__name__}")
    missing, extra = sorted(set(datasets) - set(weights)), sorted(set(weights) - set(datasets))
    if missing or extra:
        raise ValueError(
            f"mix(): weights must name every dataset and no other: missing {missing}, unknown {extra} "
            f"(datasets: {list(datasets)})"
        )
    size = sum(len(ds) for ds in datasets.values()) if epoch_size is None else epoch_size
    mixture = Mixture(
        tuple(ds._member(name) for name, ds in datasets.items()),
        tuple(weights[name] for name in datasets),
        size,
        batching,
    )
    first = next(iter(datasets.values()))
    return Dataset(first.catalog, (), mix=mixture)


def _mix_repr(m: Mixture) -> str:
    total = sum(m.weights)
    lines = [f"Mix(samples={m.epoch_size}, batching={m.batching!r})"]
    for member, w in zip(m.members, m.weights, strict=True):
        c = member.catalog
        weighted = ", per-sample weights" if member.weights is not None else ""
        lines.append(
            f"  {member.name!r} weight={w / total:.4g}{weighted}: {c.source.name} {c.root!r}, "
            f"samples={len(c)}"
        )
    return "\n".join(lines)


Dataset.loader.__signature__ = keyword_signature(Dataset.loader, LoaderConfig)  # type: ignore[attr-defined]
