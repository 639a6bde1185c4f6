"""Plain actor classes; Ray wiring is applied where they are started (raydl/loader.py)."""
from raydl.actors.loader_worker import BatchResult, BatchTask, LoaderWorker, WorkerSpec

__all__ = ["BatchResult", "BatchTask", "LoaderWorker", "WorkerSpec"]
