"""The loader end to end on a local Ray: delivery, determinism, bad input, shutdown."""

from __future__ import annotations

import collections
import os
import shutil
import time

import numpy as np
import pytest
import ray

import raydl
from raydl.errors import DataSourceError, LoaderError, SampleDecodeError

from loader_util import first_batch_ids

pytestmark = pytest.mark.timeout(180)


def _pipeline(root):
    return raydl.read_images(str(root)).decode().random_resized_crop(32).random_hflip().normalize("imagenet")


def _epoch(it):
    return list(it.iter_batches())


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_sample_once_per_epoch(ray_local, image_folder, world_size):
    """Over all ranks an epoch delivers every sample; only pad rows repeat, and ranks get equal batch counts."""
    n = 61
    with _pipeline(image_folder).loader(batch_size=8, world_size=world_size, seed=3) as loader:
        its = [loader.iterator(r) for r in range(world_size)]
        per_rank = [_epoch(it) for it in its]
    assert len({len(b) for b in per_rank}) == 1
    assert all(len(b) == len(it) for b, it in zip(per_rank, its, strict=True))
    ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
    counts = collections.Counter(ids.tolist())
    assert set(counts) == set(range(n))
    pads = len(ids) - n
    assert 0 <= pads < world_size
    assert sum(c - 1 for c in counts.values()) == pads
    for batches in per_rank:
        for b in batches:
            assert b["image"].shape[1:] == (3, 32, 32) and b["image"].dtype == np.float32
            assert b["label"].dtype == np.int64 and b["id"].dtype == np.int64
            assert len(b["key"]) == len(b["id"])


def test_same_seed_same_ids_and_pixels_any_actor_count(ray_local, image_folder):
    """Two loaders with one seed but different actor counts give identical ids and pixels; another epoch reshuffles."""
    with _pipeline(image_folder).loader(batch_size=16, seed=7, num_workers=1) as a:
        ita = a.iterator(0)
        e0a, e1a = _epoch(ita), _epoch(ita)
    with _pipeline(image_folder).loader(batch_size=16, seed=7, num_workers=2, threads_per_worker=1) as b:
        e0b = _epoch(b.iterator(0))
    assert len(e0a) == len(e1a) == 4  # 61 samples in batches of 16
    for x, y in zip(e0a, e0b, strict=True):
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["image"], y["image"])
        assert x["key"] == y["key"]
    order0 = np.concatenate([x["id"] for x in e0a])
    order1 = np.concatenate([x["id"] for x in e1a])
    assert sorted(order0) == sorted(order1) and not np.array_equal(order0, order1)


def test_first_batches_made_in_the_driver_match_the_workers(ray_local, image_folder):
    """The batches the driver makes while the workers start have the workers' ids, keys and pixels."""
    with _pipeline(image_folder).loader(batch_size=16, seed=3) as early:
        it = early.iterator(0)  # the driver's node hosts workers: it makes the first batches itself
        first = _epoch(it)
    assert it.stats().driver_batches >= 1
    with _pipeline(image_folder).loader(batch_size=16, seed=3) as late:
        late.refresh()  # the workers are up: every batch comes from them
        assert late.bootstrap() is None
        it = late.iterator(0)
        later = _epoch(it)
        infos = ray.get([w.handle.ready.remote() for w in late.workers()])
    assert not any(
        i["pandas_imported"] for i in infos
    )  # after making batches: a fast start (raydl/_arrow.py)
    assert it.stats().driver_batches == 0 and len(first) == len(later) == 4  # 61 samples in batches of 16
    for x, y in zip(first, later, strict=True):
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["image"], y["image"])
        assert x["key"] == y["key"]


