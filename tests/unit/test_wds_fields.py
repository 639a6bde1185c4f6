"""WebDataset fields (read_webdataset(fields=...)): every member a field, selections with alternatives and
renames, values decoded as webdataset's default decoder decodes them, nothing unpickled by default, and bad
members refused under on_error, naming the shard, the sample and the field."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest

import raydl
from raydl.errors import DataSourceError, DecodeError
from raydl.sources import _values

pytestmark = pytest.mark.timeout(60)

#: extensions webdataset's default decoder decodes and raydl leaves as bytes (msgpack, tenbin, cbor)
LEFT_AS_BYTES = {"mp", "msg", "ten", "tb", "cbor"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    from raydl.sources import webdataset

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    webdataset.clear_blocks()


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def laion_shard(path, n=24, *, start=0, no_json=(3, 11, 17)):
    """LAION-style samples as webdataset's TarWriter writes them: jpg, a caption (50-200 characters), about
    300 bytes of json, cls; the samples in `no_json` lack the json."""
    import webdataset as wds

    rng = random.Random(start)
    with wds.TarWriter(str(path)) as sink:
        for i in range(start, start + n):
            caption = " ".join(rng.choice(["a", "photo", "of", "the", "ünïcode", "cat"]) for _ in range(40))
            sample = {
                "__key__": f"{i:06d}",
                "jpg": rng.randbytes(500 + i),
                "txt": caption[: 50 + i * 6],
                "cls": str(i % 5),
            }
            if i - start not in no_json:
                sample["json"] = {
                    "url": f"https://example.com/{i}.jpg",
                    "width": 640,
                    "height": 480,
                    "similarity": 0.31,
                    "caption": caption[:150],
                    "nsfw": "UNLIKELY",
                }
            sink.write(sample)
    return str(path)


def raw_tar(path, members):
    """A shard of exactly these (name, bytes) members (TarWriter would encode .pyd and .gz values itself)."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def library(path, *, decode=True) -> dict[str, dict]:
    """The webdataset library's samples of one shard by key, decoded by its default decoder."""
    import webdataset as wds

    ds = wds.WebDataset(str(path), shardshuffle=False)
    return {
        s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")}
        for s in (ds.decode() if decode else ds)
    }


def worker(ds) -> dict[str, dict | Exception]:
    """Every sample as a worker gets it (locate, read_block, cut on a view of the block), by key: its
    record, or the error that on_error would settle."""
    cat = getattr(ds, "catalog", ds)
    loc = cat.source.locate(cat, np.arange(len(cat)))
    out = {}
    for i in range(len(cat)):
        if i in loc.errors:
            out[loc.key[i]] = loc.errors[i]
            continue
        data = cat.source.read_block(
            cat.storage, cat.shard_info(int(loc.shard[i])), int(loc.offset[i]), int(loc.length[i])
        )
        try:
            out[loc.key[i]] = cat.source.cut(loc, i, memoryview(data))
        except (DataSourceError, DecodeError) as exc:
            out[loc.key[i]] = exc
    return out


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_fields_all_equal_the_library_decode_field_by_field(tmp_path):
    """fields="all" on TarWriter LAION-style shards: every field of every sample equals webdataset's
    .decode() (image bytes too); the fields are the union of the shards' (sorted); samples lacking one
    fail naming the sample, the field and the shard; a .txt.gz and a .npy decode as the library does."""
    path = laion_shard(tmp_path / "laion.tar")
    ds = raydl.read_webdataset(path, fields="all")
    assert [(f.name, f.kind) for f in ds.catalog.source.fields] == [
        ("cls", "value"),
        ("jpg", "image"),
        ("json", "value"),
        ("txt", "value"),
    ]
    assert len(ds) == 24
    ref, got = library(path), worker(ds)
    assert list(got) == list(ref)
    for key, rec in got.items():
        if "json" not in ref[key]:
            assert isinstance(rec, DataSourceError)
            assert str(rec) == f"{path}: sample {key!r} lacks the field 'json' (no .json member)"
            continue
        assert rec.keys() == ref[key].keys() and all(same(rec[k], ref[key][k]) for k in rec), key
    common = raydl.read_webdataset(path, fields=["jpg", "txt", "cls"])
    for key, rec in worker(common).items():
        assert all(same(rec[k], ref[key][k]) for k in ("jpg", "txt", "cls")), key
    extra = tmp_path / "extra.tar"
    import webdataset as wds

    with wds.TarWriter(str(extra)) as sink:  # TarWriter gzips a .gz field's value itself
        for i in range(3):
            sink.write(
                {
                    "__key__": f"x{i}",
                    "jpg": b"\xff\xd8jpeg",
                    "txt.gz": f"zipped caption {i} ü",
                    "npy": npy_bytes(np.arange(12, dtype=np.float32).reshape(3, 4) * i),
                    "json": [1, {"a": i}],
                }
            )
    got, ref = worker(raydl.read_webdataset(str(extra), fields="all")), library(extra)
    assert [f.kind for f in raydl.read_webdataset(str(extra), fields="all").catalog.source.fields] == [
        "image",
        "value",
        "array",
        "value",
    ]
    for key in ref:
        assert got[key].keys() == ref[key].keys() and all(same(got[key][k], ref[key][k]) for k in ref[key])


