"""What a fetcher checks before it trusts a CheckpointRef (it arrives through Ray from another process) and
the safetensors bytes it describes: a ref that disagrees with itself, or a header the format's own reader
would refuse, is a CheckpointError naming what is wrong, before anything is allocated or built."""
from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from raydl.checkpoint import api, layout
from raydl.checkpoint.ref import CheckpointRef, HolderLocation
from raydl.errors import CheckpointError
from raydl.native.pyfi import FabricAddress

pytestmark = pytest.mark.timeout(60)

CHUNK = 64


def _file(header: dict, data: bytes) -> np.ndarray:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return np.frombuffer(struct.pack("<Q", len(raw)) + raw + data, np.uint8).copy()


def _good() -> np.ndarray:
    return _file(
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
            "b": {"dtype": "I64", "shape": [2], "data_offsets": [64, 80]},
            "e": {"dtype": "F16", "shape": [0, 3], "data_offsets": [80, 80]},
        },
        bytes(range(80)),
    )


def _ref(buf: np.ndarray, **changes) -> CheckpointRef:
    fabric = FabricAddress(
        provider="tcp;ofi_rxm", fabric="127.0.0.0/8", raw=bytes(16), key=7, base=0, size=len(buf),
        writable=False, host="127.0.0.1",
    )
    ref = CheckpointRef(
        key="ab" * 16, size=len(buf), chunk_size=CHUNK, checksums=layout.checksums(buf, CHUNK),
        header="{}", holder="host:1", fabric=fabric,
        location=HolderLocation(node_id=None, machine="m", pid=1, started=None, fd=3, link="memfd:x"),
    )
    return dataclasses.replace(ref, **changes)


