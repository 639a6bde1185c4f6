"""A batch of several members: its task's rows split by member, each member's rows made into its rows of the
one batch buffer, and the members' results joined. No Ray.

A mixed task's ids are encoded (raydl/plan/mix.py): id_offsets[s] + the sample's id in member s. The rows
are split by member, keeping the members in order and each member's rows in task order, and every member's
rows are made at once. An image field of the joined batch is the whole buffer's array when no row failed
(no copy); other columns are concatenated. batch["id"] is each row's id in its own member, and
batch["source"] its member's name.
"""

from __future__ import annotations

import numpy as np

from raydl.batch.spec import MixtureSpec
from raydl.errors import LoaderError
from raydl.plan.tasks import BatchResult, BatchTask, batch_rows

__all__ = ["Mixing"]


class Mixing:
    """Splits a mixture's tasks by member and joins the members' results (`spec.names[s]` names member s)."""

    def __init__(self, spec: MixtureSpec) -> None:
        self.spec = spec
        self._offsets = np.asarray(spec.id_offsets, np.int64)

    def split(self, task: BatchTask) -> list[tuple[int, np.ndarray]]:
        """(member, the task's rows of that member, in task order) for each member the task has rows of,
        in member order."""
        source = np.searchsorted(self._offsets, task.ids, side="right") - 1
        if task.ids.size and (source.min() < 0 or task.ids.max() >= self._offsets[-1]):
            raise LoaderError(f"batch {task.index} of rank {task.rank}: ids outside the mix's sources")
        return [(int(s), np.flatnonzero(source == s)) for s in np.unique(source).tolist()]

    def layout_member(self, task: BatchTask, outputs) -> int:
        """The member whose decoded image fields give the batch's layout (`outputs(member, bucket)` lists
        them): the member of every row when there is one (per_source batches, whose members' shapes may
        differ), else the first, after checking that every member of the batch decodes the same images (a
        LoaderError naming them otherwise)."""
        groups = self.split(task)
        if len(groups) == 1:
            return groups[0][0]
        first = outputs(0, task.bucket)
        for s, _rows in groups:
            got = outputs(s, task.bucket)
            if got != first:
                raise LoaderError(
                    f"batch {task.index} of rank {task.rank}, epoch {task.epoch}: source "
                    f"{self.spec.names[s]!r} decodes {_layout(got)}, source {self.spec.names[0]!r} "
                    f"{_layout(first)}; stratified batches stack them, so they must agree"
                )
        return 0

    def run(self, task: BatchTask, images: dict[str, np.ndarray], members: list, run_members) -> BatchResult:
        """The mixed batch: each member's rows made by `members[s]` into its rows of `images`, then joined.

        `run_members(list of (member, task, images))` makes the members' rows at once and returns their
        results.
        """
        groups = self.split(task)
        jobs, at = [], 0
        for s, rows in groups:
            sub = BatchTask(
                rank=task.rank,
                epoch=task.epoch,
                index=task.index,
                ids=task.ids[rows] - self._offsets[s],
                seeds=task.seeds[rows],
                bucket=task.bucket,
            )
            views = {name: arr[at : at + len(rows)] for name, arr in images.items()}
            jobs.append((members[s], sub, views))
            at += len(rows)
        results = run_members(jobs)
        return self._join(task, [s for s, _ in groups], [j[2] for j in jobs], results, images)

    def _join(self, task, members, views, results: list[BatchResult], images) -> BatchResult:
        names = self.spec.names
        batch: dict = {}
        if results:
            first = results[0].batch
            for s, r in zip(members[1:], results[1:], strict=True):
                if list(r.batch) != list(first):
                    raise LoaderError(
                        f"batch {task.index} of rank {task.rank}, epoch {task.epoch}: source {names[s]!r} "
                        f"gives fields {list(r.batch)}, source {names[members[0]]!r} {list(first)}; a mix's "
                        "sources must give the same fields"
                    )
            for key in first:
                columns = [r.batch[key] for r in results]
                if key == "bucket":
                    batch[key] = columns[0]
                elif key in images and all(c is v[key] for c, v in zip(columns, views, strict=True)):
                    batch[key] = images[key]  # every row decoded: the whole buffer's array, no copy
                elif isinstance(columns[0], np.ndarray):
                    batch[key] = self._concat(task, key, columns, [names[s] for s in members])
                else:
                    batch[key] = [x for c in columns for x in c]
        if self.spec.labelled:
            label = np.empty(sum(batch_rows(r.batch) for r in results), dtype=object)
            at = 0
            for s, r in zip(members, results, strict=True):
                n = batch_rows(r.batch)
                label[at : at + n] = names[s]
                at += n
            batch["source"] = label
        return BatchResult(
            batch=batch,
            skipped=[f for r in results for f in r.skipped],
            unreadable=[f for r in results for f in r.unreadable],
            replaced=[x for r in results for x in r.replaced],
            cache=_summed([r.cache for r in results]),
        )

    @staticmethod
    def _concat(task, key: str, columns: list[np.ndarray], sources: list[str]) -> np.ndarray:
        ref = columns[0]
        for c, src in zip(columns[1:], sources[1:], strict=True):
            if c.dtype != ref.dtype or c.shape[1:] != ref.shape[1:]:
                raise LoaderError(
                    f"batch {task.index} of rank {task.rank}, epoch {task.epoch}: field {key!r} is "
                    f"{c.dtype} {c.shape[1:]} per row from source {src!r} but {ref.dtype} {ref.shape[1:]} "
                    f"from source {sources[0]!r}; stratified batches stack it, so the sources must agree "
                    "(or mix with batching='per_source')"
                )
        return np.concatenate(columns)


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """The members' node cache counters added up ({} when none reads through a cache)."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _layout(outputs) -> str:
    return ", ".join(f"{name} {dtype} {tuple(shape)}" for name, _mask, dtype, shape in outputs) or "no image"
