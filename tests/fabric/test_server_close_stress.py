"""Closing a serving endpoint while reads are in flight, many times over, never crashes or leaks.

A serving thread still inside fi_cq_sread when its completion queue is closed runs on freed provider
state: the segfault one fresh clone hit in these tests. close() therefore closes the endpoint only once
the thread is out of libfabric for good, or leaves it to the thread. The cycles run in a child process
(`_close_child.py`), so a crash is reported with its signal instead of ending the test session.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from raydl.native import pyfi

if not pyfi.available():
    pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}", allow_module_level=True)

CYCLES = 8  # about 0.3-0.7 s a cycle over tcp;ofi_rxm (two client connections), 0.1 s over sockets
READERS = 2  # as in _close_child


@pytest.mark.timeout(120)
def test_endpoints_closed_under_reads_in_flight_never_crash(provider):
    """CYCLES endpoints, each closed while two reads pull from it (six in eight with close() not
    waiting for the serving thread): no crash, every read ends intact or with FabricError, no thread,
    endpoint or file descriptor is left behind."""
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_close_child.py")
    proc = subprocess.run([sys.executable, child, provider, str(CYCLES)], capture_output=True, text=True,
                          timeout=100)
    output = proc.stdout + proc.stderr
    if proc.returncode < 0:
        pytest.fail(f"the child died of {signal.Signals(-proc.returncode).name}:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    tally = re.search(r"cycles (\d+) reads (\d+) intact (\d+) failed (\d+)", proc.stdout)
    assert tally, output[-4000:]
    cycles, reads, intact, failed = map(int, tally.groups())
    assert (cycles, reads) == (CYCLES, CYCLES * READERS)
    assert intact + failed == reads
