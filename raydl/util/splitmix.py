"""splitmix64, the one home of its constants: the plan's seed mixing and each sample's draws use it.

Its finalizer is a bijection on 64-bit words with good avalanche, cheap in
Python and in numpy, and the same on every platform.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GAMMA", "MASK64", "mix64", "mix64_array"]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # the golden-ratio increment between stream states
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """splitmix64's finalizer of one 64-bit int."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized over uint64 (wraps modulo 2**64); returns a new array."""
    # An array (0-d included) wraps without a warning, so no np.errstate: it cost a third of planning a batch.
    x = np.asarray(x).astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(_M1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_M2)
    x ^= x >> np.uint64(31)
    return x
