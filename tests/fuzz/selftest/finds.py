"""A target with planted defects, so the harness's own tests can see it catch each kind of finding.

``FUZZ_PLANT`` (environment) picks the defect: ``raise``, ``crash``, ``hang`` or ``allocate``; any input
with a byte 0x42 triggers it.
"""

import ctypes
import os

from raydl.errors import DecodeError

PLANT = os.environ.get("FUZZ_PLANT", "")


def seeds() -> list[bytes]:
    return [b"\x00\x01\x02\x03", b"hello"]


def run_one(data: bytes) -> None:
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
