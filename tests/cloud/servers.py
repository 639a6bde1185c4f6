"""Local GCS and Azure Blob servers for the tests: raydl/bench/emulators.py (shared with `raydl bench storage`)
runs fake-gcs-server and azurite in memory on 127.0.0.1 as child processes, stopped by PID."""
from __future__ import annotations

from raydl.bench.emulators import AZURITE_ACCOUNT, AZURITE_KEY, Azurite, FakeGCS, azurite_binary, free_port

__all__ = ["AZURITE_ACCOUNT", "AZURITE_KEY", "Azurite", "FakeGCS", "azurite_binary", "free_port"]
