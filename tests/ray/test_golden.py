"""The default path's outputs stay bit-identical: pixels, order and resume states, against digests recorded
from main at 86b41a5 (tests/golden/default_path.json), on the shared photos and on in1k-like and
high-resolution sets cut from them by `raydl make-images`.

Each case lists its inputs' digest, then for every rank and epoch each batch's digest (every field's bytes,
shape and dtype, the ids and labels in order) and the rank's state_dict after it. A change that moves one
pixel, one sample or one state field fails here and names the case, rank, epoch and batch. Resuming from a
mid-epoch state must give the recorded rest of that epoch.

RAYDL_GOLDEN_RECORD=1 rewrites the file instead of checking it: only for a change that means to alter the
default outputs, and such a change says so in its commit message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import raydl

pytestmark = pytest.mark.timeout(300)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "default_path.json"
RECORD = os.environ.get("RAYDL_GOLDEN_RECORD") == "1"
EPOCHS = 2
WORLD = 2
RESUME_AFTER = 1  # batches of epoch 1 on rank 0 before the state is taken


def _digest_inputs(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _digest_value(h, value) -> None:
    if isinstance(value, np.ndarray) and value.dtype != object:
        a = np.ascontiguousarray(value)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(value, np.ndarray | list | tuple):
        h.update(f"seq{len(value)}".encode())
        for v in value:
            _digest_value(h, v)
    else:
        h.update(repr(value).encode())


def _digest_batch(batch: dict) -> dict:
    h = hashlib.sha256()
    for key in sorted(batch):
        h.update(key.encode())
        _digest_value(h, batch[key])
    return {"ids": [int(i) for i in batch["id"]], "digest": h.hexdigest()}


def _digest_state(state: dict) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _pipelines():
    def train(ds):
        return ds.random_resized_crop(224).random_hflip().normalize("imagenet")

    def buckets(ds):
        return ds.aspect_buckets(size=512, multiple=32, min_ratio=0.5, max_ratio=2.0)

    def evaluate(ds):
        return ds.resize(256).center_crop(224).normalize("imagenet")

    return {"train": train, "buckets": buckets, "eval": evaluate}


# (case, data set, pipeline, batch size)
CASES = [
    ("photos-train", "photos", "train", 2),
    ("photos-buckets", "photos", "buckets", 2),
    ("photos-eval", "photos", "eval", 2),
    ("in1k-train", "in1k", "train", 8),
    ("hires-train", "hires", "train", 4),
    ("hires-buckets", "hires", "buckets", 4),
]


@pytest.fixture(scope="module")
def golden_sets(shared_data, tmp_path_factory) -> dict[str, Path]:
    from PIL import Image

    from raydl.bench.make_images import make_dataset

    photos = sorted((shared_data / "photos").glob("*.jpg"))
    root = tmp_path_factory.mktemp("golden")
    sets = {"photos": root / "photos"}
    for i, photo in enumerate(photos):  # two classes, so labels vary
        dest = sets["photos"] / f"c{i % 2}" / photo.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(photo, dest)
    sources = [Image.open(p).convert("RGB") for p in photos]
    for name, n, profile in (("in1k", 40, "in1k"), ("hires", 12, "hires")):
        sets[name] = root / name
        make_dataset(sets[name], n, profile=profile, classes=3, seed=21, sources=sources)
    return sets


def _run_case(ray_local, sets, case, data, pipeline, batch_size) -> dict:
    ds = _pipelines()[pipeline](raydl.read_images(str(sets[data])).decode())
    loader = ds.loader(batch_size=batch_size, seed=7, world_size=WORLD, num_workers=1)
    out = {"inputs": _digest_inputs(sets[data]), "ranks": {}}
    try:
        for rank in range(WORLD):
            it = loader.iterator(rank)
            epochs = []
            for _epoch in range(EPOCHS):
                batches = []
                for batch in it.iter_batches():
                    entry = _digest_batch(batch)
                    entry["state"] = _digest_state(it.state_dict())
                    batches.append(entry)
                epochs.append(batches)
            out["ranks"][str(rank)] = epochs
        # resume rank 0 mid-way through epoch 1 (the second epoch) in a fresh iterator
        it = loader.iterator(0)
        for _ in it.iter_batches():  # epoch 0
            pass
        stream = it.iter_batches()
        for _ in range(RESUME_AFTER):
            next(stream)
        state = it.state_dict()
        stream.close()
        again = loader.iterator(0)
        again.load_state_dict(state)
        out["resumed"] = [_digest_batch(b) for b in again.iter_batches()]
    finally:
        loader.shutdown()
    return out


def _check(case: str, got: dict, want: dict) -> None:
    if got["inputs"] != want["inputs"]:
        pytest.fail(
            f"{case}: the generated input files differ from the recorded ones (inputs digest {got['inputs'][:12]} "
            f"!= {want['inputs'][:12]}): make-images or Pillow's JPEG encoder changed, not raydl's outputs"
        )
    for rank, epochs in want["ranks"].items():
        for e, batches in enumerate(epochs):
            mine = got["ranks"][rank][e]
            assert len(mine) == len(batches), (
                f"{case}: rank {rank} epoch {e}: {len(mine)} batches, want {len(batches)}"
            )
            for b, (g, w) in enumerate(zip(mine, batches, strict=True)):
                where = f"{case}: rank {rank} epoch {e} batch {b}"
                assert g["ids"] == w["ids"], f"{where}: sample order changed: ids {g['ids']} != {w['ids']}"
                assert g["digest"] == w["digest"], f"{where}: a field's bytes, shape or dtype changed"
                assert g["state"] == w["state"], f"{where}: the state_dict after it changed"
    recorded_rest = want["ranks"]["0"][1][RESUME_AFTER:]
    assert [r["digest"] for r in got["resumed"]] == [r["digest"] for r in recorded_rest], (
        f"{case}: resuming rank 0 after {RESUME_AFTER} batch(es) of epoch 1 did not give the recorded rest"
    )


def test_default_path_outputs_are_unchanged(ray_local, golden_sets):
    got = {case: _run_case(ray_local, golden_sets, case, *rest) for case, *rest in CASES}
    if RECORD:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {GOLDEN}")
    want = json.loads(GOLDEN.read_text())
    assert sorted(want) == sorted(got), f"cases {sorted(got)} != recorded {sorted(want)}"
    for case in want:
        _check(case, got[case], want[case])
