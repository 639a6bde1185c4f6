"""`raydl bench listing`'s WebDataset-on-S3 part: shards on a local moto server behind a latency proxy that
counts requests.

The parent (raydl/bench/listing.py) writes N shards of M samples with the
webdataset library's TarWriter, uploads them (and, for the DALI row, a
`NAME.idx` beside each) straight to moto, and starts a `CountingProxy` in a
child process (`python -m raydl.bench._listing_s3 --proxy HOST:PORT DELAY_MS`),
which adds the delay to every request and answers "counts" on its stdin with
the requests it forwarded so far, by kind. Every measurement runs in a fresh
child process (`--measure SPEC`), so none inherits a warm client or cache from
another but through RAYDL_CACHE_DIR, which is the point of the cached row.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from raydl.bench.latency_proxy import LatencyProxy

__all__ = ["CountingProxy", "dali_index", "make_shard", "tiny_jpegs"]

KINDS = ("list", "head", "shard", "idx", "other")
_REQUEST = re.compile(rb"(?:^|\r\n)(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01]\r\n")


def request_kind(method: str, path: str) -> str:
    """A request's kind as the report counts it: a LIST page, a HEAD, a GET of a shard or an .idx, other."""
    if method == "HEAD":
        return "head"
    target, _, query = path.partition("?")
    if method == "GET" and ("list-type=" in query or "prefix=" in query):
        return "list"
    if method == "GET" and target.endswith((".tar", ".tar.gz", ".tgz")):
        return "shard"
    if method == "GET" and target.endswith(".idx"):
        return "idx"
    return "other"


class CountingProxy(LatencyProxy):
    """A LatencyProxy that also counts the HTTP requests it forwards, by kind (`request_kind`).

    Requests are told apart by their request lines in what the client sends:
    the clients here send no bodies through it and never pipeline, so a
    request line only ever starts a chunk or follows a blank line.
    """

    def __init__(self, host: str, port: int, *, delay_s: float) -> None:
        self.counts = dict.fromkeys(KINDS, 0)
        self._count_lock = threading.Lock()
        # LatencyProxy reads what clients send through `_read` only when it delays it: 1 ns is no delay.
        super().__init__(host, port, delay_s=max(delay_s, 1e-9))

    def _read(self, src, chunks, delay_s: float) -> None:  # type: ignore[override]
        try:
            while data := src.recv(1 << 16):
                self._count_waiting(1)
                # counted before it is forwarded: its reply, and what the client does after, come later
                found = _REQUEST.findall(data)
                if found:
                    with self._count_lock:
                        for method, path in found:
                            self.counts[request_kind(method.decode(), path.decode("latin-1"))] += 1
                chunks.put((time.monotonic() + delay_s, data))
        except OSError:
            pass
        finally:
            chunks.put(None)

    def snapshot(self) -> dict[str, int]:
        """Requests so far by kind, and "connections": the client connections accepted so far (a client
        that keeps its connections alive opens about as many as it has threads)."""
        with self._count_lock:
            counts = dict(self.counts)
        with self._lock:
            return {**counts, "connections": self.connections}


def tiny_jpegs(n: int = 8, side: int = 16) -> list[bytes]:
    """`n` distinct small JPEGs (noise, `side` pixels square: ~0.5-1 KB each)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "JPEG", quality=75)
        out.append(buf.getvalue())
    return out


def make_shard(s: int, per_shard: int, jpegs: list[bytes]) -> bytes:
    """Shard `s`: `per_shard` samples (a .jpg and a .cls each), written by webdataset's TarWriter."""
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for i in range(per_shard):
            sink.write(
                {"__key__": f"{s:06d}-{i:05d}", "jpg": jpegs[(s + i) % len(jpegs)], "cls": str(i % 10)}
            )
    return buf.getvalue()


def dali_index(shard: bytes) -> bytes:
    """The DALI `wds2idx` index (v1.2) of a shard: one line per sample of `ext offset size name` quadruples,
    the offset of each member's data (past its headers), as wds2idx writes it."""
    samples: list[list[str]] = []
    last = None
    with tarfile.open(fileobj=io.BytesIO(shard), mode="r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            base = m.name.rsplit("/", 1)[-1]
            key, _, ext = base.partition(".")
            stem = m.name[: len(m.name) - len(base)] + key
            if stem != last:
                samples.append([])
                last = stem
            samples[-1].append(f"{ext} {m.offset_data} {m.size} {m.name}")
    lines = [f"v1.2 {len(samples)}", *(" ".join(s) for s in samples)]
    return ("\n".join(lines) + "\n").encode()


def upload(endpoint: str, bucket: str, objects: dict[str, bytes], env: dict, threads: int = 16) -> None:
    """PUT every object straight to the server (not through the proxy), with the credentials in `env`."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        config=Config(max_pool_connections=threads),
    )
    try:
        client.create_bucket(Bucket=bucket)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), objects.items()))


# -- child processes -----------------------------------------------------------------------------------


class ProxyChild:
    """A CountingProxy in a child process; `counts()` asks it for its counts so far."""

    def __init__(self, upstream: str, delay_ms: float, env: dict) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "raydl.bench._listing_s3",
                "--proxy",
                upstream.removeprefix("http://"),
                str(delay_ms),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self._proc.stdout.readline().strip()}"
        self.pid = self._proc.pid

    def counts(self) -> dict[str, int]:
        self._proc.stdin.write("counts\n")
        self._proc.stdin.flush()
        return json.loads(self._proc.stdout.readline())

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()


def _serve_proxy(upstream: str, delay_ms: str) -> int:
    host, port = upstream.rsplit(":", 1)
    proxy = CountingProxy(host, int(port), delay_s=float(delay_ms) / 1000)
    print(proxy.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "counts":
            print(json.dumps(proxy.snapshot()), flush=True)
    proxy.close()
    return 0


def measure(spec: dict) -> dict:
    """One measurement (in this process): `spec["what"]` is "list" (read_webdataset of `url`, with
    RAYDL_CACHE_DIR=`cache_dir`) or "get" (every URI of `uris` whole, `threads` at a time)."""
    if spec.get("cache_dir"):
        os.environ["RAYDL_CACHE_DIR"] = spec["cache_dir"]
    import raydl

    s3 = raydl.S3Options(endpoint_url=spec["endpoint"])
    if spec["what"] == "get":
        from raydl.storage.s3 import S3Storage

        storage = S3Storage(s3)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(spec["threads"]) as pool:
            got = sum(pool.map(lambda u: len(storage.read(u)), spec["uris"]))
        return {"seconds": time.perf_counter() - t0, "bytes": got, "shards": len(spec["uris"])}
    t0 = time.perf_counter()
    ds = raydl.read_webdataset(spec["url"], s3=s3)
    took = time.perf_counter() - t0
    cat = ds.catalog
    return {"seconds": took, "samples": len(cat), "shards": cat.shards.num_rows, "parts": cat.num_parts}


def run_child(spec: dict, env: dict, timeout_s: float = 3600.0) -> dict:
    """`measure(spec)` in a fresh child process; its result, or {"error": ...}."""
    cmd = [sys.executable, "-m", "raydl.bench._listing_s3", "--measure", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(lines[-1])


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--proxy"]:
        return _serve_proxy(argv[1], argv[2])
    if argv[:1] == ["--measure"]:
        print(json.dumps(measure(json.loads(argv[1]))), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
