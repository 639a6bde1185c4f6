"""Bad data under each on_error mode, and failures that no mode may hide (local Ray, shared per module)."""
from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import ray

import raydl
from raydl import native
from raydl.config import LoaderConfig
from raydl.describe.transforms import SampleProgram, compile_stages
from raydl.errors import LoaderError, SampleDecodeError
from raydl.execute.loader import Loader

pytestmark = pytest.mark.timeout(180)

# Real broken files from Pillow's test suite (../shared/data/pillow).
PILLOW_BROKEN = ["truncated_jpeg.jpg", "truncated_image.png", "broken_data_stream.png", "broken.png",
                 "junk_jpeg_header.jpg"]


def _pipeline(root):
    return raydl.read_images(str(root)).decode().random_resized_crop(32).random_hflip().normalize("imagenet")


def _bad_folder(tmp_path, shared_data) -> tuple:
    """12 generated images, Pillow's broken files, and real photos cut short or overwritten in the middle."""
    from raydl.demo import make_images

    root = tmp_path / "bad"
    make_images(str(root), 12, classes=2, seed=2, corrupt=0)
    broken = []
    for name in PILLOW_BROKEN:
        if (shared_data / "pillow" / name).exists():
            shutil.copy(shared_data / "pillow" / name, root / "c00" / name)
            broken.append(name)
    for i, photo in enumerate(sorted((shared_data / "photos").glob("*.jpg"))[:2]):
        data = photo.read_bytes()
        cut = data[: len(data) // 3] if i == 0 else data[:2000] + b"\x00" * 4096 + data[6096:]
        (root / "c01" / f"corrupt_{photo.name}").write_bytes(cut)
        broken.append(f"corrupt_{photo.name}")
    return root, broken


def _epoch(it):
    return list(it.iter_batches())


def test_replace_keeps_every_batch_full_and_is_deterministic(ray_local, tmp_path, shared_data):
    """on_error='replace': every batch has batch_size rows, substitutes show in id, are counted, and repeat per run."""
    root, broken = _bad_folder(tmp_path, shared_data)
    runs = []
    for _ in range(2):
        with _pipeline(root).loader(batch_size=4, seed=3, drop_last=True, on_error="replace") as loader:
            it = loader.iterator(0)
            runs.append((_epoch(it), it.stats()))
    (batches, stats), (again, _) = runs
    n = len(raydl.read_images(str(root)))
    assert len(batches) == n // 4 and all(len(b["id"]) == 4 == b["image"].shape[0] for b in batches)
    keys = [k for b in batches for k in b["key"]]
    assert not any(k.rsplit("/", 1)[1] in broken for k in keys)  # ids/keys are the substitutes'
    delivered_broken = sorted(u.rsplit("/", 1)[1] for u in stats.replaced_uris)
    assert stats.samples_replaced == len(delivered_broken) > 0 and set(delivered_broken) <= set(broken)
    assert stats.samples_skipped == 0
    for a, b in zip(batches, again, strict=True):
        np.testing.assert_array_equal(a["id"], b["id"])
        np.testing.assert_array_equal(a["image"], b["image"])
    catalog = raydl.read_images(str(root)).catalog
    for b in batches:  # labels and keys follow the substitute
        rows = catalog.samples(b["id"])
        assert b["key"] == rows.key
        assert b["label"].tolist() == rows.label.tolist()


def test_replace_without_shared_data_on_a_generated_corrupt_file(ray_local, tmp_path):
    """on_error='replace' on the demo's own corrupt file: the batch stays full and the substitute is another sample."""
    from raydl.demo import make_images

    root = tmp_path / "own"
    make_images(str(root), 7, classes=1, seed=5, corrupt=1)
    with _pipeline(root).loader(batch_size=8, shuffle=False, on_error="replace") as loader:
        it = loader.iterator(0)
        (batch,) = _epoch(it)
    assert len(batch["id"]) == 8 == batch["image"].shape[0] and it.stats().samples_replaced == 1
    assert "c00/corrupt0.jpg" not in batch["key"] and it.stats().replaced_uris[0].endswith("corrupt0.jpg")


def test_all_bad_batch_under_skip_is_empty_with_shape_and_warning(ray_local, tmp_path, caplog):
    """on_error='skip': a batch whose every sample fails comes out with 0 rows, the right dtype/shape, and a warning."""
    from raydl.demo import make_images

    root = tmp_path / "allbad"
    make_images(str(root), 4, classes=1, seed=6, corrupt=4)  # sorted: the 4 images, then corrupt0..3
    caplog.set_level(logging.WARNING, logger="raydl")
    with _pipeline(root).loader(batch_size=4, shuffle=False) as loader:
        it = loader.iterator(0)
        full, empty = _epoch(it)
    assert empty["image"].shape == (0, 3, 32, 32) and empty["image"].dtype == np.float32
    assert empty["id"].dtype == np.int64 and empty["label"].dtype == np.int64 and empty["key"] == []
    assert full["image"].shape == (4, 3, 32, 32)
    assert it.stats().samples_skipped == 4
    assert any("has no rows" in r.getMessage() for r in caplog.records)


@dataclass(frozen=True)
class _KernelFault(SampleProgram):
    """A real program whose second sample asks the native kernel for a box outside the image."""

    fault: str = "kernel"

    def run(self, data: bytes, seed: int, out: np.ndarray) -> None:
        if data[:2] == b"\x89P":  # the PNG files of the folder
            if self.fault == "memory":
                raise MemoryError("cannot allocate the decode buffer")
            src = np.zeros((8, 8, 3), np.uint8)
            native.crop_resize_into(src, (0.0, 0.0, 64.0, 64.0), out, flip=False, scale=None, bias=None)
        super().run(data, seed, out)


@pytest.mark.parametrize("fault,on_error", [("kernel", "skip"), ("kernel", "replace"), ("memory", "skip")])
def test_kernel_error_and_memory_error_are_not_swallowed(ray_local, image_folder, fault, on_error):
    """A NativeKernelError or MemoryError fails the batch as LoaderError naming the sample and worker, in any mode."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
        base = compile_stages(ds.stages)
        program = _KernelFault(base.stages, base.out_size, base.normalize, fault=fault)
        loader = Loader(ds.catalog, program, LoaderConfig(batch_size=64, on_error=on_error, shuffle=False))
        with loader:
            with pytest.raises(LoaderError) as info:
                _epoch(loader.iterator(0))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    msg = str(info.value)
    assert ("NativeKernelError" if fault == "kernel" else "MemoryError") in msg
    assert "sample " in msg and ".png" in msg and "loader worker " in msg
    assert not isinstance(info.value, SampleDecodeError)


def test_messages_show_no_object_reprs(ray_local, tmp_path, shared_data):
    """A file Pillow cannot identify is named without `<_io.BytesIO object at 0x…>` in the reason."""
    root, broken = _bad_folder(tmp_path, shared_data)
    if "broken.png" not in broken:
        pytest.skip("broken.png is not in ../shared/data/pillow")
    with _pipeline(root).loader(batch_size=64, shuffle=False) as loader:
        it = loader.iterator(0)
        _epoch(it)
    with _pipeline(root).loader(batch_size=64, shuffle=False, on_error="raise") as loader:
        with pytest.raises(SampleDecodeError) as info:
            _epoch(loader.iterator(0))
    assert " object at 0x" not in str(info.value)
    assert it.stats().samples_skipped == len(broken)


def _laion_shard(path, missing_caption: int) -> str:
    """8 LAION-style samples (jpg, txt, cls) written with webdataset's TarWriter; one has no .txt member."""
    import io

    import webdataset as wds
    from PIL import Image

    with wds.TarWriter(str(path), encoder=False) as sink:
        for i in range(8):
            buf = io.BytesIO()
            Image.new("RGB", (20, 16), (30 * i, 90, 150)).save(buf, "JPEG")
            sample = {"__key__": f"k{i}", "jpg": buf.getvalue(), "txt": f"a photo of {i}".encode(), "cls": b"%d" % i}
            if i == missing_caption:
                del sample["txt"]
            sink.write(sample)
    return str(path)


def test_a_sample_lacking_a_selected_field_is_skipped_replaced_or_raised(ray_local, tmp_path):
    """fields={"image": "jpg", "caption": "txt"} over a shard whose sample k3 has no .txt: the default "skip"
    finishes the epoch without it (it stopped training with a DataSourceError, as a failed read); "replace"
    keeps batches full; "raise" stops with MissingFieldError naming the sample, the field and the shard."""
    from raydl.errors import DataSourceError, MissingFieldError

    shard = _laion_shard(tmp_path / "laion.tar", missing_caption=3)
    ds = raydl.read_webdataset(shard, fields={"image": "jpg", "caption": "txt"}).decode().resize((8, 8))
    with ds.loader(batch_size=3, shuffle=False) as loader:
        it = loader.iterator(0)
        batches = _epoch(it)
    keys = [k for b in batches for k in b["key"]]
    assert keys == [f"k{i}" for i in range(8) if i != 3] and [len(b["key"]) for b in batches] == [3, 2, 2]
    assert [c for b in batches for c in b["caption"]] == [f"a photo of {i}" for i in range(8) if i != 3]
    assert it.stats().samples_skipped == 1 and it.stats().skipped_uris == [f"{shard}#k3"]
    with ds.loader(batch_size=3, shuffle=False, on_error="replace") as loader:
        it = loader.iterator(0)
        batches = _epoch(it)
    assert [len(b["key"]) for b in batches] == [3, 3, 2] and "k3" not in [k for b in batches for k in b["key"]]
    assert it.stats().samples_replaced == 1
    with ds.loader(batch_size=3, shuffle=False, on_error="raise") as loader:
        with pytest.raises(MissingFieldError) as info:
            _epoch(loader.iterator(0))
    assert isinstance(info.value, DataSourceError) and str(info.value) == (
        f"rank 0: batch 1 of epoch 0: incomplete sample 3 ({shard}#k3): {shard}: sample 'k3' lacks the field "
        "'caption' (no .txt member)")


def test_a_batch_that_fails_inside_a_task_of_several_is_named_and_those_before_it_arrive(ray_local, tmp_path):
    """Small batches go to a worker several to a task: a batch that fails in the middle of one is the error
    of that batch, named by its own index, after every batch before it has arrived."""
    from PIL import Image

    root = tmp_path / "imgs" / "c"
    root.mkdir(parents=True)
    for i in range(12):  # sample 5 (batch 2 at batch_size 2) is the one PNG, which _KernelFault fails on
        Image.new("RGB", (12, 10), (20 * i, 90, 150)).save(root / f"img_{i:02d}.{'png' if i == 5 else 'jpg'}")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ds = raydl.read_images(str(tmp_path / "imgs")).decode().center_crop(8)
        base = compile_stages(ds.stages)
        program = _KernelFault(base.stages, base.out_size, base.normalize, fault="memory")
        loader = Loader(ds.catalog, program, LoaderConfig(batch_size=2, shuffle=False, prefetch_batches=4))
        with loader:
            loader.refresh()  # the workers are up: no batch is made in this process
            assert loader.memory()["batches_per_task"] > 1
            got = []
            with pytest.raises(LoaderError) as info:
                for batch in loader.iterator(0).iter_batches():
                    got.append(batch["id"].tolist())
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert got == [[0, 1], [2, 3]]
    assert str(info.value).startswith("rank 0: batch 2 of epoch 0") and "MemoryError" in str(info.value)