def test_keys_and_labels_follow_the_catalog(ray_local, image_folder):
    """key is the path under the root and label the index of its sorted class folder."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    with ds.loader(batch_size=64, shuffle=False) as loader:
        (batch,) = _epoch(loader.iterator(0))
    assert batch["image"].dtype == np.uint8 and batch["image"].shape[1:] == (16, 16, 3)
    np.testing.assert_array_equal(batch["id"], np.arange(61))
    classes = sorted({k.split("/")[0] for k in batch["key"]})
    assert [classes.index(k.split("/")[0]) for k in batch["key"]] == batch["label"].tolist()
    assert batch["key"] == sorted(batch["key"])


def _embed(record):
    return {**record, "emb": np.full(16, record["label"], np.float32), "caption": f"label {record['label']}"}


def test_batches_are_zero_copy_views_of_the_object_store(ray_local, image_folder):
    """A batch's image array, and a fixed-shape numeric field a map made, are read-only views of the object
    store, not private copies; a text field is an object array of str."""
    with _pipeline(image_folder).map(_embed).loader(batch_size=8) as loader:
        loader.refresh()  # a worker is up (the very first batches may be made in this process)
        batch = next(loader.iterator(0).iter_batches())
    for name in ("image", "emb"):
        assert not batch[name].flags.writeable and not batch[name].flags.owndata, name
    assert batch["emb"].shape == (8, 16) and np.array_equal(batch["emb"][:, 0], batch["label"])
    assert batch["caption"].dtype == object and batch["caption"][0] == f"label {batch['label'][0]}"


def test_torch_batches(ray_local, image_folder):
    """iter_torch_batches yields tensors (converted dtype where asked) sharing the numpy layout."""
    torch = pytest.importorskip("torch")
    with _pipeline(image_folder).loader(batch_size=8) as loader:
        it = loader.iterator(0)
        batch = next(it.iter_torch_batches(dtypes=torch.float16))
    assert batch["image"].dtype == torch.float16 and tuple(batch["image"].shape) == (8, 3, 32, 32)
    assert batch["label"].dtype == torch.int64 and isinstance(batch["key"], list)


def test_batch_formats_and_collate_fn(ray_local, image_folder):
    """A loader's batches come as pyarrow Tables and pandas DataFrames of the numpy batch's values, through
    collate_fn as it returns them; bad format arguments fail at the call, before any batch is asked for."""
    with _pipeline(image_folder).loader(batch_size=8, shuffle=False) as loader:
        it = loader.iterator(0)
        batch = next(it.iter_batches())
        table = next(it.iter_batches(batch_format="pyarrow"))
        df = next(it.iter_batches(batch_format="pandas"))
        ids = next(it.iter_batches(collate_fn=lambda b: b["id"].tolist()))
        with pytest.raises(ValueError, match="batch_format must be one of"):
            it.iter_batches(batch_format="torch")
        with pytest.raises(ValueError, match="collate_fn cannot be used with dtypes"):
            it.iter_torch_batches(collate_fn=lambda b: b, device="cpu")
    assert table.column_names == list(batch) and table.column("image").type.shape == [3, 32, 32]
    assert all(isinstance(k, str) for k in table.column("key").to_pylist())
    np.testing.assert_array_equal(table.column("id").to_numpy(), np.arange(8, 16))
    assert df["id"].tolist() == list(range(16, 24)) and df["image"][0].shape == (3, 32, 32)
    assert ids == list(range(24, 32)) and batch["id"].tolist() == list(range(8))


def test_cuda_device(ray_local, image_folder):
    """device='cuda' with pin_memory lands batches on the GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    with _pipeline(image_folder).loader(batch_size=8) as loader:
        batch = next(loader.iterator(0).iter_torch_batches(device="cuda", pin_memory=True))
    assert batch["image"].is_cuda


def test_pin_memory_without_cuda_is_a_clear_error(ray_local, image_folder):
    """pin_memory=True without a CUDA device fails with a message saying so."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with _pipeline(image_folder).loader(batch_size=8) as loader:
        with pytest.raises(RuntimeError, match="CUDA"):
            next(loader.iterator(0).iter_torch_batches(pin_memory=True))


def test_break_continues_the_same_epoch(ray_local, image_folder):
    """Leaving iter_batches part-way and calling it again continues that epoch where it stopped."""
    with _pipeline(image_folder).loader(batch_size=8, seed=1) as loader:
        full = np.concatenate([b["id"] for b in _epoch(loader.iterator(0))])
        it = loader.iterator(0)
        first = first_batch_ids([it], 3)
        rest = [b["id"] for b in it.iter_batches()]
    np.testing.assert_array_equal(np.concatenate(first + rest), full)
    assert it.stats().epoch == 1


def _folder_with_broken_files(tmp_path, shared_data):
    """Good generated images plus real broken files from Pillow's test suite."""
    from raydl.demo import make_images

    root = tmp_path / "mixed"
    make_images(str(root), 12, classes=2, seed=2, corrupt=0)
    broken = ["truncated_jpeg.jpg", "truncated_image.png", "broken_data_stream.png"]
    present = [f for f in broken if (shared_data / "pillow" / f).exists()]
    if not present:
        pytest.skip("Pillow's broken test images are not in ../shared/data/pillow")
    for f in present:
        shutil.copy(shared_data / "pillow" / f, root / "c00" / f)
    return root, present


