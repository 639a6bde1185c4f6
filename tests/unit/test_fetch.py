"""Pure fetch decisions: coalescing byte ranges into blocks, and the retry policy; plus LocalStorage reads."""
from __future__ import annotations

import random

import pytest

from raydl.errors import DataSourceError
from raydl.storage import LocalStorage, resolve, storage_for
from raydl.storage.fetch import Block, RetryPolicy, call_with_retries, coalesce

pytestmark = pytest.mark.timeout(60)


def _covers(ranges, blocks):
    seen = sorted(i for b in blocks for i in b.members)
    assert seen == list(range(len(ranges)))  # each range in exactly one block
    for b in blocks:
        for i in b.members:
            s, off, n = ranges[i]
            assert s == b.shard and b.offset <= off and off + n <= b.end


def test_neighbours_merge_and_far_ranges_do_not():
    """Ranges of one shard within max_gap merge into one block; a larger gap or another shard starts a new one."""
    ranges = [(0, 1000, 100), (0, 0, 512), (0, 600, 300), (1, 0, 10), (0, 10_000, 5)]
    blocks = coalesce(ranges, max_gap=100)
    _covers(ranges, blocks)
    assert blocks == [Block(0, 0, 1100, (1, 2, 0)), Block(0, 10_000, 5, (4,)), Block(1, 0, 10, (3,))]
    assert len(coalesce(ranges, max_gap=0)) == 5  # 512..600 and 900..1000 are gaps
    assert len(coalesce(ranges, max_gap=10_000)) == 2  # one per shard


def test_identical_and_overlapping_ranges_share_a_block():
    """Many rows of one Parquet row group name one range: it is fetched once."""
    ranges = [(3, 4096, 8192)] * 5 + [(3, 5000, 10)]
    blocks = coalesce(ranges, max_gap=0)
    assert blocks == [Block(3, 4096, 8192, (0, 1, 2, 3, 4, 5))]


def test_blocks_stay_within_max_block_unless_one_range_is_larger():
    """A block never grows past max_block; a single range bigger than that is fetched alone."""
    ranges = [(0, i * 100, 100) for i in range(10)] + [(0, 5000, 4000)]
    blocks = coalesce(ranges, max_gap=1 << 20, max_block=300)
    _covers(ranges, blocks)
    assert [b.length for b in blocks] == [300, 300, 300, 100, 4000]


def test_coalesce_is_deterministic_under_permutation():
    """The blocks depend on the set of ranges, not their order (members are renumbered accordingly)."""
    rng = random.Random(0)
    ranges = [(rng.randrange(3), rng.randrange(10_000), rng.randrange(1, 500)) for _ in range(200)]
    perm = list(range(200))
    rng.shuffle(perm)
    a = coalesce(ranges)
    b = coalesce([ranges[p] for p in perm])
    _covers(ranges, a)
    assert [(x.shard, x.offset, x.length) for x in a] == [(x.shard, x.offset, x.length) for x in b]


def test_coalesce_rejects_bad_input():
    """Negative offsets or lengths, and nonsensical limits, are ValueErrors."""
    with pytest.raises(ValueError):
        coalesce([(0, -1, 5)])
    with pytest.raises(ValueError):
        coalesce([(0, 0, 5)], max_block=0)


def test_retry_policy_backs_off_with_jitter_and_is_bounded():
    """Delays grow exponentially (full jitter), stop after `attempts` tries or past the deadline, never for 4xx."""
    p = RetryPolicy(attempts=4, base_delay_s=0.1, max_delay_s=0.3, deadline_s=10)
    assert p.delay(0, retryable=True, elapsed_s=0, rand=0.999) == pytest.approx(0.0999)
    assert p.delay(1, retryable=True, elapsed_s=0, rand=0.5) == pytest.approx(0.1)
    assert p.delay(2, retryable=True, elapsed_s=0, rand=1.0) == pytest.approx(0.3)  # capped at max_delay_s
    assert p.delay(3, retryable=True, elapsed_s=0, rand=0.5) is None  # 4 tries in all
    assert p.delay(0, retryable=False, elapsed_s=0, rand=0.5) is None  # 403/404: never
    assert p.delay(0, retryable=True, elapsed_s=9.99, rand=1.0) is None  # would pass the deadline
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


