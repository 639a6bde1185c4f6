"""The user's Python stages (`map`, `map_batches`, `pad`), and the pipeline they end.

They run in the loader's workers after the native stages (decode, crops,
normalize): `map` and `pad` on each sample's record (a dict of its fields),
`map_batches` on the numpy batch. A function whose signature takes `rng` gets a
numpy Generator seeded from the sample's augmentation seed (the batch's seeds
for `map_batches`), so random transforms are as reproducible as the native
ones and resume exactly. A Python function holds the GIL while it runs: the
workers' processes (`num_workers` per node), not their threads, scale it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from raydl.describe.transforms import SampleProgram, Stage, check_stage_order, compile_stages
from raydl.options import is_positive_int

__all__ = [
    "Map",
    "MapBatches",
    "Pad",
    "Pipeline",
    "check_pipeline_order",
    "compile_pipeline",
    "decoded_fields",
    "pad_record",
    "stage_rng",
    "wants_rng",
]


@dataclass(frozen=True)
class Map(Stage):
    """fn(record) -> record, on each sample in the workers (fn(record, rng=...) gets a seeded Generator)."""

    method: ClassVar[str] = "map"

    fn: Callable[..., dict]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f".map() needs a callable, got {self.fn!r}")


@dataclass(frozen=True)
class MapBatches(Stage):
    """fn(batch) -> batch, on each numpy batch in the workers (fn(batch, rng=...) gets a seeded
    Generator)."""

    method: ClassVar[str] = "map_batches"

    fn: Callable[..., dict]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f".map_batches() needs a callable, got {self.fn!r}")


@dataclass(frozen=True)
class Pad(Stage):
    """Pad (with `value`) or truncate a field to `length` along its first axis; `<field>_length` is how
    many of its values are the sample's own (at most `length`)."""

    method: ClassVar[str] = "pad"

    field: str
    length: int
    value: Any = 0

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise ValueError(f".pad() needs a field name, got {self.field!r}")
        if not is_positive_int(self.length):
            raise ValueError(f".pad() length must be a positive int, got {self.length!r}")
        object.__setattr__(self, "length", int(self.length))


_PYTHON = (Map, MapBatches, Pad)


@dataclass(frozen=True)
class Pipeline:
    """What the workers run: the native program (None without .decode(): image fields stay bytes), then
    the per-sample Python stages (map, pad), then the per-batch ones (map_batches)."""

    program: SampleProgram | None
    sample_stages: tuple[Stage, ...] = ()
    batch_stages: tuple[MapBatches, ...] = ()

    @property
    def functions(self) -> list[Callable]:
        """The user's functions, which must be picklable to reach the workers."""
        return [
            st.fn for st in (*self.sample_stages, *self.batch_stages) if isinstance(st, (Map, MapBatches))
        ]


def decoded_fields(program: SampleProgram | None, fields) -> list[tuple[str, bool]]:
    """(name, is_mask) of each image field of `fields` that `program` decodes (none without a program)."""
    if program is None:
        return []
    return list(program.decoded(tuple(fields)))


def _split(stages: Sequence[Stage]) -> int:
    """Index of the first Python stage (len(stages) when there is none)."""
    return next((i for i, st in enumerate(stages) if isinstance(st, _PYTHON)), len(stages))


def check_pipeline_order(stages: Sequence[Stage]) -> None:
    """The native stages' order rules (check_stage_order), and the Python stages after them all, with
    map/pad before map_batches; a ValueError naming the stage out of place."""
    cut = _split(stages)
    native, python = stages[:cut], stages[cut:]
    if native:
        check_stage_order(native)
    for i, st in enumerate(python):
        if not isinstance(st, _PYTHON):
            raise ValueError(
                f".{st.method}() cannot follow .{python[0].method}(): the native stages (decode, crops, "
                "normalize) come first, then map, pad and map_batches"
            )
        if isinstance(st, (Map, Pad)) and any(isinstance(x, MapBatches) for x in python[:i]):
            raise ValueError(f".{st.method}() cannot follow .map_batches(): per-sample stages come first")


def compile_pipeline(stages: tuple[Stage, ...]) -> Pipeline:
    """Check the order (check_pipeline_order) and compile the native prefix into a SampleProgram."""
    check_pipeline_order(stages)
    cut = _split(stages)
    native, python = stages[:cut], stages[cut:]
    program = compile_stages(native) if native else None
    batch = tuple(st for st in python if isinstance(st, MapBatches))
    return Pipeline(program, tuple(st for st in python if not isinstance(st, MapBatches)), batch)


@functools.lru_cache(maxsize=256)
def _takes_rng(fn: Callable) -> bool:
    try:
        return "rng" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def wants_rng(fn: Callable) -> bool:
    """Whether fn's signature has an `rng` parameter."""
    try:
        return _takes_rng(fn)
    except TypeError:  # unhashable callable
        return "rng" in inspect.signature(fn).parameters


def stage_rng(stage_index: int, seeds: Sequence[int] | np.ndarray) -> np.random.Generator:
    """The Generator of Python stage `stage_index` for a sample's seed (or a batch's seeds): a pure function
    of them, so a resumed or re-run batch draws the same numbers."""
    words = [int(stage_index), *(int(s) & 0xFFFFFFFFFFFFFFFF for s in np.asarray(seeds).reshape(-1))]
    return np.random.default_rng(np.random.SeedSequence(words))


def pad_record(stage: Pad, record: dict) -> dict:
    """`record` with stage.field padded or truncated to stage.length, and `<field>_length` added."""
    if stage.field not in record:
        raise KeyError(
            f".pad({stage.field!r}, ...): the record has no field {stage.field!r}; it has {sorted(record)}"
        )
    value = np.asarray(record[stage.field])
    if value.ndim == 0:
        raise ValueError(f".pad({stage.field!r}, ...): field {stage.field!r} is a scalar, not an array")
    n = min(len(value), stage.length)
    out = np.full((stage.length, *value.shape[1:]), stage.value, dtype=value.dtype)
    out[:n] = value[:n]
    return {**record, stage.field: out, f"{stage.field}_length": n}
