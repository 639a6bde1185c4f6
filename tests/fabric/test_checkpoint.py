"""Checkpoint publish/fetch/broadcast between Ray actors on simulated nodes, over loopback fabric."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from raydl import checkpoint
from raydl.checkpoint import layout, peer_actor
from raydl.errors import CheckpointError
from raydl.native import pyfi

torch = pytest.importorskip("torch")
# Ray workers cannot import this test module by name: ship its actor classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not pyfi.available(), reason=f"libfabric unavailable: {pyfi.unavailable_reason()}"),
]


@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes; publishers and peers listen on 127.0.0.1 only."""
    os.environ["RAYDL_CHECKPOINT_BIND"] = "127.0.0.1:0"  # inherited by the nodes' workers
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    os.environ.pop("RAYDL_CHECKPOINT_BIND", None)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w.f32": torch.randn(300, 257, generator=g),
        "w.bf16": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "w.f16.t": torch.randn(40, 30, generator=g).half().t(),  # not contiguous
        "b.i64": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (5, 7, 3), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _other_node(cluster) -> str:
    here = ray.get_runtime_context().get_node_id()
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)


@ray.remote(num_cpus=0)
class Publisher:
    """A process that publishes a checkpoint and keeps serving it."""

    def publish(self, seed, transports=None, chunk_size=checkpoint.DEFAULT_CHUNK):
        self.ref = checkpoint.publish(_state(seed), transports=transports, chunk_size=chunk_size)
        return self.ref

    def die(self):
        os._exit(1)


def test_fetch_between_actors_on_two_nodes(cluster):
    """A state dict of mixed dtypes published on one node is fetched identically on another over fabric."""
    pub = Publisher.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        _other_node(cluster), soft=False)).remote()
    ref = ray.get(pub.publish.remote(1))
    assert ref.transports == ("fabric", "object_store")
    got = checkpoint.fetch(ref)
    assert got.transport == "fabric" and "127.0.0.1" in got.peer
    _assert_same(got, _state(1))
    ray.kill(pub)


@ray.remote(num_cpus=0)
class FreshFetcher:
    """A fresh process that only imports raydl.checkpoint (at start, as a trainer does) and fetches."""

    def __init__(self):
        from raydl import checkpoint  # noqa: F401 - the import is what is tested

    def prefaulted(self):
        """(address, bytes) of each receive buffer faulted in (or faulting) ahead of any fetch."""
        import numpy as np

        from raydl.checkpoint import api

        pool = api._PROCESS.buffers
        with pool._lock:
            mms = [mm for mm, _ in pool._started] + list(pool._free)
        return [(np.frombuffer(mm, np.uint8).ctypes.data, len(mm)) for mm in mms]

    def fetch(self, ref):
        got = checkpoint.fetch(ref)
        lowest = min(t.data_ptr() for t in got.values() if t.numel())
        return {k: v.clone() for k, v in got.items()}, lowest


