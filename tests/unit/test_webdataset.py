"""WebDataset shards: brace patterns, tar indexing from headers, and grouping identical to the webdataset library."""
from __future__ import annotations

import io
import logging
import os
import tarfile

import numpy as np
import pytest

import raydl
from raydl.errors import DataSourceError
from raydl.sources._braces import expand_braces
from raydl.sources._tar import index_tar
from raydl.sources.webdataset import group_samples

pytestmark = pytest.mark.timeout(120)

AWKWARD = [  # (member name, payload); order matters: grouping is by consecutive keys
    ("a.b.c.jpg", b"jpeg-a"), ("a.b.c.cls", b"3"),
    ("dir.x/img.JPG", b"jpeg-dir"), ("dir.x/img.Cls", b" 7\n"),
    ("README", b"no dot: dropped"),
    ("__meta__", b"skipped"), ("__index__/x.jpg", b"skipped too"),
    ("./dotslash.png", b"png-dotslash"),
    ("with space.jpg", b"jpeg-space"), ("with space.json", b'{"k": 1}'),
    ("x" * 150 + ".jpg", b"jpeg-long-name"),  # longer than the 100-byte ustar name field
    ("ünïcödé/näme.webp", b"webp-unicode"),
    ("k1.jpg", b"jpeg-k1"), ("k2.jpg", b"jpeg-k2"), ("k1.cls", b"1"),  # k1 again, not consecutive: a new sample
    ("empty.jpg", b""), ("empty.cls", b"0"),
    ("onlylabel.cls", b"5"),  # no image field: left out by raydl
    ("big.png", bytes(range(256)) * 300), ("big.cls", b"9"),
]


def write_tar(path, members, *, fmt=tarfile.GNU_FORMAT, extras=True):
    with tarfile.open(path, "w", format=fmt) as tar:
        if extras:
            d = tarfile.TarInfo("somedir")
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if extras:
            link = tarfile.TarInfo("link.jpg")
            link.type = tarfile.SYMTYPE
            link.linkname = "k2.jpg"
            tar.addfile(link)
    return str(path)