def test_broken_files_are_skipped_and_counted(ray_local, tmp_path, shared_data):
    """on_error='skip': real broken files are left out of their batches, counted, and named."""
    root, broken = _folder_with_broken_files(tmp_path, shared_data)
    with _pipeline(root).loader(batch_size=4, shuffle=False) as loader:
        it = loader.iterator(0)
        batches = _epoch(it)
    stats = it.stats()
    assert stats.samples_skipped == len(broken)
    assert stats.samples_delivered == 12
    assert sorted(u.rsplit("/", 1)[1] for u in stats.skipped_uris) == sorted(broken)
    assert len(batches) == len(it)  # every batch keeps its place, some are shorter
    assert sum(len(b["id"]) for b in batches) == 12


def test_broken_file_raises_naming_it(ray_local, tmp_path, shared_data):
    """on_error='raise': the epoch stops with SampleDecodeError naming the broken file."""
    root, broken = _folder_with_broken_files(tmp_path, shared_data)
    with _pipeline(root).loader(batch_size=4, shuffle=False, on_error="raise") as loader:
        with pytest.raises(SampleDecodeError) as info:
            _epoch(loader.iterator(0))
    assert any(name in str(info.value) for name in broken)
    assert info.value.uri.rsplit("/", 1)[1] in broken


def test_missing_file_is_an_error_naming_it(ray_local, tmp_path):
    """A file listed in the catalog but gone when read is an error naming it, even with on_error='skip'."""
    from raydl.demo import make_images

    root = tmp_path / "vanishing"
    paths = make_images(str(root), 6, classes=2, seed=4, corrupt=0)
    ds = _pipeline(root)
    (root / paths[2].split(str(root) + "/")[1]).unlink()
    with ds.loader(batch_size=3, shuffle=False) as loader:
        # In a worker: this process may still hold the file open from listing (the storage's fd cache),
        # and would make the first batch itself while the workers start.
        loader.refresh()
        with pytest.raises(DataSourceError, match=paths[2].rsplit("/", 1)[1]):
            _epoch(loader.iterator(0))


def test_invalid_arguments_name_the_parameter(ray_local, image_folder):
    """Bad loader/iterator arguments raise ValueError naming the parameter, before any actor starts."""
    ds = _pipeline(image_folder)
    with pytest.raises(ValueError, match="batch_size"):
        ds.loader(batch_size=0)
    with ds.loader(batch_size=8, world_size=2) as loader:
        with pytest.raises(ValueError, match="rank"):
            loader.iterator(2)
        with pytest.raises(ValueError, match="prefetch_batches"):
            loader.iterator(0).iter_batches(prefetch_batches=0)
    with pytest.raises(ValueError, match="shape"):
        raydl.read_images(str(image_folder)).decode().loader(batch_size=4)


