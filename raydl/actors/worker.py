"""LoaderWorker: the Ray face of a BatchMaker (raydl/batch/maker.py), one actor of a loader's pool.

A plain class: raydl/actors/launch.py applies `ray.remote`, its options and its placement. What it adds to
the maker is what only an actor needs: saying where it runs (`ready`), and carrying the coordinator's worker
list version on every batch, so that a rank holding an older list asks the coordinator for the new one. Its
batches go into Ray's object store as they are; a reader on the same node maps them without a copy.
"""

from __future__ import annotations

import os
import sys

from raydl.batch.maker import BatchMaker
from raydl.batch.spec import MixtureSpec, WorkerSpec
from raydl.plan.tasks import BatchResult, BatchTask
from raydl.util.memory import arrow_pool_for_decoding

__all__ = ["BatchResult", "BatchTask", "LoaderWorker", "MixtureSpec", "WorkerSpec"]


class LoaderWorker(BatchMaker):
    """Runs batch tasks for any rank; between tasks it keeps only its threads and its batch buffers."""

    _membership = 0  # the coordinator's worker-list version as this worker last heard it

    def __init__(self, *args, **kwargs) -> None:
        arrow_pool_for_decoding()  # this process is the worker's: its Parquet decodes choose the allocator
        super().__init__(*args, **kwargs)

    def set_membership(self, version: int) -> None:
        """The coordinator's worker list changed (a worker joined, died or was replaced)."""
        self._membership = max(self._membership, version)

    def ready(self) -> dict:
        """Where this worker runs; the loader calls it to know the worker is up."""
        import ray

        return {
            "name": self.name,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "threads": self.pools.threads,
            "io_concurrency": self.pools.io.concurrency,
            "torch_imported": "torch" in sys.modules,
            "pandas_imported": "pandas" in sys.modules,
        }

    def run_batch(self, task: BatchTask) -> BatchResult:
        """Make the batch `task` names, stamped with the worker list version this worker knows."""
        result = super().run_batch(task)
        result.membership = self._membership
        return result

    def run_batches(self, tasks: list[BatchTask]) -> list[BatchResult]:
        """Make several consecutive batches of one rank in one task, which go into the object store as one
        object: Ray's cost per task and per object is paid once for all of them. A batch that raises ends
        the task: the batches before it come back, and the rank asks for that one again on its own (so
        its error names it); the first one's error is the task's."""
        results = []
        for task in tasks:
            try:
                results.append(self.run_batch(task))
            except Exception:
                if not results:
                    raise
                break
        return results
