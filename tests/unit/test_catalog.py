"""read_images lists an image folder into the catalog: ids, keys, labels, sizes, fingerprint, and its errors."""
from __future__ import annotations

import os
import shutil

import pytest

from raydl import read_images
from raydl.errors import DataSourceError
from raydl.sources.images import IMAGE_EXTENSIONS, list_image_folder

pytestmark = pytest.mark.timeout(60)


def touch(path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def tree(tmp_path):
    """root/{dog,cat,bird}/... with nested folders, mixed extensions and non-image files (contents are not decoded)."""
    root = tmp_path / "root"
    touch(root / "dog" / "b.jpg", b"12345")
    touch(root / "dog" / "a.JPEG", b"1")
    touch(root / "cat" / "z.png", b"123")
    touch(root / "cat" / "deep" / "er" / "y.webp", b"12")
    touch(root / "cat" / "notes.txt", b"not an image")
    touch(root / "bird" / "x.bmp", b"1234")
    touch(root / "bird" / "x.gif", b"gif is not listed")
    touch(root / "empty_class" / "README", b"no images here")
    return root


def columns(ds):
    loc = ds.catalog.samples()
    return loc.key, loc.label.tolist(), loc.length.tolist()


def test_keys_labels_and_sizes(tree):
    """Keys sorted, recursive, image extensions only (any case); labels index the sorted top-level folders."""
    ds = read_images(str(tree))
    keys, labels, sizes = columns(ds)
    assert keys == ["bird/x.bmp", "cat/deep/er/y.webp", "cat/z.png", "dog/a.JPEG", "dog/b.jpg"]
    assert ds.catalog.classes == ("bird", "cat", "dog")  # folders without images are no class
    assert labels == [0, 1, 1, 2, 2]
    assert sizes == [4, 2, 3, 1, 5]
    assert len(ds) == len(ds.catalog) == 5
    assert ds.catalog.parts.column_names == ["shard", "count", "label"]  # no header read, keys not stored twice
    assert ds.catalog.parts.column("shard").to_pylist() == [0, 1, 2, 3, 4]  # one object per image
    assert set(ds.catalog.samples().offset.tolist()) == {0}


def test_sample_ids_are_rows_and_uris_name_files(tree):
    """Sample id i is row i; the catalog maps it back to its file under root, which the storage reads."""
    ds = read_images(tree)  # a Path works as well as a str
    keys, _, sizes = columns(ds)
    for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
        assert ds.catalog.uri(i) == os.path.join(str(tree), key)
        assert os.path.getsize(ds.catalog.uri(i)) == size
    assert ds.catalog.storage.read_range(ds.catalog.uri(4), 0, 5) == b"12345"


def test_labels_none_gives_minus_one_and_allows_loose_files(tree):
    """labels=None: every label is -1, no classes, and images directly in root are fine."""
    touch(tree / "loose.jpg")
    ds = read_images(str(tree), labels=None)
    keys, labels, _ = columns(ds)
    assert "loose.jpg" in keys
    assert set(labels) == {-1} and ds.catalog.classes == ()


def test_only_image_extensions_are_listed(tmp_path):
    """Exactly .jpg/.jpeg/.png/.webp/.bmp (any case) are samples; other files are ignored."""
    assert IMAGE_EXTENSIONS == (".jpg", ".jpeg", ".png", ".webp", ".bmp")
    for name in ("a.jpg", "b.JPG", "c.jpeg", "d.png", "e.webp", "f.bmp", "g.gif", "h.tiff", "i.jpg.txt", "jpg"):
        touch(tmp_path / "c" / name)
    keys, _, _ = columns(read_images(str(tmp_path)))
    assert keys == ["c/a.jpg", "c/b.JPG", "c/c.jpeg", "c/d.png", "c/e.webp", "c/f.bmp"]


@pytest.mark.parametrize("kind", ["missing", "empty", "file", "no-images"])
def test_bad_roots_raise_data_source_error_naming_the_root(tmp_path, kind):
    """A missing root, an empty one, a file given as root, or a root without images: DataSourceError naming it."""
    root = tmp_path / "data"
    if kind == "empty":
        root.mkdir()
    elif kind == "file":
        touch(root)
    elif kind == "no-images":
        touch(root / "c" / "notes.txt")
    with pytest.raises(DataSourceError) as info:
        read_images(str(root))
    assert str(root) in str(info.value)
    assert info.value.uri == str(root)


def test_loose_image_with_folder_labels_names_the_file(tree):
    """labels='folder' with an image directly in root: DataSourceError naming that file."""
    touch(tree / "stray.png")
    with pytest.raises(DataSourceError, match="stray.png") as info:
        read_images(str(tree))
    assert info.value.uri == os.path.join(str(tree), "stray.png")


def test_bad_labels_argument(tree):
    """labels other than 'folder' or None is a ValueError."""
    with pytest.raises(ValueError, match="labels"):
        list_image_folder(str(tree), labels="filename")


def test_fingerprint_is_stable_and_content_sensitive(tree, tmp_path):
    """Same listing, same fingerprint (also from a copy elsewhere); a new, resized, renamed or moved file changes it."""
    fp = read_images(str(tree)).catalog.fingerprint
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert read_images(str(tree)).catalog.fingerprint == fp
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy)
    assert read_images(str(copy)).catalog.fingerprint == fp

    seen = {fp}

    def changed(step):
        step()
        new = read_images(str(copy)).catalog.fingerprint
        assert new not in seen
        seen.add(new)

    changed(lambda: touch(copy / "dog" / "c.jpg"))  # a new file
    changed(lambda: touch(copy / "dog" / "c.jpg", b"longer"))  # a size change
    changed(lambda: os.rename(copy / "dog" / "c.jpg", copy / "dog" / "d.jpg"))  # a rename
    changed(lambda: os.rename(copy / "dog" / "d.jpg", copy / "cat" / "d.jpg"))  # another label
    assert read_images(str(copy), labels=None).catalog.fingerprint not in seen  # labels are content too


