"""The C kernel of token windows (raydl.native.token_windows_into): input ids, labels and document positions
equal to the naive definition for every integer type in and out, into any rows of the batch; windows or rows
out of bounds refused with nothing written; read_batch gives the same batch with it and without it."""

from __future__ import annotations

import numpy as np
import pytest
from tokens_util import random_docs, write_megatron

import raydl
import raydl.sources._tokens_source as tokens_source
from raydl.native import native_available, token_windows_into

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native_available(), reason="raydl's C kernels are not built"),
]

IN_TYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64"]


def _naive(values, starts, offsets, seq, out):
    """Window i: values[offsets[i] : offsets[i] + seq + 1] cast as numpy casts; positions from the starts."""
    win = np.stack([values[o : o + seq + 1] for o in offsets]).astype(out)
    t = np.asarray(offsets)[:, None] + np.arange(seq)
    doc = np.searchsorted(starts, t, side="right") - 1
    return win[:, :-1], win[:, 1:], (t - starts[doc]).astype(out)


def _corpus(dtype, seed):
    docs = random_docs(40, dtype, seed, max_len=50)  # some empty: several starts at one token
    values = np.concatenate(docs).astype(dtype)
    starts = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) for d in docs], out=starts[1:])
    return values, starts


@pytest.mark.parametrize("dtype", IN_TYPES)
@pytest.mark.parametrize("out", ["int64", "int32"])
def test_windows_equal_the_naive_definition(dtype, out):
    values, starts = _corpus(dtype, IN_TYPES.index(dtype))
    rng = np.random.default_rng(1)
    for seq in (1, 3, 64, len(values) - 1):
        n = 12
        offsets = rng.integers(0, len(values) - seq, n)
        offsets[:2] = (0, len(values) - seq - 1)  # the first and the last window
        rows = rng.permutation(n + 3)[:n]  # scattered into a larger batch
        got = [np.full((n + 3, seq), -5, out) for _ in range(3)]
        assert token_windows_into(values, starts, offsets, rows, *got)
        want = _naive(values, starts, offsets, seq, out)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g[rows], w)
            assert (np.delete(g, rows, axis=0) == -5).all()  # other rows untouched


def test_out_of_bounds_is_refused_with_nothing_written():
    values, starts = _corpus("uint16", 3)
    seq = 8
    outs = [np.full((4, seq), -5, np.int64) for _ in range(3)]
    for offsets, rows in (
        ([0, len(values) - seq], [0, 1]),  # the last window would read one token past the end
        ([0, -1], [0, 1]),
        ([0, 1], [0, 4]),  # row 4 of 4
        ([0, 1], [-1, 0]),
    ):
        with pytest.raises(ValueError, match="out of bounds"):
            token_windows_into(values, starts, np.array(offsets), np.array(rows), *outs)
        assert all((o == -5).all() for o in outs)
    with pytest.raises(ValueError, match="out of bounds"):  # document starts must begin at 0
        token_windows_into(values, starts + 1, np.array([0]), np.array([0]), *outs)


def test_types_it_does_not_take_are_left_to_the_caller():
    values, starts = _corpus("uint16", 4)
    offsets, rows = np.array([0, 5]), np.array([0, 1])
    outs = [np.zeros((2, 4), np.int16) for _ in range(3)]
    assert not token_windows_into(values, starts, offsets, rows, *outs)  # int16 out
    outs = [np.zeros((2, 4), np.int64) for _ in range(3)]
    assert not token_windows_into(values.astype(np.uint64), starts, offsets, rows, *outs)
    assert not token_windows_into(values, starts, offsets, rows, outs[0], outs[1], outs[2][:, ::2].copy())


@pytest.mark.parametrize("out", ["int64", "int32"])
def test_read_batch_is_the_same_with_the_kernel_and_without(tmp_path, monkeypatch, out):
    docs = random_docs(60, "int32", 9, max_len=300)
    write_megatron(str(tmp_path / "a"), docs, "int32")
    write_megatron(str(tmp_path / "b"), docs[:7], "int32")
    ds = raydl.read_tokens([str(tmp_path / "a"), str(tmp_path / "b")], seq_len=32, dtype=out)
    cat = ds.catalog
    ids = np.random.default_rng(0).permutation(len(ds))  # some windows cross from a into b
    tokens_source.clear_token_caches()
    fast = cat.source.read_batch(cat, cat.storage, ids)
    monkeypatch.setattr(tokens_source, "token_windows_into", lambda *a: False)
    tokens_source.clear_token_caches()
    slow = cat.source.read_batch(cat, cat.storage, ids)
    for k in ("input_ids", "labels", "position_ids"):
        assert fast[k].dtype == np.dtype(out)
        np.testing.assert_array_equal(fast[k], slow[k])
