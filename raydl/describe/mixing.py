"""What a Dataset describes: a mixture of one or more members, mixed by weight (`raydl.mix`) or drawn by
per-sample weights (`Dataset.with_weights`), or one dataset read as it is.

A Mixture names its members (each a catalog, its own pipeline and maybe
per-sample weights), their weights, the epoch size and the batching. It checks
here, before any actor starts, that the members' batches can be put together:
under "stratified" batching every member must give the same fields with the
same dtypes and shapes; under "per_source" the same field names. A member
with a Python stage (map, map_batches) is checked by what it gives at run
time instead (the workers raise a LoaderError naming the members and the
field). What each epoch draws from each member is raydl/plan/mix.py's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from raydl.describe.catalog import Catalog
from raydl.describe.records import Map, MapBatches, Pipeline, decoded_fields

__all__ = [
    "BATCHINGS",
    "Member",
    "Mixture",
    "check_sample_weights",
    "output_signature",
    "weights_digest",
]

BATCHINGS = ("stratified", "per_source")


def check_sample_weights(weights, num_samples: int, what: str) -> np.ndarray:
    """`weights` as float64, one per sample, finite, >= 0 and not all zero: else a ValueError naming `what`
    and the first bad index."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: weights must be numbers, one per sample: {exc}") from exc
    if w.ndim != 1 or len(w) != num_samples:
        raise ValueError(
            f"{what}: {w.size if w.ndim else 'a scalar'} weights for {num_samples} samples; give one a sample"
        )
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}: weight {i} is {weights[i]!r}; weights must be finite and >= 0")
    if not w.any():
        raise ValueError(f"{what}: every weight is 0; at least one sample needs a positive weight")
    return w


def weights_digest(weights: np.ndarray | None) -> str | None:
    """A short digest of per-sample weights (what a resume state records of them)."""
    if weights is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(weights, dtype=np.float64).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Member:
    """One dataset of a mix: its name, catalog, pipeline, and per-sample weights (None: none)."""

    name: str
    catalog: Catalog
    pipeline: Pipeline
    weights: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.weights is not None:
            object.__setattr__(
                self,
                "weights",
                check_sample_weights(self.weights, len(self.catalog), f"source {self.name!r}"),
            )


@dataclass(frozen=True)
class Mixture:
    """Members mixed by weight into epochs of `epoch_size` samples, batched "stratified" or "per_source".

    `labelled`: batches carry batch["source"] (a mix; not a lone weighted dataset). A mixture of one
    member without weights or label is one dataset read as it is (`single`).
    """

    members: tuple[Member, ...]
    weights: tuple[float, ...]
    epoch_size: int
    batching: str = "stratified"
    labelled: bool = True

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("mix() needs at least one dataset")
        if self.batching not in BATCHINGS:
            raise ValueError(f"mix(): batching must be one of {list(BATCHINGS)}, got {self.batching!r}")
        if len(self.weights) != len(self.members):
            raise ValueError("mix(): one weight per dataset")
        for m, w in zip(self.members, self.weights, strict=True):
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
                raise ValueError(f"mix(): the weight of {m.name!r} is {w!r}; weights must be finite and >= 0")
        if not any(self.weights):
            raise ValueError(f"mix(): every weight is 0 ({dict(zip(self.names, self.weights, strict=True))})")
        if not isinstance(self.epoch_size, int) or isinstance(self.epoch_size, bool) or self.epoch_size < 1:
            raise ValueError(f"mix(): epoch_size must be a positive int, got {self.epoch_size!r}")
        if not self.single:
            self._check_outputs()

    @classmethod
    def one(cls, catalog: Catalog, pipeline: Pipeline) -> Mixture:
        """One dataset read as it is: its samples in its own order, every epoch all of them."""
        return cls((Member("0", catalog, pipeline),), (1.0,), len(catalog), labelled=False)

    @property
    def single(self) -> bool:
        """One dataset read as it is (no draw by weight, no source label): its plan is the dataset's own."""
        return len(self.members) == 1 and not self.labelled and self.members[0].weights is None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def state(self) -> dict:
        """What a resume state records of the mix (a state must match it to load)."""
        return {
            "sources": list(self.names),
            "weights": [float(w) for w in self.weights],
            "epoch_size": self.epoch_size,
            "batching": self.batching,
            "sample_weights": [weights_digest(m.weights) for m in self.members],
            "fingerprints": [m.catalog.fingerprint for m in self.members],
        }

    def _check_buckets(self) -> None:
        """Bucketed datasets mix only with datasets of the same buckets, per_source (a batch holds one
        bucket of one dataset); a ValueError naming the dataset otherwise."""
        sets = [(m, _bucket_set(m)) for m in self.members]
        bucketed = [(m, b) for m, b in sets if b is not None]
        if not bucketed:
            return
        if len(bucketed) < len(sets):
            plain = next(m for m, b in sets if b is None)
            raise ValueError(
                f"mix(): {bucketed[0][0].name!r} has aspect_buckets() and {plain.name!r} has not; bucketed "
                "datasets mix only with bucketed ones"
            )
        first, ref = bucketed[0]
        for m, b in bucketed[1:]:
            if b != ref:
                raise ValueError(
                    f"mix(): {m.name!r} and {first.name!r} have different aspect buckets; give them the same "
                    "aspect_buckets(...) arguments"
                )
        if self.batching != "per_source":
            raise ValueError(
                "mix(): bucketed datasets mix with batching='per_source' (each batch one bucket of one "
                "dataset); stratified batches of several buckets cannot be bucket-pure"
            )

    def _check_outputs(self) -> None:
        """Every member's batches have the first one's fields (and, stratified, dtypes and shapes); a
        ValueError naming the member and the field otherwise. Members with map/map_batches are left to the
        run-time check."""
        self._check_buckets()
        if self.batching == "stratified":  # the decoded images make the batch's buffer: they must agree
            layouts = [(m, _image_layout(m)) for m in self.members]
            (first, ref) = layouts[0]
            for m, got in layouts[1:]:
                if got != ref:
                    raise ValueError(
                        f"mix(): source {m.name!r} decodes {_images(got)}, source {first.name!r} "
                        f"{_images(ref)}; stratified batches stack them, so they must agree (decode them "
                        "to the same size and dtype, or use batching='per_source')"
                    )
        known = [(m, output_signature(m)) for m in self.members]
        known = [(m, sig) for m, sig in known if sig is not None]
        if len(known) < 2:
            return
        (first, ref), rest = known[0], known[1:]
        for m, sig in rest:
            missing, extra = sorted(set(ref) - set(sig)), sorted(set(sig) - set(ref))
            if missing or extra:
                raise ValueError(
                    f"mix(): source {m.name!r} gives fields {sorted(sig)}, source {first.name!r} gives "
                    f"{sorted(ref)}: {m.name!r} lacks {missing} and adds {extra}; every source must give the "
                    "same fields"
                )
            if self.batching == "per_source":
                continue
            for name in ref:
                if sig[name] != ref[name]:
                    raise ValueError(
                        f"mix(): field {name!r} of source {m.name!r} is {_describe(sig[name])}, of source "
                        f"{first.name!r} {_describe(ref[name])}; stratified batches stack them, so they must "
                        "agree (decode them to the same size and dtype, or use batching='per_source')"
                    )


