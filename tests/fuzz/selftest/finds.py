"""A target with planted defects, so the harness's own tests can see it catch each kind of finding.

``FUZZ_PLANT`` (environment) picks the defect: ``raise``, ``crash``, ``hang`` or ``allocate``; any input
with a byte 0x42 triggers it. ``refuse`` rejects every input with an allowed error, and ``crawl`` takes
50 ms an input: runs that never reach their floor.
"""

import ctypes
import os
import time

from raydl.errors import DecodeError

PLANT = os.environ.get("FUZZ_PLANT", "")
MIN_INPUTS, MIN_ACCEPTED = 200, 20


def seeds() -> list[bytes]:
    return [b"\x00\x01\x02\x03", b"hello"]


def run_one(data: bytes) -> None:
    if PLANT == "refuse":
        raise DecodeError("planted refusal of every input")
    if PLANT == "crawl":
        time.sleep(0.05)
    if b"\x41" in data:
        raise DecodeError("planted allowed error")
    if b"\x42" not in data:
        return
    if PLANT == "raise":
        raise KeyError("planted")
    if PLANT == "crash":
        ctypes.string_at(0)
    if PLANT == "hang":
        while True:
            pass
    if PLANT == "allocate":
        bytearray(8 << 30)