def test_call_with_retries_retries_only_retryable_errors():
    """A transient error is retried until success; a permanent one is raised at once; the last one when exhausted."""
    clock = [0.0]
    calls = []

    def flaky(fails, exc):
        def fn(time_left_s):
            calls.append(time_left_s)
            if len(calls) <= fails:
                raise exc
            return b"ok"
        return fn

    kw = dict(is_retryable=lambda e: isinstance(e, ConnectionError), clock=lambda: clock[0],
              sleep=lambda s: clock.__setitem__(0, clock[0] + s), rng=random.Random(1))
    assert call_with_retries(flaky(2, ConnectionError("reset")), RetryPolicy(attempts=3), **kw) == b"ok"
    assert len(calls) == 3
    assert calls[0] == 30.0 and calls[0] > calls[1] > calls[2]  # each try is told what is left of the total
    calls.clear()
    with pytest.raises(PermissionError):
        call_with_retries(flaky(1, PermissionError("403")), RetryPolicy(attempts=3), **kw)
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ConnectionError):
        call_with_retries(flaky(9, ConnectionError("reset")), RetryPolicy(attempts=3), **kw)
    assert len(calls) == 3


def test_each_try_gets_its_own_limit_within_the_total():
    """time_left: a try may take attempt_timeout_s, never more than what is left of deadline_s; the policy starts
    no try that would have no time left."""
    p = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=1.0, deadline_s=3.0, attempt_timeout_s=1.0)
    assert p.time_left(0.0) == 1.0
    assert p.time_left(2.5) == pytest.approx(0.5)
    assert p.time_left(3.5) == 0.0
    assert RetryPolicy(deadline_s=3.0).time_left(1.0) == 2.0  # no limit of its own: the rest of the total
    assert p.delay(1, retryable=True, elapsed_s=2.9, rand=0.5) is None  # 2.9 + 0.1 leaves nothing
    assert p.delay(1, retryable=True, elapsed_s=2.8, rand=0.5) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="attempt_timeout_s"):
        RetryPolicy(attempt_timeout_s=0)


def test_call_with_retries_tells_each_try_its_limit():
    """Stalled tries (each taking its whole limit on a fake clock) are retried, each told min(its limit, what is
    left), until the total is spent: 3 tries of 1 s in a 2.5 s budget are 1, 1 and the 0.5 s left."""
    clock = [0.0]
    limits = []

    def stalls(time_left_s):
        limits.append(time_left_s)
        clock[0] += time_left_s
        raise TimeoutError("stalled")

    policy = RetryPolicy(attempts=10, base_delay_s=0.0, deadline_s=2.5, attempt_timeout_s=1.0)
    with pytest.raises(TimeoutError):
        call_with_retries(stalls, policy, is_retryable=lambda e: True, clock=lambda: clock[0],
                          sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert limits == [1.0, 1.0, 0.5]


def test_unknown_scheme_is_a_value_error_naming_it():
    """http://, hdfs:// ... are ValueErrors naming the scheme, not 'does not exist'."""
    with pytest.raises(ValueError, match="'hdfs'"):
        storage_for("hdfs://bucket/x")
    assert isinstance(storage_for("/data/x"), LocalStorage)
    assert resolve("file:///data/x")[1] == "/data/x"


def test_local_read_range_and_errors(tmp_path):
    """LocalStorage reads exact ranges; a short read (the file shrank) and a missing file name the path and offset."""
    f = tmp_path / "a.bin"
    f.write_bytes(bytes(range(256)))
    st = LocalStorage()
    assert st.read_range(str(f), 10, 5) == bytes(range(10, 15))
    assert st.read_range(str(f), 0, 256) == bytes(range(256))
    with pytest.raises(DataSourceError, match="changed") as info:
        st.read_range(str(f), 250, 10)
    assert info.value.uri == str(f) and "250" in str(info.value)
    with pytest.raises(DataSourceError, match="offset 7") as info:
        st.read_range(str(tmp_path / "gone.bin"), 7, 1)
    assert info.value.uri == str(tmp_path / "gone.bin")
