"""The one place pyfi reads the environment.

raydl's other settings go through raydl/config.py; pyfi reads its two
variables here, in one small function, so that the bindings load (and can be
disabled) without importing the rest of raydl.

- RAYDL_FABRIC_PROVIDER: the provider to use when a call names none
  (e.g. "tcp;ofi_rxm").
- RAYDL_DISABLE_FABRIC=1: behave as if libfabric were absent (available() is
  False, with this as the reason); the Ray object-store path is then used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class FabricEnv:
    provider: str | None
    disabled: bool


def fabric_env() -> FabricEnv:
    """Read pyfi's environment variables (called each time: tests change them)."""
    provider = os.environ.get("RAYDL_FABRIC_PROVIDER", "").strip() or None
    disabled = os.environ.get("RAYDL_DISABLE_FABRIC", "").strip().lower() in ("1", "true", "yes", "on")
    return FabricEnv(provider=provider, disabled=disabled)