def test_the_shared_webdataset_shards_decode_as_the_library_decodes_them(shared_data):
    """The webdataset project's own test shards, compressed.tar's and testgz.tar's .txt.gz members
    included, with fields="all": every field equals the library's .decode(), but msgpack and tenbin
    members, which raydl leaves as their bytes."""
    for path in sorted((shared_data / "webdataset").iterdir()):
        got = worker(raydl.read_webdataset(str(path), fields="all"))
        ref, raw = library(path), library(path, decode=False)
        assert list(got) == list(ref), path.name
        for key, rec in got.items():
            assert not isinstance(rec, Exception), (path.name, rec)
            for k, v in rec.items():
                want = raw[key][k] if _values.extension_of(k)[1] in LEFT_AS_BYTES else ref[key][k]
                assert same(v, want), (path.name, key, k)
    texts = worker(raydl.read_webdataset(str(shared_data / "webdataset" / "compressed.tar"), fields="all"))
    assert [r["txt.gz"] for r in texts.values()] == [
        v["txt.gz"] for v in library(shared_data / "webdataset" / "compressed.tar").values()
    ] and all(texts.values())


def test_dict_fields_pick_the_first_alternative_and_rename(tmp_path):
    """fields={"image": "png;jpg", ...}: a sample's png where it has one, else its jpg; members renamed;
    a shard with no image at all (txt + json) loads and counts every sample, where fields=None finds
    none."""
    members = []
    for i in range(6):
        if i % 2 == 0:
            members.append((f"s{i}.jpg", b"jpeg%d" % i))
        if i % 3 == 0:
            members.append((f"s{i}.png", b"png%d" % i))
        if i == 5:
            members.append((f"s{i}.jpeg", b"jpeg-long%d" % i))
        members += [(f"s{i}.txt", f"caption {i}".encode()), (f"s{i}.cls", b"%d" % i)]
    path = raw_tar(tmp_path / "mixed.tar", members)
    ds = raydl.read_webdataset(path, fields={"image": "png;jpg;jpeg", "caption": "txt", "label": "cls"})
    assert [(f.name, f.kind) for f in ds.catalog.source.fields] == [
        ("image", "image"),
        ("caption", "value"),
        ("label", "value"),
    ]
    got = worker(ds)
    assert got["s0"] == {"image": b"png0", "caption": "caption 0", "label": 0}
    assert (
        got["s2"]["image"] == b"jpeg2"
        and got["s3"]["image"] == b"png3"
        and got["s5"]["image"] == b"jpeg-long5"
    )
    assert isinstance(
        got["s1"], DataSourceError
    ) and "lacks the field 'image' (no .png or .jpg or .jpeg member)" in str(got["s1"])
    assert len(ds) == 6 and len(raydl.read_webdataset(path)) == 5  # fields=None leaves s1 out
    loc = ds.catalog.samples([1])  # cut itself refuses it too, were it asked
    with pytest.raises(DataSourceError, match=f"{path}: sample 's1' lacks the field 'image'"):
        ds.catalog.source.cut(loc, 0, b"")

    texts = raw_tar(
        tmp_path / "text.tar",
        [
            (f"t{i}.{e}", d)
            for i in range(5)
            for e, d in [("txt", b"only text %d" % i), ("json", b'{"n": %d}' % i)]
        ],
    )
    got = worker(raydl.read_webdataset(texts, fields={"text": "txt", "meta": "json"}))
    assert got == {f"t{i}": {"text": f"only text {i}", "meta": {"n": i}} for i in range(5)}
    assert worker(raydl.read_webdataset(texts, fields="all"))["t4"] == {
        "json": {"n": 4},
        "txt": "only text 4",
    }
    with pytest.raises(DataSourceError, match="no samples with an image field"):
        raydl.read_webdataset(texts)


