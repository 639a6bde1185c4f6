"""Resume states are input: LoaderPlan.check_state checks every field's type and range before use, with a
ValueError naming the field, and keeps loading the states state() writes exactly as before. No Ray."""

from __future__ import annotations

import json

import pytest

import raydl
from raydl.options import LoaderConfig
from raydl.plan.build import build_plan
from raydl.plan.loader_plan import Position

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def plan(image_folder):
    """61 samples, batch 8, 2 ranks: 4 batches per rank and epoch."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    return build_plan(ds.mixture(), LoaderConfig(batch_size=8, seed=3, world_size=2))


def _state(plan, **changes):
    state = json.loads(json.dumps(plan.state(rank=1, position=Position(2, 0, 1))))
    state.update(changes)
    return state


def test_the_states_state_writes_load_as_they_did(plan):
    """Every position a rank can stand at, through JSON, loads to itself; a state without shuffle_window, buckets,
    mix or rank (an older raydl's) still loads."""
    assert plan.batches_per_rank(0) == 4
    for epoch in (0, 1, 2**40):
        for done in range(5):
            state = json.loads(json.dumps(plan.state(rank=0, position=Position(epoch, 0, done))))
            assert plan.check_state(state) == Position(epoch, 0, done)
    older = {k: v for k, v in _state(plan).items() if k not in ("shuffle_window", "buckets", "mix", "rank")}
    assert plan.check_state(older) == Position(2, 0, 1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("batches_done", -3),  # was accepted, then an IndexError while iterating
        ("batches_done", 5),  # past the epoch's 4 batches
        ("batches_done", 1.9),  # was truncated to 1
        ("batches_done", "1"),
        ("batches_done", True),
        ("epoch", 2**64),
        ("epoch", 1e300),
        ("epoch", -1),
        ("start", -1),
        ("start", 62),
        ("world_size", 0),
        ("world_size", 2.0),
        ("batch_size", 2**40),
        ("seed", 3.0),
        ("seed", True),
        ("num_samples", 61.0),
        ("shuffle", 1),
        ("drop_last", "false"),
        ("fingerprint", 7),
        ("rank", 2),
        ("rank", -1),
        ("shuffle_window", -1),
        ("buckets", "none"),
        ("buckets", [[1, 2, 3]]),
        ("mix", [1]),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_refused_naming_it(plan, field, value):
    """Each field out of its type or range is a ValueError that names it and its value."""
    with pytest.raises(ValueError, match=f"cannot resume: the state's {field} is "):
        plan.check_state(_state(plan, **{field: value}))


def test_crafted_values_too_large_to_print_are_named_briefly(plan):
    """An epoch of 5,000 digits (Python gives such an int no repr) and a buckets list of 200,000 pairs: each a
    short ValueError naming the field, not a repr error or a megabyte message."""
    with pytest.raises(ValueError, match=r"the state.s epoch is <an int of about \d+ digits>") as info:
        plan.check_state(_state(plan, epoch=10**4999))
    assert len(str(info.value)) < 300
    with pytest.raises(ValueError, match=r"the state's buckets is <a list of 200000 items>") as info:
        plan.check_state(_state(plan, buckets=[[1, 2]] * 200_000))
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("key, value", [("sample_weights", 5), ("fingerprints", 7), ("weights", 3),
                                        ("sources", 9), ("epoch_size", list(range(100_000)))])
def test_a_mix_state_with_fields_of_the_wrong_type_is_a_value_error(image_folder, key, value):
    """A mix's recorded fields that are not lists (or far too long): a short ValueError saying what changed,
    never a TypeError from zipping an int."""
    images = raydl.read_images(str(image_folder)).decode().center_crop(16)
    mixed = build_plan(raydl.mix({"a": images, "b": images}, weights={"a": 1, "b": 3}).mixture(),
                       LoaderConfig(batch_size=2, seed=3, world_size=1))
    state = json.loads(json.dumps(mixed.state(rank=0, position=Position(0, 0, 1))))
    state["mix"][key] = value
    with pytest.raises(ValueError, match="cannot resume: the ") as info:
        mixed.check_state(state)
    assert len(str(info.value)) < 400


def test_a_state_that_is_not_a_dict_or_lacks_a_field_is_refused(plan):
    """A list, a string or None is a ValueError (not an AttributeError); so is a state without a field it needs,
    or of another version."""
    for bad in ([1, 2], "state", None, 3):
        with pytest.raises(ValueError, match="cannot resume: a state is the dict state_dict\\(\\) returned, got "):
            plan.check_state(bad)
    for field in ("epoch", "batches_done", "start", "world_size", "batch_size", "seed", "fingerprint"):
        state = _state(plan)
        del state[field]
        with pytest.raises(ValueError, match=f"cannot resume: the state has no {field}"):
            plan.check_state(state)
    for version in (True, 1.0, "1", 2):
        with pytest.raises(ValueError, match="unsupported iterator state version"):
            plan.check_state(_state(plan, version=version))


def test_a_state_of_another_world_size_is_bounded_by_its_own_epoch(plan):
    """At another world size batches_done is checked against the state's own deal: 61 samples on 3 ranks of 8 make
    3 batches a rank, so 3 re-deals past the end and 4 is refused."""
    three = _state(plan, world_size=3, rank=2, batches_done=3)
    assert plan.check_state(three) == Position(3, 0, 0)
    with pytest.raises(ValueError, match=r"the state's batches_done is 4; it must be an int in \[0, 3\]"):
        plan.check_state({**three, "batches_done": 4})
