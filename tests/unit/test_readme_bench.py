"""README's `raydl bench loader` example runs on a folder large enough to compare: batches of the default 256,
enough of them for a steady window, and a second epoch, which raydl's workers make (the first is made in the
bench's own process while they start)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raydl.bench.loader import DEFAULT_BATCH, MIN_BATCHES, batch_size_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(30)


def test_the_readme_bench_compares_at_the_default_batch_over_two_epochs():
    """The block's folder fills MIN_BATCHES batches of DEFAULT_BATCH (so no smaller batch, and a window with a
    ratio), and it asks for 2 epochs."""
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
              if "raydl bench loader" in b]
    assert len(blocks) == 1
    n = int(re.search(r"raydl make-images \S+ --n (\d+)", blocks[0]).group(1))
    assert batch_size_for(None, n) == DEFAULT_BATCH and n >= MIN_BATCHES * DEFAULT_BATCH, n
    assert re.search(r"raydl bench loader .*--epochs ([2-9])", blocks[0]), blocks[0]