def test_the_catalog_does_not_grow_with_the_fields(tmp_path):
    """The driver's catalog has one part per shard whatever the fields: its bytes over one listing are the
    same with fields="all" as with fields=None, and the sample order (fingerprint) too; the per-sample
    spans live in the worker's SampleBlock, which counts them in its nbytes."""
    from raydl.sources import _wds_index as wi
    from raydl.storage import LocalStorage

    url = str(tmp_path / "s-{0..3}.tar")
    for s in range(4):
        laion_shard(tmp_path / f"s-{s}.tar", 30, start=100 * s, no_json=())
    plain = raydl.read_webdataset(url).catalog
    every = raydl.read_webdataset(url, fields="all").catalog
    picked = raydl.read_webdataset(url, fields={"image": "jpg", "caption": "txt", "meta": "json"}).catalog
    assert plain.nbytes == every.nbytes == picked.nbytes and plain.num_parts == 4
    assert plain.fingerprint == every.fingerprint == picked.fingerprint
    info = every.shard_info(0)
    blk = wi.select_samples(
        wi.build_block(LocalStorage(), info), info.uri, [exts for _, exts in every.source.select]
    )
    assert blk.at.shape == (30, 4) and blk.nbytes > blk.at.nbytes + blk.size.nbytes + blk.choice.nbytes


def test_a_wids_list_learns_the_fields_from_its_first_shard(tmp_path):
    """A wids shard list gives counts but no field sets: fields="all" indexes its first shard (one streamed
    read) to learn them, and every sample of every shard is cut."""
    from raydl.sources.webdataset import list_webdataset
    from raydl.storage import LocalStorage

    paths = [laion_shard(tmp_path / f"w{s}.tar", 8, start=10 * s, no_json=()) for s in range(3)]
    doc = {
        "__kind__": "wids-shard-index-v1",
        "shardlist": [{"url": Path(p).name, "nsamples": 8} for p in paths],
    }
    (tmp_path / "shards.json").write_text(json.dumps(doc))
    reads = []

    class Counting(LocalStorage):
        def stream(self, uri, *, etag=None, chunk=8 << 20):
            reads.append(uri)
            yield from super().stream(uri, etag=etag, chunk=chunk)

    storage = Counting()
    cat = list_webdataset(
        str(tmp_path / "shards.json"),
        storage_of=lambda _u: storage,
        image_fields=("jpg",),
        label_field="cls",
        fields="all",
    )
    assert reads == [paths[0]] and [f.name for f in cat.source.fields] == ["cls", "jpg", "json", "txt"]
    got = worker(cat)
    assert len(got) == 24 and all(
        isinstance(r, dict) and set(r) == {"cls", "jpg", "json", "txt"} for r in got.values()
    )


