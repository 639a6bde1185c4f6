"""What a process needs to make batches, besides the catalogs (which come through the object store)."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from raydl.describe.transforms import SampleProgram
from raydl.options import Cache
from raydl.plan.failures import ErrorPolicy

__all__ = ["MixtureSpec", "WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """How one member's samples become batch rows, and the settings of the process that makes them."""

    program: SampleProgram | None  # None: no .decode(); image fields come out as their bytes
    threads: int | None = None
    policy: ErrorPolicy = ErrorPolicy()  # what becomes of a failed sample (built once, from on_error)
    io_concurrency: int | None = None  # None: the storage's default
    max_sample_bytes: int = 256 << 20  # LoaderConfig.max_sample_bytes
    sample_stages: tuple = ()  # the user's per-sample Python stages (map, pad), after the native ones
    batch_stages: tuple = ()  # the user's map_batches stages, on the finished numpy batch
    cache: Cache | None = None  # LoaderConfig.cache: remote reads go through this node's cache
    #: on_error as a string, for callers that have no ErrorPolicy: it sets `policy`
    on_error: InitVar[str | None] = None

    def __post_init__(self, on_error: str | None) -> None:
        if on_error is not None:
            object.__setattr__(self, "policy", ErrorPolicy(on_error))


@dataclass(frozen=True)
class MixtureSpec:
    """The members of a dataset as a batch maker needs them: a WorkerSpec each, their names, where each
    member's ids start in a task's ids (raydl/plan/orders.py, `id_offsets`), and whether batches name each
    row's member (batch["source"], a mix)."""

    members: tuple[WorkerSpec, ...]
    names: tuple[str, ...]
    id_offsets: tuple[int, ...]
    labelled: bool = True

    def __post_init__(self) -> None:
        if not (len(self.members) == len(self.names) == len(self.id_offsets) - 1) or not self.members:
            raise ValueError("MixtureSpec: one spec and one name per member, and one more id offset")

    @classmethod
    def one(cls, spec: WorkerSpec, num_samples: int) -> MixtureSpec:
        """One dataset read as it is."""
        return cls((spec,), ("0",), (0, num_samples), labelled=False)

    @property
    def single(self) -> bool:
        """One member, no source label: a task's rows are that member's, as they are."""
        return len(self.members) == 1 and not self.labelled
