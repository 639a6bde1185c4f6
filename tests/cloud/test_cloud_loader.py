"""The loader reading gs:// (fake-gcs-server) and az:// (azurite) on a local Ray: an image folder, WebDataset
shards written with webdataset's TarWriter and a Parquet file give the ids, labels, fields and pixels they give
from disk; an object rewritten after listing fails the epoch naming it; a warm node cache reads no store."""
from __future__ import annotations

import numpy as np
import pytest

import raydl
from raydl.errors import ObjectChangedError

from s3_util import FaultFront

pytestmark = pytest.mark.timeout(180)

FIELDS = {"image": "jpg;png", "label": "cls", "caption": "txt"}


def _pipeline(ds):
    return ds.decode().random_resized_crop(24).random_hflip().normalize("imagenet")


def _epoch(ds, **kw):
    with _pipeline(ds).loader(batch_size=8, **kw) as loader:
        return list(loader.iterator(0).iter_batches())


def _same(got, want, *, fields=()):
    assert len(got) == len(want) > 0
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["label"], y["label"])
        np.testing.assert_array_equal(x["image"], y["image"])
        assert list(x["key"]) == list(y["key"])
        for f in fields:
            assert x[f].tolist() == y[f].tolist()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """20 images as an image folder, as WebDataset shards of 8 (webdataset's TarWriter: jpg/png, cls, txt) and as
    a Parquet file of row groups of 8."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    from raydl.demo import make_images

    root = tmp_path_factory.mktemp("cloud-data")
    make_images(str(root / "src"), 20, classes=3, seed=7, corrupt=0)
    folder = raydl.read_images(str(root / "src"))
    keys, labels = folder.catalog.samples().key, folder.catalog.samples().label.tolist()
    (root / "wds").mkdir()
    for s in range(0, len(keys), 8):
        with wds.TarWriter(str(root / "wds" / f"shard-{s // 8:03d}.tar")) as sink:
            for key, label in zip(keys[s:s + 8], labels[s:s + 8], strict=True):
                stem, ext = key.rsplit(".", 1)
                sink.write({"__key__": stem, ext: (root / "src" / key).read_bytes(), "cls": label,
                            "txt": f"caption of {stem}"})
    (root / "pq").mkdir()
    pq.write_table(pa.table({"img": [(root / "src" / k).read_bytes() for k in keys], "label": labels,
                             "caption": [f"caption of {k}" for k in keys]}),
                   root / "pq" / "all.parquet", row_group_size=8)
    return root


def _upload(cloud, root):
    for name in ("src", "wds", "pq"):
        cloud.upload_folder(root / name, name)


def test_images_webdataset_and_parquet_read_as_from_disk(ray_cloud, cloud, layouts):
    """Each layout read from the store gives batch for batch the ids, keys, labels, captions and pixels of its local
    copy (shuffled: the same order from the store as from disk)."""
    _upload(cloud, layouts)
    kw = cloud.kw
    pairs = [
        (raydl.read_images(f"{cloud.root}src", **kw), raydl.read_images(str(layouts / "src")), ()),
        (raydl.read_webdataset(f"{cloud.root}wds/shard-{{000..002}}.tar", fields=FIELDS, **kw),
         raydl.read_webdataset(str(layouts / "wds" / "shard-{000..002}.tar"), fields=FIELDS), ("caption",)),
        (raydl.read_parquet(f"{cloud.root}pq/", image_column="img", label_column="label", **kw),
         raydl.read_parquet(str(layouts / "pq" / "all.parquet"), image_column="img", label_column="label"),
         ("caption",)),
    ]
    for remote, local, fields in pairs:
        assert len(remote) == len(local) == 20
        _same(_epoch(remote, seed=4), _epoch(local, seed=4), fields=fields)


def test_object_changed_after_listing_fails_the_epoch_naming_it(ray_cloud, cloud, layouts):
    """An image rewritten after listing (same size, other bytes: a new etag) fails the epoch with
    ObjectChangedError naming its URI, even under on_error='replace'."""
    cloud.upload_folder(layouts / "src", "src")
    ds = raydl.read_images(f"{cloud.root}src", **cloud.kw)
    victim = ds.catalog.uri(3)
    key = victim.split("/", 3)[3]
    cloud.put(key, (layouts / "src" / key.split("/", 1)[1]).read_bytes()[::-1])
    with _pipeline(ds).loader(batch_size=8, shuffle=False, on_error="replace") as loader:
        with pytest.raises(ObjectChangedError) as info:
            list(loader.iterator(0).iter_batches())
    assert victim in str(info.value) and info.value.uri == victim


def test_a_warm_cache_makes_no_request_to_the_store(ray_cloud, cloud, layouts, tmp_path):
    """WebDataset shards: epoch 1 fills the node cache; a new loader's epoch (new worker processes) makes no GET
    and no HEAD at the store and gives the same pixels; the cache's entries are keyed by the store's identity."""
    from raydl.sources import webdataset

    cloud.upload_folder(layouts / "wds", "wds")
    with FaultFront(cloud.server.url, lambda *_: None, upstream_host=True) as front:
        if cloud.scheme == "gs":
            kw = {"gcs": raydl.GCSOptions(endpoint_url=front.url, max_concurrency=4)}
        else:
            cs = cloud.options.connection_string.replace(cloud.server.url, front.url)
            kw = {"azure": raydl.AzureOptions(connection_string=cs, max_concurrency=4)}
        ds = raydl.read_webdataset(f"{cloud.root}wds/shard-{{000..002}}.tar", **kw)
        cache = raydl.Cache(str(tmp_path / "cache"), max_bytes=64 << 20)
        first = _epoch(ds, seed=3, cache=cache)
        warm = len(front.requests)
        webdataset.clear_blocks()
        again = _epoch(ds, seed=3, cache=cache)
        assert len(front.requests) == warm, front.requests[warm:]
    _same(again, first)
    assert ds.catalog.storage.identity.endswith(front.url.lower() + ("" if cloud.scheme == "gs" else "/devstoreaccount1"))