def test_a_fresh_process_faults_the_last_published_size_in_and_fetches_into_it(cluster):
    """Inside Ray a publish leaves its size in the cluster's KV store; a process that then imports
    raydl.checkpoint faults a receive buffer that large in, in the background, and its first fetch
    lands there, byte for byte the published tensors."""
    ref = checkpoint.publish(_state(9))
    fetcher = FreshFetcher.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        _other_node(cluster), soft=False)).remote()
    deadline = time.monotonic() + 30
    while not (buffers := ray.get(fetcher.prefaulted.remote())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(buffers) == 1 and buffers[0][1] >= ref.size
    got, lowest = ray.get(fetcher.fetch.remote(ref))
    _assert_same(got, _state(9))
    (addr, size), = buffers
    assert addr <= lowest < addr + size  # the tensors sit on the prefaulted buffer
    ray.kill(fetcher)
    checkpoint.unpublish(ref)


def test_every_way_of_faulting_the_receive_buffer_gives_the_same_bytes(cluster, monkeypatch):
    """Each RAYDL_CHECKPOINT_FAULTS way (toucher threads ahead of the reads, huge pages, from the end,
    none, all first) fetches the published tensors byte for byte, into fresh memory each time."""
    from raydl.env import CHECKPOINT_FAULTS

    g = torch.Generator().manual_seed(11)
    state = {"big": torch.randn(3_000_000, generator=g), "small": torch.arange(7)}  # 12 MB: 3 slices
    ref = checkpoint.publish(state, chunk_size=1 << 20)
    for way in CHECKPOINT_FAULTS:
        monkeypatch.setenv("RAYDL_CHECKPOINT_FAULTS", way)
        monkeypatch.setattr(checkpoint.api._PROCESS, "buffers", checkpoint.api.BufferPool(max_free=1))  # fresh
        _assert_same(checkpoint.fetch(ref), state)
    checkpoint.unpublish(ref)


def test_fetch_into_a_file_is_a_valid_safetensors_file(cluster, tmp_path):
    """into=path writes a .safetensors file atomically that safetensors reads back identically."""
    st = pytest.importorskip("safetensors.torch")
    ref = checkpoint.publish(_state(2), chunk_size=64 << 10)
    path = tmp_path / "model.safetensors"
    got = checkpoint.fetch(ref, into=path)
    assert got.path == str(path) and not [p for p in os.listdir(tmp_path) if p.endswith(".part")]
    _assert_same(st.load_file(str(path)), _state(2))
    _assert_same(got, _state(2))
    # publishing a file serves it without copying; fetching it again gives the same tensors
    ref2 = checkpoint.publish(str(path))
    _assert_same(checkpoint.fetch(ref2), _state(2))
    checkpoint.unpublish(ref)
    checkpoint.unpublish(ref2)


def test_object_store_transport_and_auto_choice(cluster):
    """transport='object_store' moves the bytes through Ray; 'auto' prefers fabric and says which it used."""
    ref = checkpoint.publish(_state(3), transports=("fabric", "object_store"))
    a = checkpoint.fetch(ref, transport="object_store")
    b = checkpoint.fetch(ref, transport="auto")
    assert (a.transport, b.transport) == ("object_store", "fabric")
    _assert_same(a, _state(3))
    _assert_same(b, _state(3))
    only_fabric = checkpoint.publish(_state(3), transports=("fabric",))
    with pytest.raises(CheckpointError, match="object store"):
        checkpoint.fetch(only_fabric, transport="object_store")
    checkpoint.unpublish(ref)
    checkpoint.unpublish(only_fabric)


def test_corrupt_chunk_is_detected_naming_peer_and_chunk(cluster, tmp_path):
    """A chunk whose bytes do not match its checksum fails the fetch, naming the chunk; no file is left."""
    src = tmp_path / "src"
    src.mkdir()
    path = src / "model.safetensors"
    path.write_bytes(layout.pack(_state(4)).tobytes())
    ref = checkpoint.publish(str(path), chunk_size=64 << 10)  # served from a shared mapping of the file
    with open(path, "r+b") as f:  # corrupt chunk 1 after its checksum was taken
        f.seek(70_000)
        byte = f.read(1)
        f.seek(70_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out"
    out.mkdir()
    for transport in ("fabric", "object_store"):
        with pytest.raises(CheckpointError, match=r"chunk 1 from .*127\.0\.0\.1.* is corrupt"
                           if transport == "fabric" else "chunk 1 from object store"):
            checkpoint.fetch(ref, into=out / "bad.safetensors", transport=transport)
        assert os.listdir(out) == []
    checkpoint.unpublish(ref)


def test_unpublish_revokes(cluster):
    """After unpublish, fetching over either transport is a CheckpointError saying so, within seconds."""
    ref = checkpoint.publish(_state(5))
    checkpoint.unpublish(ref)
    checkpoint.unpublish(ref)  # idempotent
    for transport in ("fabric", "object_store"):
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match="unpublished"):
            checkpoint.fetch(ref, transport=transport)  # the default 60 s timeout: the holder says why first
        assert time.monotonic() - t0 < 10, transport


def test_publisher_death_is_an_error_naming_it_within_5s(cluster, tmp_path):
    """The publisher dies: fetch raises naming the peer within 5 s (default timeout) and leaves no partial file."""
    pub = Publisher.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        _other_node(cluster), soft=False)).remote()
    ref = ray.get(pub.publish.remote(6))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pub.die.remote(), timeout=60)  # fails once its process is gone
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"127\.0\.0\.1.*dead|dead.*127\.0\.0\.1"):
        checkpoint.fetch(ref, into=tmp_path / "x.safetensors")
    assert time.monotonic() - t0 < 5
    assert os.listdir(tmp_path) == []


@ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAYDL_DISABLE_FABRIC": "1"}})
def _fetch_without_fabric(ref, transport):
    from raydl.native import pyfi

    assert not pyfi.available()
    got = checkpoint.fetch(ref, transport=transport)
    return got.transport, {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in got.items()}


