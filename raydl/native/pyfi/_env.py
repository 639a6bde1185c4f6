"""The one place pyfi reads the environment.

raydl's other settings go through raydl/env.py; pyfi reads its two
variables here, in one small function, so that the bindings load (and can be
disabled) without importing the rest of raydl.

- RAYDL_FABRIC_PROVIDER: the provider to use when a call names none
  (e.g. "tcp;ofi_rxm").
- RAYDL_DISABLE_FABRIC=1: behave as if libfabric were absent (available() is
  False, with this as the reason); the Ray object-store path is then used.

It also gives libfabric defaults for settings it reads from the environment
(PROVIDER_DEFAULTS), before libfabric starts; a value already set wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# ofi_rxm (libfabric 1.17) left to itself gives each endpoint's message receive queue 4096 entries
# of 16 KiB ("128, 4096 with srx", fi_info -e): every pyfi endpoint, a server's or a client's, then
# faulted in ~68 MiB of receive buffers (17,400 page faults, ~50 ms of CPU, measured on tcp;ofi_rxm
# here) that it never uses: pyfi moves bytes with one-sided reads and writes only. Naming the size
# (its documented 128; 16 costs the same) brings that to ~5,000 faults and ~15-20 ms. A chain
# broadcast opens one server per peer, so this was a fifth of a peer's CPU.
# Those buffers are rxm's bounce buffers (16 KiB each, for messages and injected data), and every
# connection posts its own too: at 4 KiB, opening an endpoint went from 12-15 to 3-4 ms and a first
# read to a new peer (rxm connects on first use) from 21-24 to 11-12 ms, here; RMA reads and writes
# do not pass through them. The eager limit goes with the buffer size (over verbs they must be
# equal), both or neither.
PROVIDER_DEFAULTS = {
    "FI_OFI_RXM_MSG_RX_SIZE": "128",
    "FI_OFI_RXM_BUFFER_SIZE": "4096",
    "FI_OFI_RXM_EAGER_LIMIT": "4096",
}
_TOGETHER = (("FI_OFI_RXM_BUFFER_SIZE", "FI_OFI_RXM_EAGER_LIMIT"),)  # set as a group, or not at all


def apply_provider_defaults() -> None:
    """Set PROVIDER_DEFAULTS where the environment has no value (libfabric reads them when it starts);
    of a group in _TOGETHER, none where any is set."""
    grouped = {name for group in _TOGETHER for name in group}
    for name, value in PROVIDER_DEFAULTS.items():
        if name not in grouped:
            os.environ.setdefault(name, value)
    for group in _TOGETHER:
        if not any(name in os.environ for name in group):
            for name in group:
                os.environ[name] = PROVIDER_DEFAULTS[name]


@dataclass(frozen=True)
class FabricEnv:
    provider: str | None
    disabled: bool


def fabric_env() -> FabricEnv:
    """Read pyfi's environment variables (called each time: tests change them)."""
    provider = os.environ.get("RAYDL_FABRIC_PROVIDER", "").strip() or None
    disabled = os.environ.get("RAYDL_DISABLE_FABRIC", "").strip().lower() in ("1", "true", "yes", "on")
    return FabricEnv(provider=provider, disabled=disabled)