class _Touch:
    """Unpickling this creates the file `path`: what a hostile .pyd member would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_pickles_are_never_loaded_by_default(tmp_path):
    """A .pyd (and .pickle) member whose unpickling would create a file: by default the file is never
    created and the value is the member's bytes; with allow_pickle=True it is unpickled (as the library
    does)."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(str(marker)))
    path = raw_tar(
        tmp_path / "p.tar",
        [
            ("a.jpg", b"jpeg"),
            ("a.pyd", payload),
            ("a.pickle", payload),
            ("b.jpg", b"jpeg"),
            ("b.pyd", pickle.dumps({"safe": 1})),
            ("b.pickle", pickle.dumps([1])),
        ],
    )
    got = worker(raydl.read_webdataset(path, fields="all"))
    assert got["a"] == {"jpg": b"jpeg", "pickle": payload, "pyd": payload} and not marker.exists()
    assert got["b"]["pyd"] == pickle.dumps({"safe": 1})
    got = worker(raydl.read_webdataset(path, fields="all", allow_pickle=True))
    assert marker.exists() and got["b"] == {"jpg": b"jpeg", "pickle": [1], "pyd": {"safe": 1}}


def test_bad_members_are_decode_errors_naming_shard_sample_and_field(tmp_path, monkeypatch):
    """Malformed JSON, JSON nested too deep, a .npy whose header lies or holds objects, a .gz that does not
    inflate, a gzip bomb, text that is not UTF-8: each a DecodeError naming the shard, the sample and the
    field (the worker settles it under on_error); the other samples decode."""
    monkeypatch.setattr(_values, "INFLATE_FLOOR", 1 << 20)  # a bomb of 8 MiB is enough to show the bound
    good = npy_bytes(np.arange(4, dtype=np.int16))
    lying = good.replace(b"(4,)", b"(9,)")
    bomb = gzip.compress(bytes(8 << 20))
    zipped = gzip.compress(b"a caption " * 50)
    bad_crc = zipped[:-8] + bytes(4) + zipped[-4:]
    cases = {
        "json": (b'{"a": 1,', "not valid JSON"),
        "jsn": (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deep"),
        "npy": (lying, "its header says (9,) of int16 (18 bytes), 8 bytes follow it"),
        "npz": (b"PK\x03\x04 not a zip", "not a valid .npz"),
        "txt.gz": (bad_crc, "corrupt gzip data"),
        "transcript.gz": (zipped[:-20], "truncated gzip data"),
        "text.gz": (bomb, "a gzip bomb"),
        "txt": (b"caf\xe9", "not UTF-8 text"),
        "cls": (b"seven", "not an integer"),
        "big.cls": (b"9223372036854775808", "an integer outside int64"),
        "sub.npy": (_raw_npy(("<f4", (2,)), (3,), bytes(24)), "not a .npy raydl reads"),
        "huge.npy": (_raw_npy("<f8", (0, 2**62), b""), "not a valid .npy"),
    }
    members = []
    for k, (ext, (data, _)) in enumerate(cases.items()):
        members += [
            (f"bad{k}.{ext}", data),
            (
                f"ok{k}.{ext}",
                {
                    "json": b"{}",
                    "jsn": b"[]",
                    "npy": good,
                    "npz": _npz(),
                    "txt.gz": zipped,
                    "transcript.gz": zipped,
                    "text.gz": gzip.compress(b"y"),
                    "txt": b"t",
                    "cls": b"3",
                    "big.cls": b"-9223372036854775808",
                    "sub.npy": good,
                    "huge.npy": good,
                }[ext],
            ),
        ]
    members += [("obj.npy", npy_bytes(np.array([{"a": 1}], dtype=object)))]
    path = raw_tar(tmp_path / "bad.tar", members)
    for k, (ext, (_, why)) in enumerate(cases.items()):
        got = worker(raydl.read_webdataset(path, fields={"v": ext}))
        err = got[f"bad{k}"]
        assert isinstance(err, DecodeError), (ext, err)
        assert str(err).startswith(f"{path}: sample 'bad{k}': field 'v' (its .{ext} member at offset "), err
        assert why in str(err), (ext, str(err))
        assert not isinstance(got[f"ok{k}"], Exception), (ext, got[f"ok{k}"])
    got = worker(raydl.read_webdataset(path, fields={"v": "npy"}))
    assert isinstance(got["obj"], DecodeError) and "allow_pickle" in str(got["obj"])
    assert worker(raydl.read_webdataset(path, fields={"v": "npy"}, allow_pickle=True))["obj"]["v"][0] == {
        "a": 1
    }


def _raw_npy(descr, shape, body: bytes) -> bytes:
    """A .npy of whatever header numpy's writer takes (a subarray dtype, a shape numpy cannot make)."""
    from numpy.lib import format as npformat

    f = io.BytesIO()
    npformat.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    return f.getvalue() + body


def _npz() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(3), b=np.ones((2, 2)))
    return buf.getvalue()


