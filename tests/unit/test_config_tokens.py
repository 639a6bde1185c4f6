"""`source: {kind: tokens, ...}` in a YAML config is raydl.read_tokens with the same arguments."""

from __future__ import annotations

import numpy as np
import pytest
from tokens_util import random_docs, write_megatron

from raydl.config import TokensSource, load_config

pytestmark = pytest.mark.timeout(60)


def test_a_tokens_source_reads_the_corpus_as_read_tokens_does(tmp_path):
    import raydl

    docs = random_docs(40, "uint16", seed=3)
    write_megatron(str(tmp_path / "corpus"), docs, "uint16")
    path = tmp_path / "c.yaml"
    path.write_text(
        f"source: {{kind: tokens, paths: {tmp_path / 'corpus'}, seq_len: 8, eod: 0, dtype: int32}}\n"
        "loader: {batch_size: 4}\n"
    )
    cfg = load_config(path)
    assert cfg.source == TokensSource(paths=str(tmp_path / "corpus"), seq_len=8, eod=0, dtype="int32")
    ds = cfg.dataset()
    total = sum(len(d) for d in docs) + len(docs)  # one eod after each document
    assert len(ds) == (total - 1) // 8 == len(raydl.read_tokens(str(tmp_path / "corpus"), seq_len=8, eod=0))
    cat = ds.catalog
    got = cat.source.read_batch(cat, cat.storage, np.arange(3))
    assert got["input_ids"].dtype == np.int32 and got["input_ids"].shape == (3, 8)
    stream = np.concatenate([np.append(d.astype(np.int64), 0) for d in docs])
    assert np.array_equal(got["input_ids"][1], stream[8:16])


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{kind: tokens, paths: x, seq_len: 0}", "seq_len"),
        ("{kind: tokens, paths: x, seq_len: 8, dtype: float32}", "source.dtype"),
        ("{kind: tokens, paths: x, seq_len: 8, eod: -1}", "source.eod"),
        ("{kind: tokens, paths: x}", "source.seq_len"),
        ("{kind: tokens, paths: x, seq_len: 8, seqlen: 9}", "source.seqlen"),
    ],
)
def test_a_bad_tokens_source_is_refused_naming_the_key(tmp_path, line, match):
    path = tmp_path / "c.yaml"
    path.write_text(f"source: {line}\nloader: {{batch_size: 4}}\n")
    with pytest.raises(ValueError, match=match):
        load_config(path)
