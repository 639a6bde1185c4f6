"""iter_batches(batch_format="torch") is refused with the way to torch tensors: iter_torch_batches()."""

from __future__ import annotations

import pytest

from raydl.consume.formats import check_batch_format

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("name", ["torch", "pytorch", "Tensor"])
def test_a_torch_batch_format_points_to_iter_torch_batches(name):
    """The error still lists the formats, and names iter_torch_batches() for torch tensors."""
    with pytest.raises(ValueError) as err:
        check_batch_format(name)
    text = str(err.value)
    assert text.startswith("batch_format must be one of 'numpy', 'pyarrow', 'pandas'")
    assert "torch tensors come from iter_torch_batches()" in text


def test_other_unknown_formats_are_not_sent_to_torch():
    """A format that has nothing to do with torch gets the list only."""
    with pytest.raises(ValueError) as err:
        check_batch_format("arrow-ish")
    assert "iter_torch_batches" not in str(err.value)