def test_a_node_without_fabric_fetches_through_the_object_store(cluster):
    """A fabric publisher (driver or actor) serves a fabric-less fetcher through the object store, on demand."""
    expected = {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in _state(11).items()}
    pub = Publisher.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        _other_node(cluster), soft=False)).remote()
    refs = [checkpoint.publish(_state(11)), ray.get(pub.publish.remote(11))]
    for ref, transport in zip(refs, ("auto", "object_store"), strict=True):
        assert ref.transports == ("fabric", "object_store")
        assert ray.get(_fetch_without_fabric.remote(ref, transport)) == ("object_store", expected)
    checkpoint.unpublish(refs[0])
    ray.kill(pub)


def test_broadcast_to_three_peers(cluster):
    """broadcast() gets the checkpoint to 3 peers over a chain; every copy equals the original."""
    ref = checkpoint.publish(_state(7), chunk_size=32 << 10)
    peers = [peer_actor(n) for n in [_other_node(cluster), None, None]]
    results = checkpoint.broadcast(ref, peers)
    assert [r["source"] for r in results[1:]] == [results[0]["holder"], results[1]["holder"]]
    expected = {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in _state(7).items()}
    for p in peers:
        assert ray.get(p.summary.remote(ref.key)) == expected
    for p in peers:
        ray.get(p.close.remote())
        ray.get(p.close.remote())  # idempotent
        ray.kill(p)
    checkpoint.unpublish(ref)


def test_broadcast_survives_a_dead_holder(cluster):
    """When a peer in the chain dies, the peers after it finish from the publisher."""
    ref = checkpoint.publish(_state(8), chunk_size=16 << 10)
    peers = [peer_actor() for _ in range(3)]
    refs = ray.get([p.prepare.remote(ref) for p in peers])
    ray.kill(peers[0])  # holds nothing and serves nothing now
    out = ray.get(peers[1].pull.remote([refs[0], ref], timeout=5))
    assert out["retried"] == 1 and out["source"] == ref.holder
    expected = {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in _state(8).items()}
    assert ray.get(peers[1].summary.remote(ref.key)) == expected
    for p in peers[1:]:
        ray.get(p.close.remote())
        ray.kill(p)
    checkpoint.unpublish(ref)


