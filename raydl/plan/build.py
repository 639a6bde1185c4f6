"""A LoaderPlan built once from a dataset's description (a Mixture) and the LoaderConfig. Pure: no Ray.

One dataset read as it is gets a SampleOrder (a window of parts at a time for a source that decodes a whole
part to cut one sample out, such as Parquet row groups), or with aspect buckets a BucketOrder; a mix, or a
dataset drawn by per-sample weights, a MixOrder. Samples whose image size could not be read are in no
aspect bucket: they go through the error policy here (under "raise" the first stops the loader) and rank 0
reports them each epoch.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from raydl.describe.catalog import Catalog
from raydl.describe.mixing import Mixture
from raydl.describe.records import decoded_fields
from raydl.describe.transforms import SampleProgram
from raydl.options import LoaderConfig
from raydl.plan.failures import ErrorPolicy, Failure
from raydl.plan.loader_plan import LoaderPlan
from raydl.plan.mix import MixPlan, SourcePlan, mix_shares
from raydl.plan.orders import BucketOrder, MixOrder, Order, SampleOrder
from raydl.util.arrow import int_column

__all__ = ["DEFAULT_PART_WINDOW", "build_plan", "part_window", "sample_unit"]

DEFAULT_PART_WINDOW = 16  # LoaderConfig.shuffle_window's default for Parquet: row groups shuffled together


def build_plan(mixture: Mixture, config: LoaderConfig) -> LoaderPlan:
    """The plan of `mixture` read with `config` (see the module)."""
    policy = ErrorPolicy(config.on_error)
    if mixture.single:
        member = mixture.members[0]
        order, unsized = _one_dataset(member.catalog, member.pipeline.program, config, policy)
        num_samples, fingerprint = len(member.catalog), member.catalog.fingerprint
    else:
        mix, unsized = _mix_plan(mixture, config, policy)
        # what a state records of the mix: also each dataset's shuffle window, which orders its samples
        # (a bucketed dataset's sources are its buckets, each shuffled whole)
        windows = [s.window for s in mix.sources] if mix.buckets is None else [0] * len(mixture.members)
        order = MixOrder(mix, {**mixture.state(), "windows": windows})
        num_samples = mixture.epoch_size
        fingerprint = _combined(m.catalog.fingerprint for m in mixture.members)
    sizes = [_sample_bytes(m.catalog, m.pipeline.program) for m in mixture.members]
    ahead = read_ahead(order, mixture.members[0].catalog, config) if mixture.single else 0
    first = mixture.members[0]
    decoded = decoded_fields(first.pipeline.program, first.catalog.source.fields)
    return LoaderPlan(
        config=config,
        order=order,
        num_samples=num_samples,
        fingerprint=fingerprint,
        policy=policy,
        unsized=unsized,
        batch_bytes=config.batch_size * max(sizes),
        image_fields=tuple(name for name, is_mask in decoded if not is_mask),
        sample_unit=sample_unit(m.catalog.source for m in mixture.members),
        read_ahead=ahead,
    )


def sample_unit(sources) -> str:
    """What one sample of these sources is, for rates: "windows" (token windows), "images" (a source with
    an image field), "rows" (a Parquet table without one), else "samples"; sources of several kinds:
    "samples"."""
    units = set()
    for source in sources:
        if source.name == "tokens":
            units.add("windows")
        elif any(f.kind == "image" for f in source.fields):
            units.add("images")
        elif source.name == "parquet":
            units.add("rows")
        else:
            units.add("samples")
    return units.pop() if len(units) == 1 else "samples"


def read_ahead(order, catalog: Catalog, config: LoaderConfig) -> int:
    """How many batches after its last a task names the samples of, for a source that `reads_ahead`: about
    one shuffle window of positions, dealt to every rank (rank r's batches lie world_size batches apart),
    so that while a rank reads one window its worker decodes the parts of the next. 0 (no hint) for an
    order that is not a shuffle window of parts, or a source that reads nothing ahead."""
    windowed = isinstance(order, SampleOrder) and order.window > 0 and config.shuffle
    if not (windowed and catalog.source.reads_ahead):
        return 0
    counts = order.part_counts
    largest = int(counts.max()) if counts is not None and len(counts) else 0
    return max(1, -(-order.window * largest // (config.batch_size * config.world_size)))


def part_window(catalog: Catalog, config: LoaderConfig) -> int:
    """The parts shuffled together (LoaderConfig.shuffle_window, or its source's default); 0: all."""
    window = config.shuffle_window
    if window is None:
        window = catalog.source.shuffle_window
    if window is None:
        window = 0 if catalog.source.range_is_sample else DEFAULT_PART_WINDOW
    return window if catalog.num_parts < len(catalog) else 0  # one sample a part: global


def _one_dataset(
    catalog: Catalog, program: SampleProgram | None, config: LoaderConfig, policy: ErrorPolicy
) -> tuple[Order, tuple[Failure, ...]]:
    """One dataset's order, and its samples in no aspect bucket.

    Without aspect buckets the plan deals samples; with them it deals whole bucket-pure batches, and
    samples whose header gave no size are in none.
    """
    window = part_window(catalog, config)
    if program is None or program.buckets is None:
        counts = catalog.column("count") if window else None
        return SampleOrder(len(catalog), catalog.samples_fingerprint, window, counts), ()
    catalog = (
        catalog.with_sizes()
    )  # read here when the catalog came without them (a ValueError where none exist)
    buckets = program.buckets.buckets
    bucket_of = program.buckets.assign(catalog.column("width"), catalog.column("height"))
    unsized = _unsized(catalog, bucket_of)
    policy.settle(unsized)  # under "raise", the first of them stops the loader here
    order = BucketOrder(
        bucket_of, tuple(buckets), config.batch_size, config.drop_last, catalog.samples_fingerprint, window
    )
    if order.units == 0:
        raise ValueError(
            f"no aspect bucket holds a full batch of {config.batch_size} (drop_last=True); "
            f"bucket sizes: {np.bincount(bucket_of[bucket_of >= 0], minlength=len(buckets)).tolist()}"
        )
    return order, unsized


def _mix_plan(
    mixture: Mixture, config: LoaderConfig, policy: ErrorPolicy
) -> tuple[MixPlan, tuple[Failure, ...]]:
    """The plan of a mix: each source's samples, fingerprint, window and weights, and its share; and the
    samples of bucketed datasets that are in no bucket (their size unread), reported through on_error.

    Bucketed datasets (all with the same buckets, batched per_source) are mixed a bucket at a time: each
    bucket of each dataset is a source of its own, weighted by the dataset's weight times the bucket's
    share of the dataset (of its samples, or of its per-sample weights), so that batches are bucket-pure
    and their number is fixed before any epoch.
    """
    programs = [m.pipeline.program for m in mixture.members]
    bucketed = programs[0] is not None and programs[0].buckets is not None
    sources, weights, owners, buckets, unsized = [], [], [], [], []
    for i, (m, w) in enumerate(zip(mixture.members, mixture.weights, strict=True)):
        if not bucketed:
            window = part_window(m.catalog, config)
            counts = m.catalog.column("count") if window else None
            sources.append(
                SourcePlan(len(m.catalog), m.catalog.samples_fingerprint, window, counts, weights=m.weights)
            )
            weights.append(w)
            continue
        for source, (mass, total), bucket in _bucket_sources(
            m.catalog.with_sizes(), programs[i], m.weights, unsized
        ):
            sources.append(source)
            weights.append(w * mass / total)
            owners.append(i)
            buckets.append(bucket)
    policy.settle(tuple(unsized))  # under "raise", the first stops the loader here
    shares = tuple(int(x) for x in mix_shares(weights, mixture.epoch_size))
    plan = MixPlan(
        tuple(sources),
        shares,
        mixture.batching,
        config.batch_size,
        config.drop_last,
        owners=tuple(owners) if bucketed else None,
        buckets=tuple(buckets) if bucketed else None,
        dataset_sizes=tuple(len(m.catalog) for m in mixture.members) if bucketed else None,
    )
    return plan, tuple(unsized)


def _bucket_sources(catalog: Catalog, program: SampleProgram, weights: np.ndarray | None, unsized: list):
    """(SourcePlan, (the bucket's weight, the dataset's), bucket (H, W)) of each bucket of one bucketed
    dataset in a mix; its samples in no bucket are added to `unsized`."""
    bucket_list = program.buckets.buckets
    of = program.buckets.assign(catalog.column("width"), catalog.column("height"))
    unsized.extend(_unsized(catalog, of))
    mass = weights if weights is not None else np.ones(len(of))
    total = float(mass[of >= 0].sum()) or 1.0
    for k in np.unique(of[of >= 0]).tolist():
        ids = np.flatnonzero(of == k)
        fp = hashlib.sha256(f"{catalog.samples_fingerprint}:{k}".encode()).hexdigest()
        sub = None if weights is None else weights[ids]
        if sub is not None and not sub.any():
            continue  # no weight in this bucket: never drawn
        yield (
            SourcePlan(len(ids), fp, weights=sub, ids=ids),
            (float(mass[ids].sum()), total),
            tuple(bucket_list[k]),
        )


def _combined(fingerprints) -> str:
    h = hashlib.sha256()
    for fp in fingerprints:
        h.update(fp.encode() + b"\0")
    return h.hexdigest()


def _unsized(catalog: Catalog, bucket_of: np.ndarray) -> tuple[Failure, ...]:
    """A Failure for each sample in no bucket (its header gave no size), for on_error to settle."""
    return tuple(
        Failure.unsized(
            int(i), catalog.uri(int(i)), catalog.size_errors.get(int(i), "no image size in the catalog")
        )
        for i in np.flatnonzero(bucket_of < 0)
    )


def _sample_bytes(catalog: Catalog, program: SampleProgram | None) -> int:
    """About what one sample takes in a batch: its decoded image fields at their largest shape, else (no
    decoded image) its bytes as stored, on average."""
    if catalog.source.sample_bytes:
        return catalog.source.sample_bytes
    decoded = decoded_fields(program, catalog.source.fields)
    if not decoded:
        stored = int(int_column(catalog.shards.column("size")).sum())
        return max(1, stored // max(1, len(catalog)))
    pixels = max(math.prod(s) for s in program.slot_shapes()) // 3  # an image slot holds 3 channels
    return sum(pixels if is_mask else 3 * pixels * program.dtype.itemsize for _name, is_mask in decoded)
