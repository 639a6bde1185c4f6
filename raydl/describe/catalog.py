"""The catalog: the shards (objects) a source's samples live in, and its parts, in sample-id order; and the
Source contract, which says where a catalog's samples lie in those bytes and cuts them out.

    shards:  uri | size | etag                 one row per object (image file, tar shard, Parquet file)
    parts:   shard | count [| source columns]   one row per unit of samples (an image file, a tar shard,
                                                a Parquet row group)

The driver holds this and nothing per sample (but for image folders, where a
part is one file): a source with many samples per part keeps where each
sample's bytes are in per-part blocks that a worker loads when it reads that
part (a WebDataset shard's index), or derives it from the part (a Parquet row
group's rows). Part p holds the sample ids [starts[p], starts[p+1]), `starts`
the prefix sum of `count`; `locate` maps ids to (part, position) by binary
search, so a batch costs O(batch log parts) whatever the dataset's size.

Image sizes are read only when a stage needs them (aspect buckets):
`with_sizes()` reads each image's header (`catalog_sizes`, with the parser of
raydl/describe/sizes.py) into int32 width and height parts columns, -1 where
the header is unreadable, the reason in `size_errors` by sample id. Listing
reads no image bytes.

Every source (raydl/sources) subclasses `Source`: the worker asks it where a
batch's samples are (`locate`, a `Located` of byte ranges), reads the blocks
it fetches through it (`read_block`) and has it cut each sample's fields out
of its range (`cut`). A source's optional capabilities are attributes of
`Source` with defaults (`cut_views`, `reads_labels`, `reads_batches`,
`reads_plain_batches`, `reads_ahead`, `bootstraps`, `shuffle_window`,
`sample_bytes`): read them directly.
A source that `reads_batches` (token windows) makes a whole batch in one
`read_batch` call; one that `reads_plain_batches` (Parquet numbers and arrays)
does so where no per-sample stage runs, and reads sample by sample otherwise.

Two fingerprints (hashed by raydl/describe/fingerprint.py):
- `samples_fingerprint` covers every parts column but the sizes and the
  source's `locators` (where a part's index block is, which does not change
  what the samples are), and each shard's path relative to `root` and size. The
  shuffle is seeded by it, so the same files give the same order wherever they
  are stored (a local copy and its S3 upload).
- `fingerprint` covers that and each shard's etag. Resume states carry it, so
  a state cannot be loaded against changed data (a copy of the same files
  elsewhere in the same store keeps it).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from raydl.describe.fields import Field
from raydl.describe.fingerprint import fingerprints
from raydl.describe.sizes import HeaderSizes, header_sizes
from raydl.errors import DataSourceError
from raydl.storage.base import ObjectInfo, Storage
from raydl.util.arrow import int_array, int_column, string_array

__all__ = ["SIZE_COLUMNS", "Catalog", "Located", "Source", "catalog_sizes", "make_catalog"]

SIZE_COLUMNS = ("width", "height")  # derived from the samples' bytes: outside both fingerprints


@dataclass
class Located:
    """Where a batch's samples are: row i is the i-th id asked.

    A sample's bytes are `length` bytes at `offset` of shard `shard` (a row of
    the catalog's shards); the worker coalesces neighbouring ranges into
    blocks and hands each sample its range's bytes to `Source.cut`. `row` and
    `cut_info` are the source's own: a Parquet row within its row group; what
    `cut` needs of sample i besides its bytes (a WebDataset sample's
    `MemberSpans`, where its members lie inside its range; a Parquet row's row
    group read). `label` is -1 where the source reads it at `cut`. `size` is
    the sample's own size where the range is more than the sample (None:
    `length`). `errors` are the samples that could not be located (their
    shard's index block is unreadable, or the shard changed): the worker
    settles them as unreadable, under on_error.
    """

    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    row: np.ndarray
    key: list[str]
    label: np.ndarray
    cut_info: list | None = None
    size: np.ndarray | None = None
    errors: dict[int, DataSourceError] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.key)

    def to_pydict(self) -> dict[str, list]:
        """The rows as lists by column (shard, offset, length, row, label, key): for tools and tests."""
        cols = {c: getattr(self, c).tolist() for c in ("shard", "offset", "length", "row", "label")}
        return {**cols, "key": list(self.key)}


class Source(abc.ABC):
    """A catalog's layout: where its samples are, how a fetched block is read and how a sample is cut from
    its range. Every source subclasses it (as a frozen dataclass, most) and sets `name`, `fields` and
    `range_is_sample`; the capabilities after them have defaults, which a source overrides where it has
    the capability, so callers read them directly.

    Samples whose ranges are equal share one fetch (Parquet rows of one row
    group's column chunk); neighbouring ranges are coalesced into blocks by the
    worker.
    """

    name: str
    """What errors and reprs call the source: "images", "webdataset", "parquet"."""

    fields: tuple[Field, ...]
    """The fields of every sample, in batch order (besides "id" and "key", which every batch has)."""

    range_is_sample: bool
    """A sample's range is exactly its bytes (or `Located.size` says them), so the sample's size is known
    before it is read (not so for a Parquet row, whose range is its row group's column chunk)."""

    cut_views: bool = False
    """`cut` takes a memoryview of the block and copies out the bytes it returns (a WebDataset sample's
    image inside its image-and-label range: one copy, not two). False: `cut` is given bytes, which it
    may return as they are."""

    reads_labels: bool = False
    """The samples carry a label (batch["label"]): an image folder's class, a WebDataset label member, a
    Parquet label column. Where the driver does not hold the labels (`Catalog.labels()` is None), they
    are read with the samples."""

    reads_batches: bool = False
    """The source makes a whole batch at once (`read_batch`), with no per-sample ranges, cuts or decodes: a
    token corpus, whose samples are windows of one token stream, cut out of it in a few numpy calls."""

    reads_plain_batches: bool = False
    """The source also makes a whole batch at once (`read_batch`) where no per-sample stage runs and no image
    is decoded (Parquet columns of numbers and arrays): the worker reads batches so, and a batch whose
    `read_batch` raises a DataSourceError is read again sample by sample (`locate`, `cut`), where on_error
    settles each sample."""

    bootstraps: bool = True
    """The Loader's own process makes the first batches while the workers start. False where a batch is cut
    out of whole parts decoded once per process (a Parquet table read whole): the driver's decodes would be
    done again by the workers, and on a small machine they slow the workers' start."""

    reads_ahead: bool = False
    """`read_batch` also takes `ahead`, the samples of a later batch (BatchTask.ahead), and may start
    reading their parts beside the batch's own (Parquet: decoding the next shuffle window's row groups)."""

    shuffle_window: int | None = None
    """The source's default for LoaderConfig.shuffle_window (parts shuffled together; 0: all). None: 0 where
    `range_is_sample`, else a few parts (raydl/plan/build.py)."""

    sample_bytes: int | None = None
    """Bytes one sample takes in a batch, where the source knows them without reading (token windows); None:
    the plan estimates them (raydl/plan/build.py)."""

    def read_batch(self, catalog: Catalog, storage: Storage, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of samples `ids` as arrays by field (with "key"), where `reads_batches`. A
        DataSourceError when its bytes cannot be had or are not as listed: it fails the batch."""
        raise NotImplementedError(f"the {self.name} source reads its samples one at a time")

    @abc.abstractmethod
    def locate(self, catalog: Catalog, ids: np.ndarray) -> Located:
        """Where the samples `ids` are (one row per id, in order)."""

    @abc.abstractmethod
    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        """The bytes [offset, offset+length) of `shard` as listed (of its decompressed stream, where
        compressed)."""

    @abc.abstractmethod
    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        """Sample i of `located` as a record, given its range's bytes `data`: a value for every one of
        `fields` (an image field's encoded bytes; the others decoded: str, int, dict, ndarray, bytes).

        A DataSourceError when the sample cannot be had (a selected field missing: it names the sample, the
        field and the shard); a DecodeError when a field's bytes are malformed (bad JSON, .npy or gzip).
        Both go through on_error."""

    @abc.abstractmethod
    def sample_uri(self, shard_uri: str, key: str) -> str:
        """How errors name one sample: the file itself, or its shard and key."""


@dataclass(frozen=True)
class Catalog:
    """The samples of a source: its shards, its parts and how to cut samples out of them (`source`)."""

    root: str
    storage: Storage
    source: Source
    shards: pa.Table
    parts: pa.Table
    classes: tuple[str, ...]
    fingerprint: str
    samples_fingerprint: str
    starts: np.ndarray = field(compare=False, repr=False)
    size_errors: Mapping[int, str] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __reduce__(self):
        """Pickled with its tables as Arrow IPC streams: pyarrow buffers, which pickle 5 hands over out of
        band (Ray's object store keeps them without a copy; its workers map them). Left to Ray, a table goes
        through Ray's own Arrow serializer, whose offset-buffer copy imports pandas (0.25 s of CPU in the
        process that first puts a catalog)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["shards"], fields["parts"] = _ipc_buffer(self.shards), _ipc_buffer(self.parts)
        return _catalog_from_ipc, (fields,)

    @property
    def num_parts(self) -> int:
        return self.parts.num_rows

    def column(self, name: str) -> np.ndarray:
        """A parts integer column as numpy (a view: no copy)."""
        return int_column(self.parts.column(name))

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(part, position within the part) of each sample id: a binary search over the parts' starts."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids must be in [0, {len(self)})")
        part = np.searchsorted(self.starts, ids, side="right") - 1
        return part, ids - self.starts[part]

    def samples(self, ids=None) -> Located:
        """Where samples `ids` (default: all) are, as a worker sees them (`Source.locate`). For tools and
        tests: a source that keeps per-shard index blocks loads them here."""
        ids = np.arange(len(self), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        return self.source.locate(self, ids)

    def shard_info(self, shard: int) -> ObjectInfo:
        """Shard (object) `shard`: its URI, size and etag."""
        s = self.shards
        return ObjectInfo(
            s.column("uri")[shard].as_py(),
            int(s.column("size")[shard].as_py()),
            s.column("etag")[shard].as_py(),
        )

    def uri(self, sample_id: int) -> str:
        """The URI of the shard (file, object) sample `sample_id` lives in."""
        part, _ = self.locate([sample_id])
        shard = int(self.column("shard")[part[0]])
        return self.shards.column("uri")[shard].as_py()

    def labels(self) -> np.ndarray | None:
        """Every sample's label, where the driver knows them (image folders: a part is one labelled file);
        None where they are read with the samples (WebDataset, Parquet)."""
        if "label" not in self.parts.column_names or self.num_parts != len(self):
            return None
        return self.column("label")

    def distinct_labels(self) -> int | None:
        """How many distinct labels the samples carry (-1, no label, is not one); None where unknown."""
        labels = self.labels()
        return None if labels is None else int(np.unique(labels[labels >= 0]).size)

    @property
    def nbytes(self) -> int:
        """Bytes the catalog's tables hold."""
        return self.parts.nbytes + self.shards.nbytes + self.starts.nbytes

    @property
    def has_sizes(self) -> bool:
        """Whether the width and height columns are there (see `with_sizes`)."""
        return all(c in self.parts.column_names for c in SIZE_COLUMNS)

    def with_sizes(self) -> Catalog:
        """This catalog with each image's width and height, read from its header now (once: a catalog
        that has them returns itself). The fingerprints stay as they are.

        Only sources whose sample is its image file's bytes (image folders) have sizes;
        any other is a ValueError.
        """
        if self.has_sizes:
            return self
        dims = catalog_sizes(self)
        parts = self.parts.append_column("width", int_array(dims.widths, np.int32)).append_column(
            "height", int_array(dims.heights, np.int32)
        )
        return dataclasses.replace(self, parts=parts, size_errors=dict(dims.errors))


def _ipc_buffer(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _catalog_from_ipc(fields: dict) -> Catalog:
    """Catalog.__reduce__'s other half: the tables read back over the buffers (no copy)."""
    tables = {name: pa.ipc.open_stream(fields[name]).read_all() for name in ("shards", "parts")}
    return Catalog(**{**fields, **tables})


def catalog_sizes(catalog: Catalog) -> HeaderSizes:
    """The sizes of a catalog's images, by sample id, from the headers of their files.

    Only a source whose sample is a whole image file (an image folder: one
    file a part) has them: elsewhere the bytes at a sample's range are not an
    image file on their own (a Parquet column chunk, a compressed tar stream),
    and this is a ValueError.
    """
    if catalog.source.name != "images":
        raise ValueError(
            f"image sizes (needed by aspect_buckets()) can be read for image folders only, "
            f"not for a {catalog.source.name} source ({catalog.root!r})"
        )
    storage, shards = catalog.storage, catalog.shards.to_pydict()
    objects = [
        ObjectInfo(u, s, e) for u, s, e in zip(shards["uri"], shards["size"], shards["etag"], strict=True)
    ]
    shard_of = catalog.column("shard")

    def read(shard: int, length: int | None) -> bytes:
        obj = objects[shard]
        n = obj.size if length is None else min(length, obj.size)
        return storage.read_range(obj.uri, 0, n, etag=obj.etag or None) if n > 0 else b""

    return header_sizes(
        read, shard_of.tolist(), threads=max(8, getattr(storage, "default_io_concurrency", 8))
    )


def make_catalog(
    *,
    root: str,
    storage: Storage,
    source: Source,
    shards: Sequence[ObjectInfo] | pa.Table,
    parts: Mapping[str, Sequence[int] | np.ndarray | pa.Array],
    classes: tuple[str, ...] = (),
    locators: Sequence[str] = (),
    size_errors: Mapping[int, str] | None = None,
) -> Catalog:
    """Build the two tables, the parts' starts and the fingerprints.

    `parts` must hold "shard" (a row of `shards`) and "count" (samples in the
    part, >= 0), then any columns of the source's, in the given order: numpy
    or sequences of ints become int64 columns, Arrow arrays stay as they are.
    Columns named in `locators`, and width and height, enter neither fingerprint.
    `shards` may be a table with string "uri" and "etag" and integer "size"
    columns already (a listing of a million files: no ObjectInfo each).
    """
    table, starts = _parts_table(parts, len(shards))
    shard_table = _shards_table(shards)
    planned = table.drop_columns([c for c in (*SIZE_COLUMNS, *locators) if c in table.column_names])
    fingerprint, samples_fingerprint = fingerprints(planned, shard_table, root)
    return Catalog(
        root=root,
        storage=storage,
        source=source,
        shards=shard_table,
        parts=table,
        classes=tuple(classes),
        fingerprint=fingerprint,
        samples_fingerprint=samples_fingerprint,
        starts=starts,
        size_errors=dict(size_errors or {}),
    )


def _parts_table(
    parts: Mapping[str, Sequence[int] | np.ndarray | pa.Array], num_shards: int
) -> tuple[pa.Table, np.ndarray]:
    """The parts table, checked (its columns of one length, counts >= 0, shards rows of the shards table),
    and the prefix sum of its counts: part p holds the sample ids [starts[p], starts[p+1])."""
    if "shard" not in parts or "count" not in parts:
        raise ValueError(f"catalog parts need 'shard' and 'count' columns, got {list(parts)}")
    # Built from buffers: pa.array would import pandas (see raydl/util/arrow.py), a second of start-up.
    columns = {name: v if isinstance(v, pa.Array) else int_array(v) for name, v in parts.items()}
    n = len(columns["count"])
    bad = {name: len(col) for name, col in columns.items() if len(col) != n}
    if bad:
        raise ValueError(f"catalog parts columns must all have {n} rows; got {bad}")
    table = pa.table(columns)
    counts = int_column(table.column("count"))
    shard_of = int_column(table.column("shard"))
    if n and (counts.min() < 0 or shard_of.min() < 0 or shard_of.max() >= num_shards):
        raise ValueError("catalog parts need counts >= 0 and shards that are rows of the shards table")
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    return table, starts


def _shards_table(shards: Sequence[ObjectInfo] | pa.Table) -> pa.Table:
    """The shards table (uri, size, etag): the given table's columns, or built from the ObjectInfos."""
    if isinstance(shards, pa.Table):
        missing = {"uri", "size", "etag"} - set(shards.column_names)
        if missing:
            raise ValueError(
                f"a catalog's shards table needs uri, size and etag columns; no {sorted(missing)}"
            )
        return shards.select(["uri", "size", "etag"])
    return pa.table(
        {
            "uri": string_array([s.uri for s in shards]),
            "size": int_array([s.size for s in shards]),
            "etag": string_array([s.etag for s in shards]),
        }
    )
