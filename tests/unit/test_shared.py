"""Shared-memory batch slots (raydl/util/shared.py): a held batch is never written over; slots are reused."""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

from raydl.util import shared

pytestmark = pytest.mark.timeout(30)


def _batch(slots: shared.Slots, value: int, n: int = 4096):
    """A batch made in a slot the way a worker makes it: (its result dict with descriptors, the slot)."""
    slot, number = slots.lease(n * 4)
    images = slot.data[: n * 4].view(np.float32)
    images[:] = value
    return {"image": slot.describe(images, number), "id": np.arange(3)}, slot


def test_a_held_batch_is_never_written_over_and_a_dropped_one_is_reused():
    """While the reader holds a batch's arrays its slot is not leased again; once they are gone it is."""
    slots = shared.Slots(max_slots=4)
    held, slot_a = _batch(slots, 1)
    held = shared.attach_batch(held)
    assert not held["image"].flags.writeable and not held["image"].flags.owndata
    second, slot_b = _batch(slots, 2)
    assert slot_b is not slot_a  # slot a is held
    arr = shared.attach_batch(second)["image"]
    view = arr[10:20]  # a view of a view keeps the slot held too
    del arr, second
    gc.collect()
    third, slot_c = _batch(slots, 3)
    assert slot_c is not slot_b and slot_c is not slot_a  # slot b is held through `view`
    del view
    gc.collect()
    fourth, slot_d = _batch(slots, 4)
    assert slot_d is slot_b  # free again, and reused
    np.testing.assert_array_equal(held["image"], 1)  # untouched by the three batches after it
    assert slots.nbytes() == (3 * 4096 * 4, 3)


def test_all_slots_held_gives_none_and_a_dropped_result_frees_its_slot():
    """With max_slots held, lease says None (the caller goes through the object store); free_described
    gives back a result nobody will read."""
    slots = shared.Slots(max_slots=2)
    a, _ = _batch(slots, 1)
    _b, _ = _batch(slots, 2)
    assert slots.lease(16) is None
    slots.free_described(shared.described(a))
    assert slots.lease(16) is not None


def test_a_bigger_batch_replaces_a_free_slot_too_small():
    """Aspect buckets change a batch's size: a free slot too small is dropped for a bigger one (so there are
    only as many slots as batches held at once), and a reader's idle mapping of the dropped one goes."""
    slots = shared.Slots(max_slots=8)
    for n in (16, 64, 4096):
        batch, slot = _batch(slots, 1, n=n)
        arrays = shared.attach_batch(batch)
        del arrays, batch
        gc.collect()
        assert slots.nbytes() == (n * 4, 1) and int(slot.state[0]) == 0
    with shared._maps_lock:  # the dropped slots' mappings were closed when the next one was mapped
        assert all(int(shared._header(mm)[0]) != shared.CLOSED for mm in shared._maps.values())


def test_an_array_outside_the_slot_is_not_described():
    """A copy (rows left out) or another buffer is sent by value: describe returns None for it."""
    slots = shared.Slots()
    slot, number = slots.lease(64)
    assert slot.describe(np.zeros(16, np.float32), number) is None
    assert slot.describe(slot.data[:64].view(np.float32)[::2], number).strides == (8,)


def test_another_process_maps_the_slot():
    """A reader in another process (as the iterator is) maps the worker's memfd and sees its pixels; a
    made-up descriptor does not probe."""
    slots = shared.Slots()
    batch, _slot = _batch(slots, 7)
    desc = batch["image"]
    code = (
        "import sys; from raydl.util import shared; import numpy as np\n"
        f"d = shared.SharedArray({desc.pid}, {desc.fd}, {desc.token!r}, {desc.batch}, {desc.offset}, "
        f"{desc.shape}, {desc.strides}, {desc.dtype!r}, {desc.size})\n"
        "(a,) = shared.attach([d]); assert (a == 7).all(); print(int(a.sum()))\n"
        "bad = shared.SharedArray(d.pid, d.fd, b'x' * 16, 1, 0, (0,), (1,), '|u1', d.size)\n"
        "assert shared.probe(d) and not shared.probe(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 7 * 4096
    assert int(_slot.state[0]) == 0  # the reader's arrays went with it: the slot is free
