"""The checkpoint plane closed to outsiders (docs/security.md): nothing listens until a publish and
after the last unpublish, loopback outside Ray, a fresh random memory key per publish that no message
shows, a wrong key refused with no data, and publish(verify="sha256") catching tampered bytes."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from raydl import checkpoint
from raydl.actors.peer import CheckpointPeer
from raydl.checkpoint import api
from raydl.errors import CheckpointError, FabricError
from raydl.native import pyfi

from _ckpt_child import write_checkpoint  # beside this file

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not pyfi.available(), reason=f"libfabric unavailable: {pyfi.unavailable_reason()}"),
]
CHILD = os.path.join(os.path.dirname(__file__), "_ckpt_child.py")


def _child(*args: str, env: dict | None = None) -> dict:
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("RAYDL_CHECKPOINT_BIND", "RAYDL_CHECKPOINT_PREPARE", "RAY_ADDRESS")}
    run_env.update(env or {})
    proc = subprocess.run([sys.executable, CHILD, *args], env=run_env, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _file(path, n: int) -> str:
    return write_checkpoint(str(path), n)


def test_nothing_listens_until_published_and_after_the_last_unpublish(tmp_path):
    """A fresh process outside Ray: no listener after import, one on 127.0.0.1 while something is
    published, none once the last checkpoint is unpublished (regression: import listened on the
    external interface, and unpublish() left the listener open)."""
    out = _child("listen", str(tmp_path))
    assert out["before"] == [] and out["import"] == [], out
    assert [ip for ip, _ in out["published"]] == ["127.0.0.1"], out  # one endpoint serves both
    assert out["hosts"] == ["127.0.0.1", "127.0.0.1"]
    assert out["one_left"] == out["published"], out
    assert out["none_left"] == [], out
    assert [ip for ip, _ in out["again"]] == ["127.0.0.1"], out
    # a fetching process's client endpoint (rxm listens on it) binds loopback too, never elsewhere
    assert out["fetched"] == sum(i % 256 for i in range(4096))
    assert {ip for ip, _ in out["fetching"]} == {"127.0.0.1"}, out


def test_an_explicit_bind_overrides_loopback(tmp_path):
    """RAYDL_CHECKPOINT_BIND and publish(bind=) still choose the interface."""
    by_env = _child("listen", str(tmp_path), env={"RAYDL_CHECKPOINT_BIND": "127.0.0.2:0"})
    assert by_env["hosts"] == ["127.0.0.2", "127.0.0.2"]
    assert {ip for ip, _ in by_env["published"]} == {"127.0.0.2"} and by_env["none_left"] == []
    by_arg = _child("listen", str(tmp_path), "127.0.0.3:0")
    assert by_arg["hosts"] == ["127.0.0.3", "127.0.0.3"] and by_arg["none_left"] == []


def test_two_publishes_get_different_fresh_keys(tmp_path, provider):
    """Every published region gets its own random 64-bit key, never one this process gave out before."""
    path = _file(tmp_path / "a.safetensors", 4096)
    refs = [checkpoint.publish(path, transports=("fabric",), provider=provider, bind="127.0.0.1:0")
            for _ in range(2)]
    try:
        a, b = (r.fabric.key for r in refs)
        assert a != b and a and b
        assert max(a, b).bit_length() > 32  # drawn from 64 bits (a 2^-32 chance of a false alarm)
    finally:
        for r in refs:
            checkpoint.unpublish(r)
    from raydl.native.pyfi._objects import _KEYS

    drawn = [_KEYS.draw(64) for _ in range(1000)]
    assert len(set(drawn)) == 1000 and not set(drawn) & {a, b}


def test_the_key_is_in_no_repr_str_or_log_line(tmp_path, provider, caplog):
    """The memory key (the readers' secret) appears in no repr/str of the ref or its address, and in no
    log line of a publish, fetch and unpublish, in hex or decimal."""
    path = _file(tmp_path / "a.safetensors", 64 << 10)
    with caplog.at_level(logging.DEBUG, logger="raydl"):
        ref = checkpoint.publish(path, transports=("fabric",), provider=provider, bind="127.0.0.1:0")
        got = checkpoint.fetch(ref, transport="fabric")
        assert len(got) == 1
        forged = dataclasses.replace(ref, fabric=dataclasses.replace(ref.fabric, key=ref.fabric.key ^ 1))
        with pytest.raises(CheckpointError) as err:
            checkpoint.fetch(forged, transport="fabric", timeout=5)
        checkpoint.unpublish(ref)
    key = ref.fabric.key
    texts = [repr(ref), str(ref), repr(ref.fabric), str(ref.fabric), str(err.value), caplog.text,
             repr(got.peer)]
    for spelling in (f"{key:x}", f"{key:#x}", str(key), f"{key ^ 1:x}", str(key ^ 1)):
        assert not [t for t in texts if spelling in t], spelling


def test_a_reader_with_a_wrong_key_is_refused_and_gets_no_data(tmp_path, provider):
    """A forged address (right endpoint, wrong key) reads nothing: a FabricError from pyfi, a
    CheckpointError saying the holder refused from fetch(), and no file left by into=."""
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    with pyfi.serve(src, bind="127.0.0.1:0", provider=provider) as server:
        bad = dataclasses.replace(server.address, key=server.address.key ^ 0x5A5A)
        dst = np.zeros_like(src)
        with pytest.raises(FabricError), pyfi.connect(bad) as conn:
            conn.read_into(dst, timeout=5)
        assert not dst.any()
    path = _file(tmp_path / "a.safetensors", 64 << 10)
    ref = checkpoint.publish(path, transports=("fabric",), provider=provider, bind="127.0.0.1:0")
    try:
        forged = dataclasses.replace(ref, fabric=dataclasses.replace(ref.fabric, key=ref.fabric.key + 1))
        out = tmp_path / "out"
        out.mkdir()
        with pytest.raises(CheckpointError, match="refused the read"):
            checkpoint.fetch(forged, transport="fabric", into=out / "x.safetensors", timeout=5)
        assert os.listdir(out) == []
        assert len(checkpoint.fetch(ref, transport="fabric")) == 1  # the right key still reads
    finally:
        checkpoint.unpublish(ref)


def _tamper(ref, at: int) -> None:
    """Flip one byte of the publisher's bytes after publish: what a change in flight looks like to the
    fetcher."""
    api._PROCESS.published.get(ref.key).buffer[at] ^= 0x01


def test_sha256_catches_tampering_naming_peer_and_chunk(tmp_path, provider):
    """publish(verify="sha256") gives the ref one SHA-256 per chunk; a byte changed after publish fails the
    fetch naming the peer and the chunk, and leaves no file. Without it the XXH3-64 digests still
    catch this (random) change, as corruption: what they cannot catch is a change made to keep them."""
    import torch

    chunk = 64 << 10
    state = {"x": torch.arange(chunk, dtype=torch.int32)}  # 4 chunks and the header
    kw = dict(transports=("fabric",), provider=provider, bind="127.0.0.1:0", chunk_size=chunk)
    sha = checkpoint.publish(state, verify="sha256", **kw)
    plain = checkpoint.publish(state, **kw)
    out = tmp_path / "out"
    out.mkdir()
    try:
        assert len(sha.sha256) == len(sha.checksums) and all(len(d) == 32 for d in sha.sha256)
        assert plain.sha256 is None and "sha256" in repr(sha)
        assert torch.equal(checkpoint.fetch(sha, transport="fabric")["x"], state["x"])  # untampered
        with pytest.raises(ValueError, match="verify"):
            checkpoint.publish(state, verify="md5", **kw)
        _tamper(sha, chunk + 100)
        _tamper(plain, chunk + 100)
        with pytest.raises(CheckpointError, match=r"chunk 1 from .*127\.0\.0\.1.* does not match its sha256"):
            checkpoint.fetch(sha, transport="fabric", into=out / "x.safetensors")
        with pytest.raises(CheckpointError, match=r"chunk 1 from .*127\.0\.0\.1.* is corrupt \(xxh3-64"):
            checkpoint.fetch(plain, transport="fabric", into=out / "y.safetensors")
        assert os.listdir(out) == []
    finally:
        checkpoint.unpublish(sha)
        checkpoint.unpublish(plain)


def test_sha256_digests_travel_down_a_broadcast_chain(provider):
    """A broadcast peer's ref carries the publisher's SHA-256 digests, and it checks them as it pulls."""
    import torch

    chunk = 64 << 10
    ref = checkpoint.publish({"x": torch.arange(chunk, dtype=torch.int32)}, transports=("fabric",),
                             provider=provider, bind="127.0.0.1:0", chunk_size=chunk, verify="sha256")
    peer = CheckpointPeer(bind="127.0.0.1:0", provider=provider)
    try:
        mine = peer.prepare(ref)
        assert mine.sha256 == ref.sha256 and mine.fabric != ref.fabric
        _tamper(ref, 2 * chunk + 7)
        with pytest.raises(CheckpointError, match="chunk 2 from .* does not match its sha256"):
            peer.pull([ref], timeout=10)
    finally:
        peer.close()
        checkpoint.unpublish(ref)


def test_a_failed_registration_names_no_key(provider):
    """A registration the provider refuses (here: a key already in use on the domain) says so without the
    key (regression: fi_mr_reg's error detail carried it)."""
    endpoint = pyfi.ServerEndpoint(provider, bind="127.0.0.1:0")
    try:
        server = endpoint.serve(np.ones(4096, np.uint8))
        key = server.address.key
        lib = pyfi._lib.load()[1]
        with pytest.raises(FabricError) as err:
            endpoint._stack.domain.register(np.ones(4096, np.uint8), access=lib.FI_REMOTE_READ, key=key)
        assert "fi_mr_reg" in str(err.value)
        assert f"{key:x}" not in str(err.value) and str(key) not in str(err.value)
    finally:
        endpoint.close()


def _served_ref(buf: np.ndarray, server, chunk: int, **changes):
    """A ref to `buf` served by `server`, with its real digests: what a publisher that skipped publish()'s
    checks, or a forger holding the address, would hand out."""
    from raydl.checkpoint import layout
    from raydl.checkpoint.ref import CheckpointRef

    ref = CheckpointRef(key="cd" * 16, size=len(buf), chunk_size=chunk, checksums=layout.checksums(buf, chunk),
                        header="{}", holder="forger:1", fabric=server.address)
    return dataclasses.replace(ref, **changes)


def test_bytes_whose_digests_match_but_are_no_safetensors_file_leave_no_file(tmp_path, provider):
    """The digests say the bytes are the holder's, not that they are a file the format takes: a header that
    claims a 1 GiB tensor in no bytes is a CheckpointError naming the holder, checked before the file gets
    its name, so a good file already at the path stays as it was and nothing else is left behind."""
    header = json.dumps({"x": {"dtype": "F32", "shape": [16384, 16384], "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    bad = np.frombuffer(len(header).to_bytes(8, "little") + header, np.uint8).copy()
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.safetensors").write_bytes(b"the good one")
    with pyfi.serve(bad, bind="127.0.0.1:0", provider=provider) as server:
        ref = _served_ref(bad, server, 64)
        with pytest.raises(CheckpointError, match=r"from forger:1 .*is not a usable safetensors file: tensor 'x'"):
            checkpoint.fetch(ref, transport="fabric", into=out / "x.safetensors", timeout=10)
        with pytest.raises(CheckpointError, match="is not a usable safetensors file"):
            checkpoint.fetch(ref, transport="fabric", timeout=10)
    assert os.listdir(out) == ["x.safetensors"] and (out / "x.safetensors").read_bytes() == b"the good one"


def test_into_a_path_gives_tensors_on_the_verified_bytes_whatever_is_put_there_later(tmp_path, provider,
                                                                                     monkeypatch):
    """The tensors of fetch(into=path) are mapped from the verified file itself, not by opening its name
    again: a file another writer puts at that name after the rename does not become the tensors."""
    import torch

    from raydl.checkpoint import target

    state = {"x": torch.full((1024,), 1.0)}
    ref = checkpoint.publish(state, transports=("fabric",), provider=provider, bind="127.0.0.1:0")
    path = tmp_path / "x.safetensors"
    real_fsync_dir = target._fsync_dir

    def swap_then_fsync(directory):  # another writer, between the rename and anything after it
        other = tmp_path / "other"
        checkpoint_bytes = path.read_bytes()
        other.write_bytes(checkpoint_bytes.replace(np.float32(1.0).tobytes(), np.float32(666.0).tobytes()))
        os.replace(other, path)
        real_fsync_dir(directory)

    monkeypatch.setattr(target, "_fsync_dir", swap_then_fsync)
    try:
        got = checkpoint.fetch(ref, transport="fabric", into=path)
        assert torch.equal(got["x"], state["x"])
    finally:
        checkpoint.unpublish(ref)


def test_a_chain_peer_whose_upstream_stops_getting_chunks_gives_up_after_the_timeout(provider):
    """An upstream holder that is alive and serving but whose own pull is stuck (its progress word frozen
    below the end) is a CheckpointError naming it after `timeout`, so the peer falls back to the next
    source, rather than polling that word for ever."""
    import time

    from raydl.checkpoint.fabric import FabricClient, pull

    chunk = 4096
    data = np.arange(4 * chunk // 4, dtype=np.uint32).view(np.uint8)
    region = np.zeros(len(data) + 8, np.uint8)
    region[: len(data)] = data
    region[len(data):].view(np.int64)[0] = 1  # holds 1 chunk of 4, and never more
    client = FabricClient()
    try:
        with pyfi.serve(region, bind="127.0.0.1:0", provider=provider) as server:
            ref = _served_ref(region[: len(data)], server, chunk, progress_at=len(data))
            dst = np.zeros_like(data)
            t0 = time.monotonic()
            with pytest.raises(CheckpointError, match=r"upstream holder forger:1 .* has held 1 of 4 chunks for "
                                                      r"more than 1 s"):
                pull(client, ref, dst, timeout=1.0, chunk_size=chunk, max_inflight=2, progress_at=ref.progress_at,
                     on_done=lambda n: None)
            assert time.monotonic() - t0 < 30
            assert np.array_equal(dst[:chunk], data[:chunk]) and not dst[chunk:].any()
    finally:
        client.close()