def library_samples(path):
    import webdataset as wds

    return [{k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
            for s in wds.WebDataset(str(path), shardshuffle=False)]


def raydl_samples(path):
    """raydl's grouping of one local shard, as {__key__, field: bytes} dicts like the library's."""
    data = open(path, "rb").read()
    if str(path).endswith((".tgz", ".tar.gz")):
        import gzip

        data = gzip.decompress(data)
    index = index_tar(lambda off, n: data[off:off + n], len(data), str(path))
    out = []
    for s in group_samples([m.name for m in index.members], str(path)):
        d = {"__key__": s.key}
        for field, i in s.fields.items():
            m = index.members[i]
            d[field] = data[m.offset:m.offset + m.size]
        out.append(d)
    return out


def test_brace_patterns_expand_like_braceexpand():
    """Numeric ranges (zero padded), alternatives and several braces expand as the braceexpand package does."""
    import braceexpand

    for p in ["s-{000000..000003}.tar", "{train,val}-{0..2}.tar", "x{0..10..5}", "{a,b{1,2}}", "plain.tar",
              "{9..11}", "{3..1}"]:
        assert expand_braces(p) == list(braceexpand.braceexpand(p)), p


@pytest.mark.parametrize("bad", ["s-{0..3.tar", "s-0..3}.tar", "a}{b"])
def test_malformed_brace_pattern_is_a_value_error_naming_it(bad):
    """Unbalanced braces: ValueError naming the pattern, before anything is read."""
    with pytest.raises(ValueError, match="malformed brace pattern") as info:
        raydl.read_webdataset(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_grouping_matches_the_webdataset_library_on_awkward_names(tmp_path, fmt):
    """Multi-dot, dotted folders, upper-case fields, no-dot, __meta__, ./, long and unicode names, repeats:
    raydl's samples (keys, fields, bytes) equal the webdataset library's."""
    members = AWKWARD
    if fmt == tarfile.USTAR_FORMAT:  # ustar cannot hold the long or non-ASCII names
        members = [(n, d) for n, d in AWKWARD if len(n) < 100 and n.isascii()]
    path = write_tar(tmp_path / "awkward.tar", members, fmt=fmt)
    assert raydl_samples(path) == library_samples(path)


def test_grouping_matches_the_library_on_the_shared_shards(shared_data):
    """On the webdataset project's own test shards (tar and tgz) raydl groups exactly as the library does."""
    shards = sorted((shared_data / "webdataset").iterdir())
    assert shards
    for path in shards:
        assert raydl_samples(path) == library_samples(path), path.name


def located_samples(ds):
    """Every sample of a listed dataset as a worker sees it: (key, image bytes, label), from locate + cut."""
    cat = ds.catalog
    loc = cat.source.locate(cat, np.arange(len(cat)))
    assert not loc.errors
    out = []
    for i in range(len(cat)):
        info = cat.shard_info(int(loc.shard[i]))
        data = cat.source.read_block(cat.storage, info, int(loc.offset[i]), int(loc.length[i]))
        rec = cat.source.cut(loc, i, data)
        image, label = rec["image"], rec["label"]
        out.append((loc.key[i], image, label))
    return out


def library_view(path, fields=("jpg", "jpeg", "png", "webp")):
    """The webdataset library's samples with an image field, as (key, image bytes, label)."""
    ref = [s for s in library_samples(path) if any(f in s for f in fields)]
    return [(s["__key__"], next(s[f] for f in fields if f in s), int(s["cls"]) if "cls" in s else -1) for s in ref]


def test_catalog_parts_are_shards_and_workers_cut_the_library_samples(tmp_path, monkeypatch):
    """read_webdataset: one part per shard (its count), no per-sample column on the driver; the worker's locate +
    cut give each sample's key, exact image bytes and int label as the webdataset library reads them."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tar(tmp_path / "s.tar", AWKWARD)
    ds = raydl.read_webdataset(str(path))
    parts = ds.catalog.parts.to_pydict()
    assert parts["shard"] == [0] and parts["count"] == [len(ds)]
    assert not {"key", "offset", "label"} & set(ds.catalog.parts.column_names)
    assert located_samples(ds) == library_view(path)


def test_brace_lists_and_globs_and_patterns_that_match_nothing(tmp_path, monkeypatch, caplog):
    """Brace patterns, lists and globs name shards in order; a pattern matching no shard is a ValueError naming it."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    for i in range(3):
        write_tar(tmp_path / f"shard-{i:04d}.tar", [(f"s{i}.jpg", b"x"), (f"s{i}.cls", str(i).encode())], extras=False)
    keys = lambda ds: [k for k, _, _ in located_samples(ds)]  # noqa: E731
    assert keys(raydl.read_webdataset(str(tmp_path / "shard-{0000..0002}.tar"))) == ["s0", "s1", "s2"]
    assert keys(raydl.read_webdataset([str(tmp_path / "shard-0002.tar"), str(tmp_path / "shard-0000.tar")])) == [
        "s2", "s0"]
    assert keys(raydl.read_webdataset(str(tmp_path / "shard-*.tar"))) == ["s0", "s1", "s2"]
    for nothing in [str(tmp_path / "nope-{0..3}.tar"), str(tmp_path / "*.tgz")]:
        with pytest.raises(ValueError, match="matches nothing") as info:
            raydl.read_webdataset(nothing)
        assert nothing in str(info.value)
    with pytest.raises(ValueError, match="'hdfs'"):
        raydl.read_webdataset("hdfs://bucket/shard-{0..3}.tar")
    # a brace pattern naming shards that do not exist lists those that do, never silently: a warning counts them
    with caplog.at_level(logging.WARNING, logger="raydl"):
        assert keys(raydl.read_webdataset(str(tmp_path / "shard-{0000..0004}.tar"))) == ["s0", "s1", "s2"]
    warned = [r.getMessage() for r in caplog.records if "do not exist" in r.getMessage()]
    assert len(warned) == 1 and "2 of the shards" in warned[0] and "shard-0003.tar" in warned[0]
    with open(os.fsencode(tmp_path) + b"/shard-\xff.tar", "wb") as f:  # a name that is not UTF-8
        f.write((tmp_path / "shard-0000.tar").read_bytes())
    with pytest.raises(DataSourceError, match="not UTF-8"):
        raydl.read_webdataset(str(tmp_path / "shard-*.tar"))


def test_truncated_and_corrupt_shards_name_the_shard_and_offset(tmp_path, monkeypatch):
    """A shard cut inside a member, or with a damaged header, is a DataSourceError naming the shard and the offset."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tar(tmp_path / "ok.tar", [("a.jpg", b"x" * 3000), ("a.cls", b"1"), ("b.jpg", b"y" * 3000)],
                     extras=False)
    blob = open(path, "rb").read()
    # headers: a.jpg at 0, a.cls at 3584, b.jpg at 4608 (its data from 5120)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(blob[:5000])
    with pytest.raises(DataSourceError, match="truncated") as info:
        raydl.read_webdataset(str(cut))
    assert str(cut) in str(info.value) and "offset 4608" in str(info.value)
    bad = bytearray(blob)
    bad[3584 + 148:3584 + 156] = b"1234567\0"  # the checksum field of a.cls's header
    damaged = tmp_path / "damaged.tar"
    damaged.write_bytes(bytes(bad))
    with pytest.raises(DataSourceError, match="corrupt tar header at offset 3584") as info:
        raydl.read_webdataset(str(damaged))
    assert str(damaged) in str(info.value)


def test_compressed_shards_are_read_whole(shared_data, tmp_path, monkeypatch):
    """A .tgz shard is indexed from its decompressed stream; the worker's reads give each member's exact bytes."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    path = shared_data / "webdataset" / "sample.tgz"
    ds = raydl.read_webdataset(str(path), image_fields=("png",))
    assert len(ds) == 90
    assert located_samples(ds) == library_view(path, ("png",))
