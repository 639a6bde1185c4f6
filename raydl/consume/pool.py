"""WorkerPool: the one seam between a rank's iterator and the workers that make its batches.

The Loader implements it (raydl/execute/loader.py); a benchmark or a test can implement it in a few lines.
An iterator knows the plan (raydl/plan/loader_plan.py) and this; it never imports the Loader.
"""

from __future__ import annotations

from typing import Protocol

from raydl.plan.scheduling import WorkerInfo

__all__ = ["WorkerInfo", "WorkerPool"]


class WorkerPool(Protocol):
    """Where a rank's batches are made."""

    #: object-store bytes that every rank's batches in flight share (bounds the prefetch depth)
    object_store_budget: int

    def runners(self) -> list[WorkerInfo]:
        """Where a batch can go now: the live workers; while none is up, the Loader's own process when it
        makes batches itself (one `in_process` WorkerInfo); else it waits for a worker, and raises a
        LoaderError when none comes."""
        ...

    def sync(self, version: int) -> None:
        """A batch said the workers' list is at `version`: fetch the list when this pool's is older."""
        ...

    def replace(self, dead: WorkerInfo) -> list[WorkerInfo]:
        """`dead` died: have it replaced (once, whoever reports it) and return the workers to use now."""
        ...