def _wait_for_free_cpus(total: float, timeout_s: float = 30.0) -> bool:
    """Ray returns a killed actor's CPUs asynchronously: poll, bounded in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == total:
            return True
        time.sleep(0.1)
    return False


def test_shutdown_frees_the_actors(ray_local, image_folder):
    """shutdown() kills the actors (their CPUs come back), is idempotent, and the iterator then refuses."""
    total = ray.cluster_resources()["CPU"]
    assert _wait_for_free_cpus(total)  # earlier tests' actors are gone
    loader = _pipeline(image_folder).loader(batch_size=8, num_workers=2, cpus_per_worker=1)
    it = loader.iterator(0)
    next(it.iter_batches())
    loader.refresh()  # both workers up (the first batch may have been made before they were)
    assert ray.available_resources().get("CPU", 0) == total - 2
    loader.shutdown()
    loader.shutdown()
    assert _wait_for_free_cpus(total)
    with pytest.raises(LoaderError):
        next(it.iter_batches())


def test_the_coordinator_starts_after_the_workers_or_when_a_call_needs_it(ray_local, image_folder, monkeypatch):
    """The workers serve the loader before its coordinator starts (COORDINATOR_DELAY_S later); shutdown()
    before then kills the workers itself; a call that needs the coordinator (refresh) starts it at once, and
    without one it starts on its own after the delay."""
    import raydl.execute.loader as loader_module

    total = ray.cluster_resources()["CPU"]
    assert _wait_for_free_cpus(total)
    monkeypatch.setattr(loader_module, "COORDINATOR_DELAY_S", 300.0)
    loader = _pipeline(image_folder).loader(batch_size=8, num_workers=2, cpus_per_worker=1, seed=1)
    deadline = time.monotonic() + 60
    while len(loader.workers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(loader.workers()) == 2 and loader._coordinator is None
    batches = _epoch(loader.iterator(0))  # made by the workers the loader started, with no coordinator
    assert sum(len(b["id"]) for b in batches) == 61 and loader._coordinator is None
    assert ray.available_resources().get("CPU", 0) == total - 2
    loader.shutdown()
    assert _wait_for_free_cpus(total) and loader._coordinator is None

    with _pipeline(image_folder).loader(batch_size=8, num_workers=1, seed=1) as loader:
        next(loader.iterator(0).iter_batches())
        loader.refresh()  # needs the coordinator: started now, not 300 s later
        assert loader._coordinator is not None and len(loader.workers()) == 1
        assert ray.get(loader._coordinator.workers.remote())[0] > 0  # it has taken the worker over

    monkeypatch.setattr(loader_module, "COORDINATOR_DELAY_S", 0.5)
    with _pipeline(image_folder).loader(batch_size=8, num_workers=1, seed=1) as loader:
        next(loader.iterator(0).iter_batches())
        deadline = time.monotonic() + 60
        while loader._coordinator is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loader._coordinator is not None
    assert _wait_for_free_cpus(total)


def test_a_killed_actor_is_replaced_and_its_batches_rerun(ray_local, image_folder):
    """Killing a loader actor mid-epoch: its batches run again on a replacement and the epoch is complete."""
    with _pipeline(image_folder).loader(batch_size=8, seed=5, num_workers=1) as loader:
        expected = np.concatenate([b["id"] for b in _epoch(loader.iterator(0))])
        loader.refresh()  # the worker is up
        it = loader.iterator(0)
        got = []
        for i, b in enumerate(it.iter_batches()):
            got.append(b["id"])
            if i == 1:
                ray.kill(loader.workers()[0].handle, no_restart=True)
        assert it.stats().retries >= 1
    np.testing.assert_array_equal(np.concatenate(got), expected)


def test_a_state_loaded_while_an_iteration_is_under_way_is_where_it_goes_on(ray_local, image_folder):
    """load_state_dict() between two batches of a running iter_batches(): that iteration yields the rest of
    the loaded state's epoch (the batches a fresh iterator loaded with it yields) and ends it, so the next
    call starts the epoch after the state's, not the one after the epoch it began in."""
    with raydl.read_images(str(image_folder)).decode().center_crop(8).loader(batch_size=8, seed=2) as loader:
        saved = loader.iterator(0)
        first_batch_ids([saved], 3)
        state = dict(saved.state_dict(), epoch=5)  # epoch 5, 3 batches done
        fresh = loader.iterator(0)
        fresh.load_state_dict(state)
        want = [b["id"] for b in _epoch(fresh)]
        it = loader.iterator(0)
        running = it.iter_batches()
        next(running)  # epoch 0, batch 0
        it.load_state_dict(state)
        got = [b["id"] for b in running]
        assert it.state_dict()["epoch"] == 6 and it.state_dict()["batches_done"] == 0
        assert len(_epoch(it)) == 8  # the epoch after: a whole one
    assert len(got) == len(want) == 8 - 3  # 61 samples in batches of 8: 8 batches
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_dict_resumes_the_epoch_exactly(ray_local, image_folder):
    """A fresh iterator loaded with a mid-epoch state yields the same batches (ids and pixels) as an uninterrupted run,
    also when the resuming loader's catalog has the image sizes read (with_sizes) and the first one's had not."""
    import json

    with _pipeline(image_folder).loader(batch_size=8, seed=11) as loader:
        it = loader.iterator(0)
        _epoch(it)  # epoch 0
        ref_it = loader.iterator(0)
        _epoch(ref_it)
        reference = _epoch(ref_it)  # epoch 1, uninterrupted
        first_batch_ids([it], 3)
        state = json.loads(json.dumps(it.state_dict()))
    first = _pipeline(image_folder)
    assert not first.catalog.has_sizes  # listing reads no header
    sized = raydl.Dataset(first.catalog.with_sizes(), first.stages)
    with sized.loader(batch_size=8, seed=11) as loader2:
        resumed = loader2.iterator(0)
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
    assert state["epoch"] == 1 and state["batches_done"] == 3
    assert len(rest) == len(reference) - 3
    for a, b in zip(rest, reference[3:], strict=True):
        np.testing.assert_array_equal(a["id"], b["id"])
        np.testing.assert_array_equal(a["image"], b["image"])


