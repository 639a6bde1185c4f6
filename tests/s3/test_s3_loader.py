"""The loader reading from the moto server on a local Ray: the same batches as from disk, and S3 failures named."""
from __future__ import annotations

import numpy as np
import pytest

import raydl
from raydl.errors import DataSourceError

from s3_util import upload_folder

pytestmark = pytest.mark.timeout(180)


def _pipeline(ds):
    return ds.decode().random_resized_crop(24).random_hflip().normalize("imagenet")


def test_same_ids_labels_and_pixels_from_s3_as_from_disk(ray_s3, moto_server, bucket, image_folder):
    """An image folder read from s3:// gives batch for batch the ids, keys, labels and pixels of the local copy."""
    upload_folder(bucket, image_folder, "imgs")
    s3 = raydl.S3Options(endpoint_url=moto_server, max_concurrency=8)
    remote = raydl.read_images(f"s3://{bucket}/imgs", s3=s3)
    local = raydl.read_images(str(image_folder))
    rows = lambda ds: {c: ds.catalog.samples().to_pydict()[c] for c in ("key", "label", "length")}  # noqa: E731
    assert rows(remote) == rows(local)
    with _pipeline(remote).loader(batch_size=16, seed=5) as a, _pipeline(local).loader(batch_size=16, seed=5) as b:
        ea, eb = list(a.iterator(0).iter_batches()), list(b.iterator(0).iter_batches())
    assert len(ea) == len(eb) == 4
    for x, y in zip(ea, eb, strict=True):
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["label"], y["label"])
        np.testing.assert_array_equal(x["image"], y["image"])
        assert x["key"] == y["key"]


def test_key_deleted_after_listing_fails_the_epoch_naming_it(ray_s3, moto_server, s3_client, bucket, image_folder):
    """An object listed but gone when read fails the epoch with a DataSourceError naming s3://bucket/key."""
    upload_folder(bucket, image_folder, "imgs")
    ds = raydl.read_images(f"s3://{bucket}/imgs", s3=raydl.S3Options(endpoint_url=moto_server))
    victim = ds.catalog.uri(7)
    s3_client.delete_object(Bucket=bucket, Key=victim.split("/", 3)[3])
    with _pipeline(ds).loader(batch_size=16, shuffle=False) as loader:
        with pytest.raises(DataSourceError, match="does not exist") as info:
            list(loader.iterator(0).iter_batches())
    assert victim in str(info.value) and info.value.uri == victim


def _folder_as_shards(root, out_dir, per_shard=20):
    """The image folder as WebDataset shards (sorted keys; a .cls per image) and as one Parquet file."""
    import io
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = raydl.read_images(str(root))
    keys = ds.catalog.samples().key
    labels = ds.catalog.samples().label.tolist()
    out_dir.mkdir()
    for s in range(0, len(keys), per_shard):
        with tarfile.open(out_dir / f"shard-{s // per_shard:03d}.tar", "w") as tar:
            for key, label in zip(keys[s:s + per_shard], labels[s:s + per_shard], strict=True):
                stem = key.rsplit(".", 1)[0]
                for name, data in ((key, (root / key).read_bytes()), (stem + ".cls", str(label).encode()),
                                   (stem + ".txt", f"caption of {key}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    table = pa.table({"img": [(root / k).read_bytes() for k in keys], "label": labels,
                      "caption": [f"caption of {k}" for k in keys]})
    pq.write_table(table, out_dir / "all.parquet", row_group_size=16)
    return (len(keys) + per_shard - 1) // per_shard


def _epoch(ds, **kw):
    with _pipeline(ds).loader(batch_size=16, **kw) as loader:
        return list(loader.iterator(0).iter_batches())


def test_webdataset_and_parquet_give_the_image_folders_samples(ray_s3, moto_server, bucket, image_folder, tmp_path):
    """The same images as WebDataset shards (local and on S3) and as Parquet give the folder's labels and pixels;
    the S3 shards and Parquet file give batch for batch what the local ones give, captions (a field) too."""
    n_shards = _folder_as_shards(image_folder, tmp_path / "wds")
    upload_folder(bucket, tmp_path / "wds", "wds")
    s3 = raydl.S3Options(endpoint_url=moto_server, max_concurrency=8)
    pattern = f"shard-{{000..{n_shards - 1:03d}}}.tar"
    folder = raydl.read_images(str(image_folder))
    local = raydl.read_webdataset(str(tmp_path / "wds" / pattern))
    fields = {"image": "jpg;jpeg;png", "label": "cls", "caption": "txt"}
    remote = raydl.read_webdataset(f"s3://{bucket}/wds/{pattern}", s3=s3, fields=fields)
    table = raydl.read_parquet(str(tmp_path / "wds" / "all.parquet"), image_column="img", label_column="label")
    assert local.catalog.samples().key == [
        k.rsplit(".", 1)[0] for k in folder.catalog.samples().key]

    ref = _epoch(folder, shuffle=False, seed=2)
    assert len(ref) == 4 and sum(len(b["id"]) for b in ref) == 61  # 61 samples in batches of 16
    for ds in (local, table):
        for x, y in zip(_epoch(ds, shuffle=False, seed=2), ref, strict=True):
            np.testing.assert_array_equal(x["id"], y["id"])
            np.testing.assert_array_equal(x["label"], y["label"])
            np.testing.assert_array_equal(x["image"], y["image"])
    remote_table = raydl.read_parquet(f"s3://{bucket}/wds/all.parquet", image_column="img", label_column="label",
                                      s3=s3)
    local_fields = raydl.read_webdataset(str(tmp_path / "wds" / pattern), fields=fields)
    for a, b in ((remote, local_fields), (remote_table, table)):  # shuffled: same order from S3 as from disk
        got, want = _epoch(a, seed=9), _epoch(b, seed=9)
        assert len(want) == 4
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x["id"], y["id"])
            np.testing.assert_array_equal(x["label"], y["label"])
            np.testing.assert_array_equal(x["image"], y["image"])
            assert x["key"] == y["key"]
            assert x["caption"].tolist() == y["caption"].tolist()
            assert all(c.startswith("caption of ") for c in x["caption"])


def test_object_changed_after_listing_fails_even_under_replace(ray_s3, moto_server, s3_client, bucket, image_folder):
    """An object rewritten after listing (new etag) fails the epoch with ObjectChangedError naming it; not even
    on_error='replace' hides it, since the data under the loader is no longer what was listed."""
    from raydl.errors import ObjectChangedError

    upload_folder(bucket, image_folder, "imgs")
    ds = raydl.read_images(f"s3://{bucket}/imgs", s3=raydl.S3Options(endpoint_url=moto_server))
    victim = ds.catalog.uri(3)
    key = victim.split("/", 3)[3]
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3_client.put_object(Bucket=bucket, Key=key, Body=body[::-1])  # same size, other bytes
    with _pipeline(ds).loader(batch_size=16, shuffle=False, on_error="replace") as loader:
        with pytest.raises(ObjectChangedError) as info:
            list(loader.iterator(0).iter_batches())
    assert victim in str(info.value) and info.value.uri == victim
