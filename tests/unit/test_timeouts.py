"""iter_batches' default timeout (raydl/plan/timeouts.py): a floor, twice it for the first batch, and 10 × the
longest wait so far; LoaderConfig.batch_timeout_s is its knob."""
from __future__ import annotations

import math

import pytest

from raydl.options import LoaderConfig
from raydl.plan.timeouts import FACTOR, FIRST_FACTOR, batch_timeout

pytestmark = pytest.mark.timeout(30)


def test_the_first_batch_gets_twice_the_floor():
    """Before any batch (actors starting, first reads) the allowance is FIRST_FACTOR × the floor, said so."""
    seconds, why = batch_timeout(300.0, None)
    assert seconds == FIRST_FACTOR * 300.0 == 600.0
    assert "first batch" in why and "batch_timeout_s=300" in why


def test_later_batches_get_the_floor_or_ten_times_the_longest_wait():
    """Fast batches get the floor; a pipeline whose batches take long gets FACTOR × its longest wait."""
    assert batch_timeout(300.0, 0.2) == (300.0, "the default, batch_timeout_s=300")
    seconds, why = batch_timeout(300.0, 45.0)
    assert seconds == FACTOR * 45.0 == 450.0 and "longest wait" in why and "45" in why


def test_an_infinite_floor_waits_forever():
    """batch_timeout_s=inf (e.g. `.inf` in a YAML config) makes the default wait forever, first batch included."""
    assert batch_timeout(math.inf, None)[0] == math.inf
    assert batch_timeout(math.inf, 1e9)[0] == math.inf


def test_the_knob_is_a_loader_option_checked_on_construction():
    """LoaderConfig.batch_timeout_s defaults to 300 s, takes inf, and refuses 0, negatives and non-numbers."""
    assert LoaderConfig(batch_size=8).batch_timeout_s == 300.0
    assert LoaderConfig(batch_size=8, batch_timeout_s=math.inf).batch_timeout_s == math.inf
    for bad in (0, -1.0, "60", True):
        with pytest.raises(ValueError, match="batch_timeout_s"):
            LoaderConfig(batch_size=8, batch_timeout_s=bad)