def _bucket_set(member: Member):
    program = member.pipeline.program
    return None if program is None or program.buckets is None else program.buckets.buckets


def _image_layout(member: Member) -> tuple:
    """(name, is_mask, dtype, shape per sample) of each image field the member decodes, in order."""
    program = member.pipeline.program
    out = []
    for name, is_mask in decoded_fields(program, member.catalog.source.fields):
        shape = None if program.buckets is not None else tuple(program.slot_shape(None, mask=is_mask))
        out.append((name, is_mask, "uint8" if is_mask else str(program.dtype), shape))
    return tuple(out)


def _images(layout: tuple) -> str:
    return ", ".join(f"{n} {d} {s}" for n, _m, d, s in layout) or "no image"


def _describe(sig: tuple) -> str:
    kind, dtype, shape = sig
    return f"{kind} {dtype}" + ("" if shape is None else f" {tuple(shape)}")


def output_signature(member: Member) -> dict[str, tuple] | None:
    """field -> (kind, dtype, shape per sample or None) of a member's batches; None when a Python stage
    makes them (known only at run time)."""
    pipeline, source = member.pipeline, member.catalog.source
    if any(isinstance(st, (Map, MapBatches)) for st in (*pipeline.sample_stages, *pipeline.batch_stages)):
        return None
    program = pipeline.program
    decoded = dict(decoded_fields(program, source.fields))
    out: dict[str, tuple] = {}
    for f in source.fields:
        if f.name in decoded:
            if program.buckets is not None:
                out[f.name] = ("image", "uint8" if decoded[f.name] else str(program.dtype), None)
                continue
            shape = program.slot_shape(None, mask=decoded[f.name])
            out[f.name] = (
                "mask" if decoded[f.name] else "image",
                "uint8" if decoded[f.name] else str(program.dtype),
                tuple(shape),
            )
        else:
            out[f.name] = (
                f.kind if f.kind != "image" else "bytes",
                None if f.dtype is None else str(f.dtype),
                None,
            )
    for st in pipeline.sample_stages:  # pad: the padded field's shape, and its _length
        if getattr(st, "method", "") == "pad":
            kind, dtype, _ = out.get(st.field, ("array", None, None))
            out[st.field] = ("array", dtype, (st.length,))
            out[f"{st.field}_length"] = ("value", "int64", None)
    return out
