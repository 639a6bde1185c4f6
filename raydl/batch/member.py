"""One member of a dataset as a batch maker reads it: where its samples are, how each is read, decoded into
its slots of the batch and put through the user's Python stages. No Ray.

Error policy: a sample whose bytes cannot be read (DataSourceError) or decoded (DecodeError), or that lacks
a field its source selects (MissingFieldError), is this sample's fault, and the on_error policy
(raydl/plan/failures.py) decides what becomes of it. Anything else raised while making a sample (a
NativeKernelError, a MemoryError, a bug in a user's function) fails the whole batch as a LoaderError
naming the sample and the process: no mode hides it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from raydl.batch.pools import Pools
from raydl.batch.spec import WorkerSpec
from raydl.describe.catalog import Catalog
from raydl.describe.records import Pad, decoded_fields, pad_record, stage_rng, wants_rng
from raydl.errors import DataSourceError, DecodeError, LoaderError
from raydl.plan.failures import Failure
from raydl.plan.order import substitute_id
from raydl.plan.tasks import BatchTask, batch_rows
from raydl.storage.base import ObjectInfo
from raydl.storage.cache import with_node_cache
from raydl.util.arrow import StringColumn, int_column

__all__ = ["MAX_SUBSTITUTES", "MemberReader"]

MAX_SUBSTITUTES = 8  # tries per failed sample under on_error="replace" before the batch fails


class MemberReader:
    """One member's samples (its catalog, source and storage), read and decoded on `pools`; `name` names the
    process in errors."""

    def __init__(self, spec: WorkerSpec, catalog: Catalog, pools: Pools, name: str) -> None:
        # Every read of the catalog's store (the sources' footers and index blocks too) goes through the node
        # cache where one applies; a batch's own reads get counters of their own (raydl/batch/run.py).
        storage = with_node_cache(catalog.storage, spec.cache)
        if storage is not catalog.storage:
            catalog = dataclasses.replace(catalog, storage=storage)
        self.spec, self.catalog, self.pools, self.name = spec, catalog, pools, name
        self.source, self.storage = catalog.source, catalog.storage
        self.num_samples = len(catalog)
        self.image_fields = [f for f in self.source.fields if f.kind == "image"]
        self.decoded = decoded_fields(spec.program, self.source.fields)  # (field, is_mask), decoded
        # a batch is read whole by the source (`read_batch`): always for a source that reads batches; for one
        # that also can, where nothing runs per sample (no decode, no per-sample stage)
        self.reads_batches = self.source.reads_batches or (
            self.source.reads_plain_batches and not self.decoded and not spec.sample_stages
        )
        self._shard_uris = StringColumn(catalog.shards.column("uri"))
        self._shard_etags = StringColumn(catalog.shards.column("etag"))
        self._shard_sizes = int_column(catalog.shards.column("size"))

    def outputs(self, bucket: tuple[int, int] | None) -> list[tuple[str, bool, np.dtype, tuple[int, ...]]]:
        """(field, is_mask, dtype, one sample's shape) of each image field the program decodes."""
        program = self.spec.program
        out = []
        for name, is_mask in self.decoded:
            dtype = np.dtype(np.uint8) if is_mask else program.dtype
            slot = program.slot_shape(bucket, mask=True) if is_mask else program.slot_shape(bucket)
            out.append((name, is_mask, dtype, tuple(slot)))
        return out

    def shard_infos(self, shard_ids: np.ndarray) -> list[ObjectInfo]:
        return [
            ObjectInfo(self._shard_uris[i], int(self._shard_sizes[i]), self._shard_etags[i])
            for i in shard_ids.tolist()
        ]

    def read_sample(
        self, sid: int, seed: int, slots: dict[str, np.ndarray]
    ) -> tuple[Failure | None, str, dict]:
        """Locate, read and decode one sample on its own (a substitute) into `slots` (its decoded image
        fields' slots): (a Failure when its bytes are at fault, else None; its key; its other fields'
        values)."""
        loc = self.source.locate(self.catalog, np.array([sid], np.int64))
        (info,) = self.shard_infos(loc.shard[:1])
        key = loc.key[0]
        uri = self.source.sample_uri(info.uri, key)
        if 0 in loc.errors:
            return Failure.source_failed(sid, info.uri, uri, loc.errors[0]), key, {}
        if self.source.range_is_sample:
            size = int((loc.size if loc.size is not None else loc.length)[0])
            big = self.too_big(sid, uri, size)
            if big is not None:
                return big, key, {}
        try:
            data = self.source.read_block(self.storage, info, int(loc.offset[0]), int(loc.length[0]))
            record = self.source.cut(loc, 0, data)
        except DataSourceError as exc:
            return Failure.source_failed(sid, info.uri, uri, exc), key, {}
        except DecodeError as exc:
            return Failure.decode_failed(sid, uri, exc, worker=self.name), key, {}
        big = self.too_big(sid, uri, self.image_bytes(record))
        if big is not None:
            return big, key, {}
        ((failure, values),) = self.make_samples([(sid, uri, record, seed, slots)])
        return failure, key, values

    def image_bytes(self, record: dict) -> int:
        """The bytes of a record's encoded images (what max_sample_bytes bounds)."""
        return sum(len(record[f.name]) for f in self.image_fields if isinstance(record.get(f.name), bytes))

    def too_big(self, sid: int, uri: str, size: int) -> Failure | None:
        """A Failure (under on_error, as a decode error) when the sample is over max_sample_bytes."""
        limit = self.spec.max_sample_bytes
        if size <= limit:
            return None
        error = DecodeError(f"{uri} is {size} bytes, more than max_sample_bytes ({limit}); it is not decoded")
        return Failure.decode_failed(sid, uri, error, worker=self.name)

    def make_samples(
        self, items: list[tuple[int, str, dict, int, dict[str, np.ndarray]]]
    ) -> list[tuple[Failure | None, dict]]:
        """Decode each (id, uri, record, seed, slots) sample's image fields into its slots, in one native call
        for the JPEGs, then run the per-sample Python stages: per sample (a Failure when its bytes are at
        fault, else None; its record without the decoded fields, or the whole record the Python stages
        returned).

        A Python stage that raises fails the whole batch (a LoaderError naming the sample and this worker,
        with the traceback): it is a bug, not bad data, so on_error never covers it. So does any error of
        the native stages that is not a DecodeError.
        """
        program, decoded = self.spec.program, self.decoded
        errors: list[Exception | None] = [None] * len(items)
        if decoded:
            runs, owners, masks = [], [], []
            for k, (_sid, _uri, record, seed, slots) in enumerate(items):
                try:
                    ref = program.image_size(record[decoded[0][0]]) if len(decoded) > 1 else None
                except Exception as exc:  # noqa: BLE001 - settled below as the sample's (a DecodeError) or not
                    errors[k] = exc
                    continue
                for name, is_mask in decoded:
                    if is_mask:
                        masks.append((k, record[name], seed, slots[name], ref))
                    else:
                        runs.append(
                            (record[name], seed, slots[name])
                            if ref is None
                            else (record[name], seed, slots[name], ref)
                        )
                        owners.append(k)
            for k, err in zip(owners, program.run_many(runs) if runs else [], strict=True):
                if err is not None and errors[k] is None:
                    errors[k] = err
            for k, data, seed, out, ref in masks:
                if errors[k] is None:
                    try:
                        program.run_mask(data, seed, out, ref)
                    except Exception as exc:  # noqa: BLE001 - settled below
                        errors[k] = exc
        out: list[tuple[Failure | None, dict]] = []
        for k, (sid, uri, record, seed, slots) in enumerate(items):
            if errors[k] is not None:
                out.append((Failure.decode_failed(sid, uri, errors[k], worker=self.name), {}))
                continue
            values = {f: v for f, v in record.items() if f not in slots}
            if self.spec.sample_stages:
                values = self._python_stages({**values, **slots}, seed, sid, uri)
            out.append((None, values))
        return out

    def _python_stages(self, record: dict, seed: int, sid: int, uri: str) -> dict:
        """The user's map and pad stages on one sample's record (its decoded images are views of its
        slots)."""
        for index, st in enumerate(self.spec.sample_stages):
            try:
                if isinstance(st, Pad):
                    record = pad_record(st, record)
                    continue
                fn = st.fn
                got = fn(record, rng=stage_rng(index, [seed])) if wants_rng(fn) else fn(record)
            except Exception as exc:
                raise _user_error(
                    f"{_stage_call(st)} raised on sample {sid} ({uri})", self.name, exc
                ) from exc
            if not isinstance(got, dict):
                raise LoaderError(
                    f"loader worker {self.name}: {_stage_call(st)} returned {type(got).__name__} for sample "
                    f"{sid} ({uri}), not a dict of fields"
                )
            record = got
        return record

    def batch_stages(self, batch: dict, task: BatchTask) -> dict:
        """The user's map_batches stages on the finished numpy batch; id and key are kept where the function
        left them out and the batch kept its rows."""
        for index, st in enumerate(self.spec.batch_stages, start=len(self.spec.sample_stages)):
            where = f"batch {task.index} of rank {task.rank}, epoch {task.epoch}"
            try:
                got = st.fn(batch, rng=stage_rng(index, task.seeds)) if wants_rng(st.fn) else st.fn(batch)
            except Exception as exc:
                raise _user_error(f"{_stage_call(st)} raised on {where}", self.name, exc) from exc
            if not isinstance(got, dict):
                raise LoaderError(
                    f"loader worker {self.name}: {_stage_call(st)} returned {type(got).__name__} for "
                    f"{where}, not a dict of columns"
                )
            rows = batch_rows(batch)
            for own in ("id", "key"):
                if own not in got and all(len(v) == rows for v in got.values() if hasattr(v, "__len__")):
                    got[own] = batch[own]
            batch = got
        return batch

    def substitute(self, failure: Failure, seed: int, slots: dict[str, np.ndarray]) -> tuple[int, str, dict]:
        """on_error="replace": the first of the slot's substitutes (a pure function of its seed) that
        decodes: (its id, key, values)."""
        tried = []
        for attempt in range(MAX_SUBSTITUTES):
            sub = substitute_id(seed, attempt, self.num_samples)
            if sub == failure.sample_id:
                continue
            tried.append(sub)
            bad, key, values = self.read_sample(sub, seed, slots)
            if bad is None:
                return sub, key, values
        raise self.spec.policy.no_substitute(failure, tried)


def _stage_call(stage) -> str:
    fn = getattr(stage, "fn", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f".{stage.method}({name})"


def _user_error(what: str, worker: str, exc: BaseException) -> LoaderError:
    """A LoaderError for an exception of the user's function, with its traceback (which crosses Ray as
    text: the exception itself may not pickle)."""
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return LoaderError(
        f"loader worker {worker}: {what}: {type(exc).__name__}: {exc} (a bug in the function, not bad data: "
        f"on_error does not cover it)\n{tb}"
    )
