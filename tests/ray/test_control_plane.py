"""The control plane at scale, without data: the coordinator is off the data path and planning stays flat."""
from __future__ import annotations

import pytest

from raydl.bench.control_plane import measure


@pytest.mark.timeout(180)
def test_coordinator_calls_do_not_grow_with_ranks_and_plan_cost_is_flat():
    """Steady state: no rank calls the coordinator, at 8 or 1,024 ranks and 1 or 256 nodes; one change of the
    worker list costs one call per rank. Every configuration plans and dispatches its batches."""
    result = measure([8, 1024], [1, 256], batches=40, step_s=1.0)  # 20 s of training before the change
    rows = result["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["coordinator_calls_per_batch"] == 0, r
        assert r["coordinator_calls_per_change"] == 1, r
        assert r["loop_us"] > 0 and r["plan_us"] > 0 and 0 < r["share_of_decode"] < 1
    assert result["decode_ms_per_batch"] > 0 and result["ray_call_us"] > 0