def test_etags_enter_the_fingerprint_but_not_the_shuffle_seed(tree):
    """The same files with other etags (an S3 copy) keep samples_fingerprint (same order) but not fingerprint."""
    import dataclasses

    from raydl.describe.catalog import make_catalog
    from raydl.storage import ObjectInfo

    cat = read_images(str(tree)).catalog
    n = len(cat)
    args = dict(root=cat.root, storage=cat.storage, source=cat.source,
                parts={"shard": range(n), "count": [1] * n, "label": cat.samples().label},
                classes=cat.classes)
    infos = [ObjectInfo(u, s) for u, s in zip(cat.shards.column("uri").to_pylist(), cat.shards.column("size").to_pylist(), strict=True)]
    same = make_catalog(shards=infos, **args)
    tagged = make_catalog(shards=[dataclasses.replace(o, etag=f"e{i}") for i, o in enumerate(infos)], **args)
    assert same.fingerprint == cat.fingerprint
    assert tagged.fingerprint != cat.fingerprint
    assert tagged.samples_fingerprint == cat.samples_fingerprint


def test_sizes_are_read_on_demand_and_change_no_fingerprint(tmp_path):
    """with_sizes() reads each header into width/height (-1 and a reason where unreadable); both fingerprints,
    hence the shuffle order and resume states, are the same with and without the sizes."""
    from PIL import Image

    (tmp_path / "a").mkdir()
    Image.new("RGB", (40, 30)).save(tmp_path / "a" / "wide.jpg")
    Image.new("RGB", (20, 50)).save(tmp_path / "a" / "tall.png")
    touch(tmp_path / "a" / "zbroken.jpg", b"not an image")
    cat = read_images(str(tmp_path)).catalog
    assert not cat.has_sizes and not cat.size_errors
    sized = cat.with_sizes()
    assert sized.has_sizes and sized.with_sizes() is sized
    assert sized.parts.column("width").to_pylist() == [20, 40, -1]  # tall.png, wide.jpg, zbroken.jpg
    assert sized.parts.column("height").to_pylist() == [50, 30, -1]
    assert list(sized.size_errors) == [2] and "header" in sized.size_errors[2]
    assert (sized.fingerprint, sized.samples_fingerprint) == (cat.fingerprint, cat.samples_fingerprint)
    ds = read_images(str(tmp_path)).decode().aspect_buckets(64, multiple=16)  # the stage that needs them
    assert ds.catalog.has_sizes and ds.catalog.fingerprint == cat.fingerprint


def test_sizes_of_a_source_without_image_files_are_a_value_error(tmp_path):
    """Only image folders have sizes: asking a catalog of another source is a ValueError naming the source."""
    import dataclasses

    from raydl.sources.webdataset import WebDatasetSource

    (tmp_path / "a").mkdir()
    touch(tmp_path / "a" / "x.jpg")
    cat = dataclasses.replace(read_images(str(tmp_path)).catalog, source=WebDatasetSource())
    with pytest.raises(ValueError, match="webdataset"):
        cat.with_sizes()


def test_a_catalog_pickles_its_tables_as_arrow_buffers_out_of_band(tree):
    """Pickled (as Ray puts it in the object store) a catalog's tables go as Arrow IPC buffers handed over
    out of band, never as tables for Ray's own Arrow serializer (which imports pandas), and come back
    equal, sizes and all."""
    import pickle

    import numpy as np
    import pyarrow as pa

    catalog = read_images(str(tree)).catalog.with_sizes()  # the files are no images: size_errors too
    _rebuild, (fields,) = catalog.__reduce__()
    assert isinstance(fields["parts"], pa.Buffer) and isinstance(fields["shards"], pa.Buffer)
    assert not any(isinstance(v, pa.Table) for v in fields.values())
    buffers = []
    data = pickle.dumps(catalog, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) >= 2  # the two tables' bytes, outside the pickle
    back = pickle.loads(data, buffers=buffers)
    assert back == catalog and back.parts.equals(catalog.parts) and back.shards.equals(catalog.shards)
    assert back.parts.schema == catalog.parts.schema and np.array_equal(back.starts, catalog.starts)
    assert back.size_errors == catalog.size_errors and len(back) == len(catalog)