def test_elastic_resume_two_to_three_ranks(ray_local, image_folder):
    """A state taken at 2 ranks and loaded at 3: together the epoch has every sample, none repeated but pad rows."""
    with _pipeline(image_folder).loader(batch_size=4, world_size=2, seed=2, drop_last=True) as loader:
        its = [loader.iterator(r) for r in range(2)]
        seen = first_batch_ids(its, 3)
        state = its[0].state_dict()
    with _pipeline(image_folder).loader(batch_size=4, world_size=3, seed=2, drop_last=True) as loader3:
        its3 = [loader3.iterator(r) for r in range(3)]
        for it in its3:
            it.load_state_dict(state)
            seen += [b["id"] for b in _epoch(it)]
    ids = np.concatenate(seen)
    assert len(ids) == len(set(ids.tolist()))  # drop_last: no sample twice
    assert 61 - len(ids) < 4 * 3  # only the incomplete last round is dropped


def test_resume_refuses_another_seed(ray_local, image_folder):
    """Loading a state into a loader with another seed is a clear ValueError."""
    with _pipeline(image_folder).loader(batch_size=8, seed=1) as loader:
        state = loader.iterator(0).state_dict()
    with _pipeline(image_folder).loader(batch_size=8, seed=2) as loader:
        with pytest.raises(ValueError, match="seed"):
            loader.iterator(0).load_state_dict(state)


def test_shards_are_indexed_as_ray_tasks_when_ray_is_up(ray_local, tmp_path, monkeypatch):
    """With Ray up and enough shards, listing indexes them as Ray tasks (each writing its node's cache); the
    catalog and the batches are those of a listing on threads, and a second listing reads no shard."""
    import io

    import webdataset as wds
    from PIL import Image

    import raydl.sources.webdataset as wsrc
    from raydl.sources import _wds_index

    for s in range(3):
        with wds.TarWriter(str(tmp_path / f"shard-{s}.tar")) as sink:
            for i in range(4):
                buf = io.BytesIO()
                Image.new("RGB", (16, 12), (40 * s, 20 * i, 90)).save(buf, "JPEG")
                sink.write({"__key__": f"s{s}/{i:03d}", "jpg": buf.getvalue(), "cls": str(s * 4 + i)})
    pattern = str(tmp_path / "shard-{0..2}.tar")
    monkeypatch.setattr(wsrc, "_RAY_MIN_SHARDS", 1)
    # No shard is read in this process: the Ray tasks (other processes) build the blocks, then the cache serves.
    monkeypatch.setattr(
        _wds_index, "build_block", lambda *a, **k: pytest.fail("a shard was read in the driver")
    )
    on_ray = raydl.read_webdataset(pattern)
    assert len(os.listdir(os.path.join(os.environ["RAYDL_CACHE_DIR"], "wds-index"))) >= 3
    cached = raydl.read_webdataset(pattern)
    assert cached.catalog.fingerprint == on_ray.catalog.fingerprint and len(on_ray) == 12
    with on_ray.decode().resize((8, 8)).loader(batch_size=12, shuffle=False) as loader:
        (batch,) = loader.iterator(0).iter_batches()
    assert batch["key"] == [f"s{s}/{i:03d}" for s in range(3) for i in range(4)]
    assert batch["label"].tolist() == list(range(12))


def _mix_folder(tmp_path, n, seed):
    from raydl.demo import make_images

    make_images(str(tmp_path), n, classes=2, seed=seed, corrupt=0)
    return str(tmp_path)


