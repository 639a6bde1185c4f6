"""Aspect-ratio buckets: the set (datago's rule), nearest assignment, the crop box; no Ray."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from raydl.describe.buckets import assign_buckets, bucket_set, nearest_bucket
from raydl.describe.transforms import AspectBuckets, Decode, RandomHFlip, SampleRng, compile_stages

pytestmark = pytest.mark.timeout(60)


def rule(size, multiple, min_ratio, max_ratio):
    """The issue's rule, spelled out: widths pw*m, heights (s // pw)*m, plus the transposes, deduplicated."""
    p = size // multiple
    s = p * p
    out = []
    for pw in range(math.ceil(math.sqrt(s * min_ratio)), math.floor(math.sqrt(s * max_ratio)) + 1):
        w, h = pw * multiple, (s // pw) * multiple
        out += [(h, w), (w, h)]
    return set(out)


@pytest.mark.parametrize("args", [(512, 32, 0.5, 2.0), (224, 16, 0.5, 2.0), (1024, 64, 0.25, 4.0),
                                  (256, 32, 1.0, 1.0), (512, 32, 0.8, 3.0), (96, 32, 0.5, 2.0)], ids=str)
def test_bucket_set_follows_the_rule(args):
    """The set equals the rule's (height, width) pairs, without duplicates, sorted by width/height."""
    buckets = bucket_set(*args)
    assert set(buckets) == rule(*args) and len(set(buckets)) == len(buckets)
    ratios = [w / h for h, w in buckets]
    assert ratios == sorted(ratios)
    assert all(h % args[1] == 0 and w % args[1] == 0 for h, w in buckets)


def test_bucket_set_512_and_datagos_own_examples():
    """size 512 / 32 gives 13 buckets from 352x704 to 704x352 with 512x512 in the middle; datago's 224/16 picks."""
    b = bucket_set(512)
    assert len(b) == 13 and b[0] == (704, 352) and b[6] == (512, 512) and b[-1] == (352, 704)
    b224 = bucket_set(224, 16)
    assert nearest_bucket(b224, 100, 100) == (224, 224)
    assert nearest_bucket(b224, 200, 100) == (160, 304)  # datago: "1.900"
    assert nearest_bucket(b224, 100, 200) == (304, 160)  # datago: "0.526"


def test_nearest_assignment_matches_brute_force():
    """Each size goes to the bucket with the nearest width/height (ties to the wider); out of range to an end."""
    buckets = bucket_set(512)
    ratios = np.array([w / h for h, w in buckets])
    rng = np.random.default_rng(0)
    widths = rng.integers(1, 5000, 3000)
    heights = rng.integers(1, 5000, 3000)
    got = assign_buckets(buckets, widths, heights)
    for w, h, g in zip(widths, heights, got, strict=True):
        d = np.abs(ratios - w / h)
        best = np.flatnonzero(d == d.min())
        assert g == best.max(), (w, h, g, best)
    assert list(assign_buckets(buckets, [10000, 1, 512], [1, 10000, 512])) == [12, 0, 6]
    # a ratio exactly between two buckets goes to the wider one, as in datago
    (h0, w0), (h1, w1) = buckets[6], buckets[7]
    mid = (w0 / h0 + w1 / h1) / 2
    assert assign_buckets(buckets, [mid * 1000], [1000])[0] in (6, 7)


def test_unknown_sizes_get_no_bucket():
    """A size of 0 or -1 (unreadable header) is bucket -1, never silently some bucket."""
    assert list(assign_buckets(bucket_set(512), [0, -1, 640], [480, -1, 0])) == [-1, -1, -1]
    with pytest.raises(ValueError):
        nearest_bucket(bucket_set(512), 0, 10)


@pytest.mark.parametrize("kwargs,name", [({"size": 500}, "size"), ({"min_ratio": 2.5}, "min_ratio"),
                                         ({"multiple": 0}, "multiple"), ({"max_ratio": -1.0}, "max_ratio"),
                                         ({"size": 512.0}, "size"), ({"crop": "left"}, "crop")])
def test_bad_arguments_name_themselves(kwargs, name):
    """size not a multiple of multiple, min_ratio > max_ratio and the like are ValueErrors naming the argument."""
    with pytest.raises(ValueError, match=name):
        AspectBuckets(**kwargs)


@pytest.mark.parametrize("h,w", [(3000, 4000), (4000, 3000), (1000, 1000), (500, 3000), (3000, 500), (17, 23)])
def test_crop_box_has_the_bucket_ratio(h, w):
    """The crop box is inside the image, has the bucket's ratio to a pixel, and is centred (or seeded random)."""
    center, rand = AspectBuckets(512), AspectBuckets(512, crop="random")
    (bh, bw), (left, top, cw, ch) = center.bucket_crop(h, w, SampleRng(0))
    assert (bh, bw) == nearest_bucket(center.buckets, w, h)
    assert (cw == w or ch == h) and 0 <= left and 0 <= top and left + cw <= w and top + ch <= h
    assert abs(cw / ch - bw / bh) <= max(1 / ch, cw / ch**2) + 1e-9 or min(cw, ch) == 1
    assert abs((left + cw / 2) - w / 2) <= 1 and abs((top + ch / 2) - h / 2) <= 1
    boxes = {rand.bucket_crop(h, w, SampleRng(s))[1] for s in range(50)}
    assert boxes == {rand.bucket_crop(h, w, SampleRng(s))[1] for s in range(50)}  # a function of the seed
    if (cw, ch) != (w, h):
        assert len(boxes) > 1


def test_bucketed_program_shapes_and_geometry():
    """A bucketed program has one slot shape per bucket, and its geometry uses the bucket it is given."""
    program = compile_stages((Decode(), AspectBuckets(512), RandomHFlip()))
    assert len(program.slot_shapes()) == 13 and program.slot_shape((352, 704)) == (352, 704, 3)
    with pytest.raises(ValueError, match="bucket"):
        program.slot_shape()
    box, _ = program.geometry(3000, 4000, 0, (512, 512))
    assert box == (500.0, 0.0, 3500.0, 3000.0)


def test_aspect_buckets_replaces_the_crop_stages():
    """aspect_buckets with random_resized_crop, resize or center_crop (or twice) is a ValueError."""
    from raydl.describe.transforms import CenterCrop

    with pytest.raises(ValueError, match="aspect_buckets"):
        compile_stages((Decode(), CenterCrop(224), AspectBuckets(512)))
    with pytest.raises(ValueError, match="aspect_buckets"):
        compile_stages((Decode(), AspectBuckets(512), AspectBuckets(256)))


# ------------------------------------------------------------- the plan ----

from raydl.plan.order import EpochPlan, bucket_batch_count, bucket_batches  # noqa: E402


def _deal(bb, world_size, drop_last):
    plan = EpochPlan(len(bb), world_size, 1, drop_last)
    return [[int(plan.positions(r, k)[0]) for k in range(plan.batches_per_rank)] for r in range(world_size)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_bucket_plan_is_pure_equal_and_complete(world_size, drop_last):
    """Batches are bucket-pure (full but for each bucket's last); every rank gets as many; each sample appears
    once (none with an unknown size), and only whole pad batches repeat."""
    rng = np.random.default_rng(world_size)
    bucket_of = rng.integers(-1, 5, 503)
    B = 8
    bb = bucket_batches(bucket_of, num_buckets=5, batch_size=B, seed=1, epoch=0, shuffle=True,
                        drop_last=drop_last, fingerprint="ab" * 8)
    assert len(bb) == bucket_batch_count(bucket_of, 5, B, drop_last)
    short = collections.Counter()
    for j in range(len(bb)):
        ids = bb.batch(j)
        assert set(bucket_of[ids]) == {bb.bucket[j]} and 0 < len(ids) <= B
        short[int(bb.bucket[j])] += len(ids) < B
    assert max(short.values(), default=0) <= (0 if drop_last else 1)  # at most one short batch per bucket
    everything = np.concatenate([bb.batch(j) for j in range(len(bb))])
    assert len(everything) == len(set(everything.tolist()))
    listed = set(np.flatnonzero(bucket_of >= 0).tolist())
    assert set(everything.tolist()) <= listed and (drop_last or set(everything.tolist()) == listed)
    dealt = _deal(bb, world_size, drop_last)
    assert len({len(r) for r in dealt}) == 1
    flat = [j for r in dealt for j in r]
    if drop_last:
        assert len(flat) == len(set(flat))
    else:
        assert set(flat) == set(range(len(bb))) and len(flat) - len(bb) < world_size


def test_bucket_plan_depends_on_seed_epoch_and_fingerprint_only():
    """Same inputs, same batches; another epoch or seed reorders; shuffle=False keeps bucket and id order."""
    bucket_of = np.arange(100) % 3

    def make(**kw):
        args = dict(num_buckets=3, batch_size=4, seed=0, epoch=0, shuffle=True, drop_last=False, fingerprint="cd" * 8)
        bb = bucket_batches(bucket_of, **{**args, **kw})
        return [bb.batch(j).tolist() for j in range(len(bb))]

    assert make() == make()
    assert make() != make(epoch=1) and make() != make(seed=1) and make() != make(fingerprint="ef" * 8)
    plain = make(shuffle=False)
    assert plain[0] == [0, 3, 6, 9] and plain[8] == [96, 99]  # bucket 0's last batch is short


def test_bucket_plan_is_independent_of_world_size():
    """The global batch order does not depend on the world size: ranks deal it round-robin."""
    bucket_of = np.random.default_rng(3).integers(0, 4, 300)
    bb = bucket_batches(bucket_of, num_buckets=4, batch_size=8, seed=4, epoch=2, shuffle=True,
                        drop_last=True, fingerprint="01" * 8)
    d2, d3 = _deal(bb, 2, True), _deal(bb, 3, True)
    assert sorted(j for r in d2 for j in r)[: len(bb) - 2] == list(range(len(bb)))[: len(bb) - 2]
    assert [d3[r][0] for r in range(3)] == [0, 1, 2]


def test_one_huge_png_header_does_not_abort_aspect_buckets(tmp_path):
    """One PNG declaring width 3,000,000,000 among good images: aspect_buckets() lists the dataset, that one sample
    is in no bucket with its reason (on_error then decides), the others are bucketed."""
    import struct
    import zlib

    from PIL import Image

    import raydl

    (tmp_path / "c0").mkdir()
    for i in range(3):
        Image.new("RGB", (64 + 8 * i, 48), "green").save(tmp_path / "c0" / f"{i}.png")
    body = struct.pack(">IIBBBBB", 3_000_000_000, 1, 8, 2, 0, 0, 0)
    ihdr = struct.pack(">I", 13) + b"IHDR" + body + struct.pack(">I", zlib.crc32(b"IHDR" + body))
    (tmp_path / "c0" / "huge.png").write_bytes(b"\x89PNG\r\n\x1a\n" + ihdr)
    ds = raydl.read_images(str(tmp_path)).decode().aspect_buckets(64)
    assert sum(ds.bucket_counts().values()) == 3
    [(sid, reason)] = ds.catalog.size_errors.items()
    assert ds.catalog.uri(sid).endswith("huge.png") and "3000000000x1" in reason
