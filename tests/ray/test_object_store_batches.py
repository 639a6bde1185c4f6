"""Batches reach a rank through Ray's object store only: on the worker's node as read-only views of it."""

from __future__ import annotations

import resource

import numpy as np
import pytest
import ray

import raydl

pytestmark = pytest.mark.timeout(240)


def _pipeline(root, size=32):
    return raydl.read_images(str(root)).decode().random_resized_crop(size).random_hflip().normalize("imagenet")


def _object_store_ranges() -> list[tuple[int, int]]:
    """This process's mappings of Ray's object store (plasma's shared-memory file)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "plasma" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi))
    return out


def _in_object_store(array: np.ndarray, ranges: list[tuple[int, int]]) -> bool:
    start = array.__array_interface__["data"][0]
    return any(lo <= start and start + array.nbytes <= hi for lo, hi in ranges)


def test_a_batch_on_the_workers_node_is_a_view_of_the_object_store(ray_local, image_folder):
    """Every batch from a worker on this node lies in this process's mapping of Ray's object store: read-only,
    not owning its memory, no copy; torch tensors on the CPU share the same memory."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install torch==2.13.0)")
    # 8 x 3 x 64 x 64 float32: 384 KiB, past the 100 KiB under which Ray returns a task's result inline
    with _pipeline(image_folder, size=64).loader(batch_size=8, seed=5) as loader:
        loader.refresh()  # every batch from the worker, none made in this process
        it = loader.iterator(0)
        ranges = _object_store_ranges()
        assert ranges, "this process maps no object store"
        seen = 0
        for batch in it.iter_batches():
            image = batch["image"]
            assert not image.flags.writeable and not image.flags.owndata
            assert _in_object_store(image, ranges), hex(image.__array_interface__["data"][0])
            seen += 1
        stats = it.stats()
        assert seen == stats.batches == stats.local_batches and stats.driver_batches == 0
        for batch in it.iter_torch_batches():
            image = batch["image"]
            start = image.data_ptr()
            assert any(lo <= start and start + image.numel() * image.element_size() <= hi for lo, hi in ranges)
            assert image.dtype == torch.float32


@ray.remote(num_cpus=0)
class _CappedRank:
    """A trainer rank whose process may map little more address space than it holds now."""

    def epochs(self, loader, margin: int, epochs: int) -> dict:
        with open("/proc/self/status") as status:
            vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + margin, resource.RLIM_INFINITY))
        try:
            np.ones(2 * margin, np.uint8)  # the cap binds: a new mapping this large fails
            capped = False
        except MemoryError:
            capped = True
        it = loader.iterator(0)
        ids, error = [], None
        try:
            for _ in range(epochs):
                ids.append(sorted(int(i) for batch in it.iter_batches() for i in batch["id"]))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which says what it must be
            error = f"{type(exc).__name__}: {exc}"
        stats = it.stats()
        return {"ids": ids, "error": error, "retries": stats.retries, "local": stats.local_batches, "capped": capped}


def test_a_rank_with_its_address_space_capped_gets_its_batches_and_replaces_no_worker(ray_local, image_folder):
    """A rank whose address space is capped (RLIMIT_AS: ENOMEM for any new mapping) reads three epochs of
    batches of 19 MiB each, several in flight, from the object store it already maps: every sample arrives,
    or a clear LoaderError naming the rank and batch does; no batch is retried and no worker is replaced."""
    with _pipeline(image_folder, size=224).loader(batch_size=32, seed=5, prefetch_batches=4) as loader:
        loader.refresh()
        before = sorted(w.name for w in loader.workers())
        rank = _CappedRank.remote()
        got = ray.get(rank.epochs.remote(loader, 48 << 20, 3), timeout=180)
        ray.kill(rank)
        after = sorted(w.name for w in loader.refresh() or loader.workers())
    assert got["capped"] and got["retries"] == 0, got
    assert before == after, (before, after)
    if got["error"] is None:
        assert got["ids"] == [list(range(61))] * 3 and got["local"] == 6
    else:
        assert got["error"].startswith("LoaderError: rank 0: batch "), got["error"]
