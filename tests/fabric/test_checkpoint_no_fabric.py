"""Without libfabric the checkpoint API still works, through the object store, and says so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = r"""
import logging, ray, torch
from raydl import checkpoint
from raydl.native import pyfi
assert not pyfi.available() and "RAYDL_DISABLE_FABRIC" in pyfi.unavailable_reason()
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
logging.basicConfig(level=logging.WARNING)
state = {"a": torch.arange(10.0), "b": torch.ones(3, 3, dtype=torch.bfloat16)}
ref = checkpoint.publish(state)
assert ref.transports == ("object_store",), ref.transports
got = checkpoint.fetch(ref)  # auto
assert got.transport == "object_store"
assert all(torch.equal(got[k], state[k]) for k in state)
try:
    checkpoint.fetch(ref, transport="fabric")
except checkpoint.CheckpointError as exc:
    print("refused:", exc)
else:
    raise SystemExit("transport='fabric' should have been refused")
print("OK")
"""


@pytest.mark.timeout(120)
def test_checkpoints_fall_back_to_the_object_store():
    """RAYDL_DISABLE_FABRIC=1: publish/fetch use the object store, auto logs it, 'fabric' is a clear error."""
    env = dict(os.environ, RAYDL_DISABLE_FABRIC="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout and "refused:" in proc.stdout
    assert "through the Ray object store" in proc.stderr