def test_npz_members_are_dicts_of_arrays():
    """An .npz member is a dict of arrays, as numpy.load gives them."""
    got = _values.decode_value("npz", _npz())
    assert set(got) == {"a", "b"} and same(got["a"], np.arange(3)) and same(got["b"], np.ones((2, 2)))


_NPZ_PEAK = """
import resource, sys
from raydl.errors import DecodeError
from raydl.sources import _values
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    _values.decode_value("npz", data)
    print("decoded")
except DecodeError as exc:
    print(str(exc).replace(chr(10), " "))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_npz_bombs_inflate_no_further_than_their_declared_bound(tmp_path):
    """A 500 MiB member of zeros, bzip2- or deflate-compressed to a few hundred bytes, declaring 10 bytes: a
    DecodeError, with no more than a few MiB inflated (bzip2 is refused as such; deflate is read a MiB at a
    time up to the declared size, then fails its CRC), seen in a fresh process's peak RSS; savez_compressed's
    own members still load."""
    import struct
    import subprocess
    import sys
    import zipfile

    for method, why in ((zipfile.ZIP_BZIP2, "only stored and deflated members"), (zipfile.ZIP_DEFLATED, "CRC")):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", method) as z, z.open("a.npy", "w", force_zip64=True) as member:
            for _ in range(500):  # written a MiB at a time: this process never holds the 500 MiB
                member.write(bytes(1 << 20))
        data = bytearray(buf.getvalue())
        assert len(data) < 1 << 20
        struct.pack_into("<I", data, data.find(b"PK\x03\x04") + 22, 10)  # declared sizes: 10 bytes
        struct.pack_into("<I", data, data.find(b"PK\x01\x02") + 24, 10)
        bomb = tmp_path / f"bomb-{method}.npz"
        bomb.write_bytes(bytes(data))
        proc = subprocess.run([sys.executable, "-c", _NPZ_PEAK, str(bomb)], capture_output=True, text=True,
                              timeout=100)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said, grew = proc.stdout.splitlines()
        assert why in said, said  # a DecodeError saying why
        assert int(grew) < 64 << 10, f"peak RSS grew by {int(grew) >> 10} MiB"  # KiB: under 64 MiB more
    buf = io.BytesIO()
    np.savez_compressed(buf, a=np.arange(1000))
    assert same(_values.decode_value("npz", buf.getvalue())["a"], np.arange(1000))


def test_fields_that_cannot_be_are_value_errors_at_listing(tmp_path):
    """A field no sample of any shard has (naming it and the shard), an .id or .key member under
    fields="all" (saying to rename it), a field named id or key, image_fields or label_field beside
    fields=: each a ValueError before anything is read by a worker."""
    path = laion_shard(tmp_path / "s.tar", 4, no_json=())
    with pytest.raises(
        ValueError,
        match=r"no sample of the 1 shard\(s\) of .* has the field 'caption' "
        r"\(a \.caption or \.text member\)",
    ) as info:
        raydl.read_webdataset(path, fields={"image": "jpg", "caption": "caption;text"})
    assert path in str(info.value)
    ids = raw_tar(tmp_path / "ids.tar", [("a.jpg", b"j"), ("a.id", b"17"), ("b.jpg", b"j"), ("b.id", b"18")])
    with pytest.raises(
        ValueError, match=r"\.id member, which would be batch\['id'\].*rename it with fields="
    ):
        raydl.read_webdataset(ids, fields="all")
    assert worker(raydl.read_webdataset(ids, fields={"sample_id": "id"})) == {
        "a": {"sample_id": 17},
        "b": {"sample_id": 18},
    }
    for bad in ({"key": "jpg"}, {"id": "cls"}):
        with pytest.raises(ValueError, match="is raydl's own"):
            raydl.read_webdataset(path, fields=bad)
    for kw in ({"image_fields": ("png",)}, {"label_field": "idx"}):
        with pytest.raises(ValueError, match="apply only with fields=None"):
            raydl.read_webdataset(path, fields="all", **kw)
    for bad in ("everything", {}, {"a": ""}, {"a": "jpg;txt"}, 3):
        with pytest.raises(ValueError):
            raydl.read_webdataset(path, fields=bad)


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16 + i, 12), (10 * i, 100, 200)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_a_loader_worker_batches_images_captions_and_json(tmp_path):
    """Through a LoaderWorker (no Ray): the decoded images beside the captions as str, the json as dicts and
    the labels as int64; a sample lacking its json is left out under on_error, named with its field; a bad
    json member is a decode failure naming the field; without .decode() the images are their bytes."""
    import webdataset as wds

    from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
    from raydl.describe.records import compile_pipeline

    path = str(tmp_path / "clip.tar")
    with wds.TarWriter(path, encoder=False) as sink:
        for i in range(8):
            sample = {
                "__key__": f"k{i}",
                "jpg": _jpeg(i),
                "txt": f"a photo of {i}".encode(),
                "cls": b"%d" % i,
                "json": json.dumps({"i": i, "tags": ["x"] * i}).encode(),
            }
            if i == 3:
                del sample["json"]
            if i == 6:
                sample["json"] = b"{broken"
            sink.write(sample)

    def batch(ds, ids):
        pipe = compile_pipeline(ds.stages)
        spec = WorkerSpec(program=pipe.program, threads=2, sample_stages=pipe.sample_stages)
        task = BatchTask(rank=0, epoch=0, index=0, ids=np.asarray(ids), seeds=np.asarray(ids))
        return LoaderWorker(spec, ds.catalog, reuse_buffers=False).run_batch(task)

    fields = {"image": "jpg", "caption": "txt", "meta": "json", "label": "cls"}
    result = batch(raydl.read_webdataset(path, fields=fields).decode().resize((8, 8)), range(8))
    b, kept = result.batch, [0, 1, 2, 4, 5, 7]
    assert b["key"] == [f"k{i}" for i in kept] and b["image"].shape == (6, 8, 8, 3)
    assert b["caption"].dtype == object and b["caption"].tolist() == [f"a photo of {i}" for i in kept]
    assert b["meta"].tolist() == [{"i": i, "tags": ["x"] * i} for i in kept]
    assert b["label"].dtype == np.int64 and b["label"].tolist() == kept
    assert [f.reason for f in result.unreadable] == [
        f"{path}: sample 'k3' lacks the field 'meta' (no .json member)"
    ]
    (bad,) = result.skipped
    assert bad.uri == f"{path}#k6" and f"{path}: sample 'k6': field 'meta' (its .json member" in bad.reason
    raw = batch(raydl.read_webdataset(path, fields=["jpg", "txt"]), [0, 5]).batch
    assert raw["jpg"].tolist() == [_jpeg(0), _jpeg(5)] and raw["txt"].tolist() == [
        "a photo of 0",
        "a photo of 5",
    ]
