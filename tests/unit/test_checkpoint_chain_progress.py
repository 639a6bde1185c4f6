"""A chain peer's progress, without Ray: the verified prefix grows chunk by chunk (reads land out of order),
and the pace of its looks at its upstream's progress word follows the upstream's rate."""
from __future__ import annotations

import numpy as np
import pytest

from raydl.checkpoint import layout
from raydl.checkpoint.fabric import UPSTREAM_POLL_RANGE_S, UPSTREAM_POLL_S, UpstreamPace, _Landing
from raydl.checkpoint.ref import CheckpointRef
from raydl.errors import CheckpointError

pytestmark = pytest.mark.timeout(30)


def _ref(buf: np.ndarray, chunk: int) -> CheckpointRef:
    return CheckpointRef(key="k" * 32, size=len(buf), chunk_size=chunk, checksums=layout.checksums(buf, chunk),
                         header="{}", holder="up")


def test_prefix_grows_per_verified_chunk_in_order_of_the_bytes():
    """Chunks landing 1, 0, 3, 2 (and a chunk in two reads) publish prefixes 2 and 4, never one past a gap."""
    src = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)
    dst = src.copy()
    heard: list[int] = []
    landing = _Landing(dst, _ref(src, 1000), "up", 0, heard.append)
    landing.landed(1000, 1000)
    assert heard == [] and landing.prefix == 0
    landing.landed(0, 1000)
    assert heard == [2]
    landing.landed(3000, 600)     # half of the last chunk: not verified yet
    landing.landed(3600, 400)
    assert heard == [2]
    landing.landed(2000, 1000)
    assert heard == [2, 4] and landing.prefix == 4


def test_prefix_resumes_from_start_and_a_corrupt_chunk_is_an_error():
    """A pull resumed at chunk 2 counts from there; a chunk whose digest differs raises naming the peer."""
    src = np.arange(4000, dtype=np.uint32).view(np.uint8)[:4000].copy()
    heard: list[int] = []
    landing = _Landing(src, _ref(src, 1000), "up", 2, heard.append)
    landing.landed(2000, 1000)
    assert heard == [3]
    src[3500] ^= 1
    with pytest.raises(CheckpointError, match="chunk 3 from up is corrupt"):
        landing.landed(3000, 1000)


def test_upstream_pace_follows_the_upstream_rate_within_its_range():
    """Before any growth: the default; then about one upstream chunk's time, clamped to the range."""
    lo, hi = UPSTREAM_POLL_RANGE_S
    pace = UpstreamPace()
    assert pace.wait_s() == UPSTREAM_POLL_S
    pace.saw(10.0, 0)
    pace.saw(10.0, 0)           # no growth: nothing learnt
    pace.saw(10.5, 1)           # the first growth: the upstream's start-up, not its pace
    assert pace.wait_s() == UPSTREAM_POLL_S
    pace.saw(10.516, 3)         # 8 ms per chunk (1 MiB at 1 Gbit/s)
    assert pace.wait_s() == pytest.approx(0.008)
    pace.saw(10.520, 5)         # 2 ms per chunk: the average moves halfway
    assert pace.wait_s() == pytest.approx(0.005)
    fast, slow = UpstreamPace(), UpstreamPace()
    fast.saw(0.0, 0), fast.saw(0.1, 1), fast.saw(0.101, 100)
    slow.saw(0.0, 0), slow.saw(0.1, 1), slow.saw(5.1, 2)
    assert (fast.wait_s(), slow.wait_s()) == (lo, hi)