def test_checksums_cover_every_chunk():
    """The ref carries one XXH3-64 digest per chunk of the laid-out bytes."""
    import xxhash

    buf = layout.pack(_state(9))
    sums = layout.checksums(buf, 1000)
    assert len(sums) == -(-len(buf) // 1000) and sums[-1] == xxhash.xxh3_64_intdigest(buf[len(sums) * 1000 - 1000:])
    header, start = layout.parse_header(buf)
    assert start % 8 == 0 and start + max(v["data_offsets"][1] for v in header.values()) == len(buf)


def test_fetch_onto_cuda(cluster):
    """device='cuda' puts the fetched tensors on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    ref = checkpoint.publish(_state(10))
    got = checkpoint.fetch(ref, device="cuda")
    assert all(t.is_cuda for t in got.values())
    _assert_same({k: v.cpu() for k, v in got.items()}, _state(10))
    checkpoint.unpublish(ref)


def _big_state(mib: int) -> dict:
    return {"w": torch.arange(mib << 18, dtype=torch.float32)}


def test_broadcast_pipelines_under_a_link_limit(cluster):
    """With every link capped (0.1 Gbit/s), a chain broadcast to 4 peers pipelines: each peer has its first
    window before its upstream has its last (the speed-up itself is `raydl bench checkpoint`'s to measure)."""
    ref = checkpoint.publish(_big_state(16), chunk_size=1 << 20)
    peers = [peer_actor() for _ in range(4)]
    ray.get([p.name.remote() for p in peers])
    try:
        results = checkpoint.broadcast(ref, peers, link_gbps=0.1, window_bytes=1 << 20)
        assert [r["source"] for r in results[1:]] == [r["holder"] for r in results[:-1]]  # a chain
        link_s = ref.size / (0.1e9 / 8)  # 1.3 s: far longer than a hop's set-up
        for r in results:  # the limit holds: the link, not the CPU, sets the pace (16 windows, the first free)
            assert r["last_window_at"] - r["first_window_at"] > 0.8 * link_s * 15 / 16, r
        for up, down in zip(results, results[1:], strict=False):  # a chain that waited for whole copies would not overlap
            assert down["first_window_at"] < up["last_window_at"], (up, down)
        expected = {"w": ("torch.float32", (16 << 18,), float(_big_state(16)["w"].double().sum()))}
        assert ray.get(peers[3].summary.remote(ref.key)) == expected
    finally:
        for p in peers:
            ray.get(p.close.remote())
            ray.kill(p)
        checkpoint.unpublish(ref)


def test_broadcast_falls_back_to_the_publisher_under_a_link_limit(cluster):
    """A holder killed mid-transfer: the peer after it finishes from the publisher, the next from that peer."""
    ref = checkpoint.publish(_big_state(16), chunk_size=1 << 20)
    peers = [peer_actor() for _ in range(3)]
    try:
        refs = ray.get([p.prepare.remote(ref) for p in peers])
        from raydl.checkpoint.chain import chain_sources

        # 16 MiB at 0.1 Gbit/s is 1.3 s a hop: peer 0 cannot be done when it is killed 0.5 s in
        # (at 0.5 Gbit/s it could be, and then nobody needs to fall back).
        calls = [p.pull.remote(src, timeout=30, window_bytes=1 << 20, link_gbps=0.1)
                 for p, src in zip(peers, chain_sources(ref, refs), strict=True)]
        held = _wait_for_chunks(refs[0], 1)  # peer 0 holds part of it now
        ray.kill(peers[0])
        assert held < 16  # killed mid-transfer: 16 chunks of 1 MiB
        second, third = ray.get(calls[1:], timeout=60)
        assert second["retried"] == 1 and second["source"] == ref.holder
        assert third["source"] == refs[1].holder
        expected = {"w": ("torch.float32", (16 << 18,), float(_big_state(16)["w"].double().sum()))}
        assert ray.get(peers[2].summary.remote(ref.key)) == expected
    finally:
        for p in peers[1:]:
            ray.get(p.close.remote())
            ray.kill(p)
        checkpoint.unpublish(ref)


def _wait_for_chunks(ref, at_least: int, timeout_s: float = 30.0) -> int:
    """Wait until the peer holding `ref` (its prepared copy) has verified `at_least` chunks; returns how many.
    Its progress word sits after the bytes in the region it serves, which any client may read."""
    word = np.zeros(1, np.int64)
    deadline = time.monotonic() + timeout_s
    with pyfi.connect(ref.fabric) as conn:
        while True:
            conn.read_into(word, offset=ref.progress_at, timeout=10)
            if word[0] >= at_least:
                return int(word[0])
            assert time.monotonic() < deadline, f"the peer holds {word[0]} chunks after {timeout_s} s"
            time.sleep(0.005)


@ray.remote(num_cpus=0)
class Prober:
    """A Ray worker that reports where its publisher listens, or fetches into a path."""

    def publish_and_listen(self):
        import psutil

        def listening():
            conns = psutil.Process().net_connections(kind="inet")
            return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}

        ref = checkpoint.publish(_state(9), transports=("fabric",))
        during = listening()
        checkpoint.unpublish(ref)
        return ray.util.get_node_ip_address(), ref.fabric.host, sorted(during - listening())

    def fetch_into(self, ref, path, transport):
        try:
            got = checkpoint.fetch(ref, transport=transport, into=path)
        except CheckpointError as exc:
            return f"CheckpointError: {exc}"
        return f"fetched {len(got)} tensors"


def test_inside_ray_the_publisher_listens_only_on_the_node_address(cluster):
    """With no RAYDL_CHECKPOINT_BIND, a publisher inside Ray listens on Ray's node address only (never
    0.0.0.0), and not at all once it has unpublished."""
    prober = Prober.options(runtime_env={"env_vars": {"RAYDL_CHECKPOINT_BIND": ""}}).remote()
    node_ip, host, ours = ray.get(prober.publish_and_listen.remote(), timeout=120)
    assert host == node_ip
    assert ours and {ip for ip, _ in ours} == {node_ip}, ours  # gone after unpublish, so it was ours
    ray.kill(prober)


def test_a_full_disk_on_the_object_store_path_is_an_error_not_a_crash(cluster, tmp_path):
    """A fetch through the object store into a 1 MiB tmpfs is a CheckpointError naming the path and the
    free space; the worker lives and nothing is left (regression: SIGBUS killed the worker)."""
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        ref = checkpoint.publish({"w": torch.ones(1 << 20)})  # 4 MiB
        prober = Prober.remote()
        for transport in ("object_store", "fabric"):
            out = ray.get(prober.fetch_into.remote(ref, str(small / "x.safetensors"), transport), timeout=60)
            assert out.startswith("CheckpointError: ") and str(small / "x.safetensors") in out, out
            assert "its filesystem has 1048576 bytes free (No space left on device)" in out, out
            assert os.listdir(small) == []
        ray.kill(prober)
        checkpoint.unpublish(ref)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
