"""Fabric tests: libfabric over loopback providers (tcp;ofi_rxm, sockets).

Modules that need libfabric skip as a whole when the bindings cannot load; a
provider that diagnose() says does not fit here is skipped with its reason.
"""
from __future__ import annotations

import functools

import pytest

from raydl.native import pyfi

LOOPBACK_PROVIDERS = ("tcp;ofi_rxm", "sockets")


@functools.lru_cache(maxsize=1)
def _fits() -> dict:
    return {fit.provider: fit for fit in pyfi.diagnose(LOOPBACK_PROVIDERS)}


@pytest.fixture(params=LOOPBACK_PROVIDERS)
def provider(request) -> str:
    """Each loopback provider that fits here (skipped, with diagnose()'s reason, when not)."""
    if not pyfi.available():
        pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}")
    fit = _fits()[request.param]
    if not fit.fits:
        pytest.skip(f"{request.param} does not fit here: {fit.reason}")
    return request.param