def test_a_mix_is_deterministic_resumes_exactly_and_refuses_other_weights(ray_local, image_folder, tmp_path):
    """Two loaders of one stratified mix give the same rows and pixels; a mid-epoch state resumes the exact rest;
    a loader with other weights refuses it, naming them; every batch holds each source's share within one."""
    import json

    small = _mix_folder(tmp_path, 10, 1)
    parts = {"a": _pipeline(image_folder), "b": _pipeline(small)}
    mixed = raydl.mix(parts, weights={"a": 0.75, "b": 0.25}, epoch_size=70)
    with mixed.loader(batch_size=8, seed=2) as one, mixed.loader(batch_size=8, seed=2) as two:
        ref, again = _epoch(one.iterator(0)), _epoch(two.iterator(0))
        it = one.iterator(0)
        first_batch_ids([it], 3)
        state = json.loads(json.dumps(it.state_dict()))
        resumed = two.iterator(0)
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
    assert sum(len(b["id"]) for b in ref) == 70
    for a, b in zip(ref, again, strict=True):
        for col in ("id", "source", "image", "label"):
            np.testing.assert_array_equal(a[col], b[col])
        counts = collections.Counter(a["source"].tolist())
        assert abs(counts["a"] - 0.75 * len(a["id"])) < 1 and abs(counts["b"] - 0.25 * len(a["id"])) < 1
    b_rows = collections.Counter(int(i) for b in ref for s, i in zip(b["source"], b["id"], strict=True) if s == "b")
    assert set(b_rows) == set(range(10)) and set(b_rows.values()) <= {1, 2}  # 18 of 10: once or twice
    assert len(rest) == len(ref) - 3
    for a, b in zip(rest, ref[3:], strict=True):
        np.testing.assert_array_equal(a["image"], b["image"])
        assert a["source"].tolist() == b["source"].tolist()
    other = raydl.mix(parts, weights={"a": 0.5, "b": 0.5}, epoch_size=70)
    with other.loader(batch_size=8, seed=2) as loader:
        with pytest.raises(ValueError, match=r"weights changed: the state has \{'a': 0.75, 'b': 0.25\}"):
            loader.iterator(0).load_state_dict(state)


def test_a_parquet_table_read_whole_is_read_by_the_workers_alone_with_each_row_once(ray_local, tmp_path):
    """A shuffled Parquet table of token rows (read whole, the next window's row groups decoded ahead) gives
    every row once an epoch on two ranks, as its own row, and the Loader's process makes none of its
    batches (the workers would decode its row groups again)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = np.arange(300)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(rows, 8).astype(np.int32)), 8)
    pq.write_table(pa.table({"input_ids": tokens}), tmp_path / "t.parquet", row_group_size=20)
    ds = raydl.read_parquet(str(tmp_path / "t.parquet"), columns=["input_ids"])
    assert not ds.catalog.source.bootstraps
    with ds.loader(batch_size=16, seed=5, world_size=2, shuffle_window=3) as loader:
        assert loader.plan.read_ahead > 0
        seen = []
        for rank in range(2):
            it = loader.iterator(rank)
            for batch in _epoch(it):
                assert (batch["input_ids"] == batch["id"][:, None]).all()  # row r holds the tokens r
                seen.extend(batch["id"].tolist())
            assert it.stats().driver_batches == 0
    assert sorted(set(seen)) == rows.tolist() and len(seen) - len(set(seen)) < 32  # only pad rows repeat


def test_per_source_mixes_shapes_and_weighted_parquet_draws_its_column(ray_local, image_folder, tmp_path):
    """per_source batching mixes sources of different image sizes, a batch from one source each; with_weights on a
    Parquet column draws only positive-weight rows, in proportion."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    small = _mix_folder(tmp_path / "s", 10, 2)
    mixed = raydl.mix(
        {"a": _pipeline(image_folder), "b": raydl.read_images(small).decode().center_crop(16)},
        weights={"a": 1, "b": 1},
        batching="per_source",
        epoch_size=40,
    )
    with mixed.loader(batch_size=5, seed=1) as loader:
        batches = _epoch(loader.iterator(0))
    shapes = {(b["source"][0], b["image"].shape[1:]) for b in batches}
    assert shapes == {("a", (3, 32, 32)), ("b", (16, 16, 3))}
    assert all(len(set(b["source"].tolist())) == 1 for b in batches) and len(batches) == 8
    path = tmp_path / "w.parquet"
    pq.write_table(
        pa.table({"x": np.arange(40), "w": [0.0] * 30 + [1.0] * 9 + [9.0]}), path, row_group_size=16
    )
    ds = raydl.read_parquet(str(path)).with_weights("w", epoch_size=900)
    with ds.loader(batch_size=100, seed=3) as loader:
        drawn = np.concatenate([b["x"] for b in _epoch(loader.iterator(0))])
    counts = np.bincount(drawn, minlength=40)
    assert counts[:30].sum() == 0 and len(drawn) == 900
    assert 400 < counts[39] < 500  # weight 9 of 18: about 450 of 900