def test_a_ref_that_agrees_with_itself_passes():
    buf = _good()
    assert len(layout.checksums(buf, CHUNK)) == 5
    ref = _ref(buf)
    assert ref.check() is ref
    sha = dataclasses.replace(ref, sha256=layout.sha256s(buf, CHUNK))
    assert sha.check() is sha
    peer = dataclasses.replace(ref, progress_at=-(-len(buf) // 8) * 8,
                               fabric=dataclasses.replace(ref.fabric, size=-(-len(buf) // 8) * 8 + 8))
    assert peer.check() is peer


@pytest.mark.parametrize("change, said", [
    # fewer digests than chunks: the unchecked tail would have been handed on as it was in the buffer
    (lambda r: dict(checksums=r.checksums[:1]), r"1 digests for 5 chunks of 64 bytes"),
    (lambda r: dict(checksums=(*r.checksums, 1)), r"6 digests for 5 chunks"),
    (lambda r: dict(checksums=(-1, *r.checksums[1:])), "not a 64-bit unsigned integer"),
    (lambda r: dict(sha256=(b"x" * 32,)), "sha256 digests are not 5 digests of 32 bytes"),
    # a size the holder's region does not hold: allocated and faulted in before any read failed
    (lambda r: dict(size=3 << 30, chunk_size=1 << 30, checksums=(0, 0, 0)), "fabric region holds"),
    (lambda r: dict(size=1 << 60), "is not between 8 and"),
    (lambda r: dict(size=True), "is not between 8 and"),
    (lambda r: dict(chunk_size=0), "chunk_size 0 is not a positive integer"),
    (lambda r: dict(progress_at=3), "not 8-aligned after the"),
    (lambda r: dict(progress_at=-(-r.size // 8) * 8), "fewer than the"),  # the word past the region
    (lambda r: dict(fabric=dataclasses.replace(r.fabric, key=1 << 64)), "region's key is not a 64-bit"),
    (lambda r: dict(fabric=dataclasses.replace(r.fabric, base=-1)), "region's base is not a 64-bit"),
    (lambda r: dict(fabric=dataclasses.replace(r.fabric, raw="x")), "address bytes are not"),
    (lambda r: dict(fabric="127.0.0.1:9"), "a str, not a FabricAddress"),
    (lambda r: dict(location=dataclasses.replace(r.location, pid=-1)), "location is not a HolderLocation"),
    (lambda r: dict(key=5), "the key is not a short string"),
    (lambda r: dict(holder="h" * 5000), "the holder is not a short string"),
])
def test_a_ref_that_disagrees_with_itself_is_refused_naming_why(change, said):
    ref = _ref(_good())
    bad = dataclasses.replace(ref, **change(ref))
    with pytest.raises(CheckpointError, match=said) as info:
        bad.check()
    assert "its ref is not usable" in str(info.value) and len(str(info.value)) < 1000


def test_fetch_refuses_such_a_ref_before_allocating_anything(monkeypatch):
    """fetch() checks the ref first: a 3 GiB claim on a 128-byte region never reaches the receive buffer."""
    taken = []
    monkeypatch.setattr(api, "FetchTarget", lambda *a, **k: taken.append(a) or pytest.fail("allocated"))
    ref = _ref(_good())
    bad = dataclasses.replace(ref, size=3 << 30, chunk_size=1 << 30, checksums=(0, 0, 0))
    with pytest.raises(CheckpointError, match=f"fabric region holds {ref.size} bytes, fewer than the {3 << 30}"):
        api.fetch(bad)
    assert taken == []


def test_a_header_the_format_would_take_parses():
    header, start = layout.parse_header(_good(), "c")
    assert set(header) == {"w", "b", "e"} and start == len(_good()) - 80


@pytest.mark.parametrize("header, data, said", [
    # a zero-length entry with a 1 GiB shape: was a 1 GiB uninitialised tensor from an 80-byte file
    ({"x": {"dtype": "F32", "shape": [16384, 16384], "data_offsets": [0, 0]}}, b"",
     r"tensor 'x' of shape \[16384, 16384\] and dtype F32 needs 1073741824 bytes; its data_offsets give 0"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, b"", "not \\[begin, end\\]"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"", "not \\[begin, end\\]"),
    ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "dtype 'Q4', not one of"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "needs 12 bytes"),
    ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "not a list of sizes"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4), "end at byte 8 of the data, which holds 4"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "end at byte 8 of the data, which holds 12"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, bytes(6), "'y' starts at byte 2 .* not at 4"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, bytes(8), "'x' starts at byte 4 .* not at 0"),
    ({"x": [1, 2]}, b"", "described by a list"),
    ([1, 2], b"", "not a JSON object"),
])
def test_a_header_the_format_would_refuse_is_a_checkpoint_error(header, data, said):
    with pytest.raises(CheckpointError, match=said) as info:
        layout.parse_header(_file(header, data), "checkpoint c")
    assert str(info.value).startswith("checkpoint c is not a usable safetensors file: ")


@pytest.mark.parametrize("raw, said", [
    (b"\x01\x00", "2 bytes, fewer than the 8"),
    (struct.pack("<Q", 1 << 40) + b"{}", "a header of 1099511627776 bytes in 10"),
    (struct.pack("<Q", 4) + b"{]]]", "its header is not JSON"),
    (struct.pack("<Q", 6000) + b"[" * 3000 + b"]" * 3000, "its header is not JSON"),
])
def test_a_header_that_is_no_json_object_is_a_checkpoint_error(raw, said):
    with pytest.raises(CheckpointError, match=said):
        layout.parse_header(np.frombuffer(raw, np.uint8), "checkpoint c")


def test_publishing_a_file_that_is_no_safetensors_file_names_it(tmp_path):
    """publish(path) checks the header before serving anything: the file is named."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_file({"x": {"dtype": "F32", "shape": [16384, 16384], "data_offsets": [0, 0]}}, b"").tobytes())
    with pytest.raises(CheckpointError, match=r"checkpoint '.*bad\.safetensors' is not a usable safetensors file"):
        api.publish(str(bad), transports=("object_store",))


def test_memory_that_cannot_be_had_for_a_fetch_is_a_checkpoint_error(monkeypatch):
    """A receive buffer the kernel will not map (a size past what this machine has) is a CheckpointError
    naming the size and pointing at into=path, not a bare OSError."""
    import errno

    from raydl.checkpoint import buffers

    def no_memory(n, huge=False):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(buffers, "fresh", no_memory)
    ref = _ref(_good())
    with pytest.raises(CheckpointError, match=rf"no {ref.size} bytes of memory to receive it into .*into=path"):
        api.fetch(ref, transport="object_store", timeout=1)
