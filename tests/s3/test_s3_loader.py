"""The loader reading from the moto server on a local Ray: the same batches as from disk, and S3 failures named."""
from __future__ import annotations

import numpy as np
import pytest

import raydl
from conftest import upload_folder
from raydl.errors import DataSourceError

pytestmark = pytest.mark.timeout(180)


def _pipeline(ds):
    return ds.decode().random_resized_crop(24).random_hflip().normalize("imagenet")


def test_same_ids_labels_and_pixels_from_s3_as_from_disk(ray_s3, moto_server, bucket, image_folder):
    """An image folder read from s3:// gives batch for batch the ids, keys, labels and pixels of the local copy."""
    upload_folder(bucket, image_folder, "imgs")
    s3 = raydl.S3Options(endpoint_url=moto_server, max_concurrency=8)
    remote = raydl.read_images(f"s3://{bucket}/imgs", s3=s3)
    local = raydl.read_images(str(image_folder))
    assert remote.catalog.table.select(["key", "label", "length"]) == local.catalog.table.select(
        ["key", "label", "length"])
    with _pipeline(remote).loader(batch_size=16, seed=5) as a, _pipeline(local).loader(batch_size=16, seed=5) as b:
        ea, eb = list(a.iterator(0).iter_batches()), list(b.iterator(0).iter_batches())
    assert len(ea) == len(eb) == 4
    for x, y in zip(ea, eb):
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
