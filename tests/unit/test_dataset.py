"""Dataset, the lazy description: stage order checked at the call that breaks it, and its repr."""
from __future__ import annotations

import re

import pytest

import raydl
from raydl.bench.shards import write_parquet, write_webdataset
from raydl.demo import make_images

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_images(str(root), 12, classes=3, seed=0, corrupt=0)
    return str(root)


@pytest.mark.parametrize("build, call, needs", [
    (lambda ds: ds.center_crop(64), ".center_crop()", "needs .decode() before it"),
    (lambda ds: ds.random_resized_crop(64), ".random_resized_crop()", "needs .decode() before it"),
    (lambda ds: ds.resize(64), ".resize()", "needs .decode() before it"),
    (lambda ds: ds.random_hflip(), ".random_hflip()", "needs .decode() before it"),
    (lambda ds: ds.normalize(), ".normalize()", "needs .decode() before it"),
    (lambda ds: ds.aspect_buckets(128), ".aspect_buckets()", "needs .decode() before it"),
    (lambda ds: ds.decode().decode(), ".decode()", "only once"),
    (lambda ds: ds.decode().normalize().random_hflip(), ".random_hflip()", "must be the last stage"),
    (lambda ds: ds.decode().normalize().normalize(), ".normalize()", "must be the last stage"),
    (lambda ds: ds.decode().center_crop(64).aspect_buckets(128), ".aspect_buckets()", "replaces the crop"),
    (lambda ds: ds.decode().aspect_buckets(128).resize(64), ".resize()", "replaces the crop"),
    (lambda ds: ds.decode().aspect_buckets(128).aspect_buckets(64), ".aspect_buckets()", "replaces the crop"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_stage_out_of_order_fails_at_its_own_call(folder, build, call, needs):
    """Each order rule of compile_stages fails at the Dataset method that breaks it, naming the stage and what it
    needs, not later at loader()."""
    with pytest.raises(ValueError, match=re.escape(needs)) as err:
        build(raydl.read_images(folder))
    if "only once" not in needs:
        assert call in str(err.value)


def test_aspect_buckets_out_of_order_reads_no_sizes(folder, monkeypatch):
    """.aspect_buckets() after a crop fails before it reads any image header."""
    from raydl.describe.catalog import Catalog

    def no_sizes(self):
        raise AssertionError("sizes read before the order was checked")

    monkeypatch.setattr(Catalog, "with_sizes", no_sizes)
    with pytest.raises(ValueError, match="replaces the crop"):
        raydl.read_images(folder).decode().center_crop(64).aspect_buckets(128)


def test_valid_orders_still_build(folder):
    """The pipelines of the README and the configs build as before, and compile."""
    from raydl.describe.transforms import compile_stages

    ds = raydl.read_images(folder)
    for built in (ds.decode().random_resized_crop(64).random_hflip().normalize(),
                  ds.decode().resize(72).center_crop(64).normalize("imagenet"),
                  ds.decode().aspect_buckets(128, multiple=32).random_hflip()):
        compile_stages(built.stages)


def test_repr_counts_labels_when_the_source_names_no_classes(folder, tmp_path):
    """An image folder's repr counts its class folders; WebDataset and Parquet, whose labels have no names and
    are read with the samples (not at listing), say classes=?; no labels at all is classes=0."""
    assert "classes=3)" in repr(raydl.read_images(folder)).splitlines()[0]
    write_webdataset(folder, str(tmp_path / "wds"), per_shard=5)
    wds = raydl.read_webdataset(str(tmp_path / "wds" / "shard-*.tar"))
    pq = raydl.read_parquet(write_parquet(folder, str(tmp_path / "pq")), image_column="image",
                            label_column="label")
    for ds in (wds, pq):
        head = repr(ds).splitlines()[0]
        assert "samples=12" in head and "classes=?)" in head, head
    unlabelled = raydl.read_parquet(str(tmp_path / "pq"), image_column="image")
    assert "classes=0)" in repr(unlabelled).splitlines()[0]
    assert "classes=0)" in repr(raydl.read_images(folder, labels=None)).splitlines()[0]
