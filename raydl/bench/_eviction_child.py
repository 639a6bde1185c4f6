"""One process of `raydl bench cache --eviction`: fills a node cache folder, evicts from it, or writes beside
the eviction, and prints one JSON line.

Run by path with PYTHONPATH naming the checkout to measure (this one, or another): it uses only what
every raydl's node cache has, `NodeCache(path, max_bytes).put(uri, etag, offset, length, data)`, and reports
which `node_cache.py` it imported.

    python _eviction_child.py fill  PATH N BYTES            N entries of BYTES bytes (fsync off: set-up only)
    python _eviction_child.py evict PATH MAX BYTES GO STOP  one write into the full cache: the pass it starts
    python _eviction_child.py write PATH MAX BYTES GO STOP  writes every 5 ms from GO's appearance to STOP's
"""

from __future__ import annotations

import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != _HERE
]  # not raydl/bench's modules as top-level


def _status(field: str) -> int:
    """/proc/self/status's `field` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    """Start VmHWM again from the present RSS (Linux: clear_refs 5); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _wait_for(path: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.001)


def main(argv: list[str]) -> dict:
    from raydl.storage import node_cache
    from raydl.storage.node_cache import NodeCache

    mode, path = argv[0], argv[1]
    out: dict = {"mode": mode, "code": node_cache.__file__}
    if mode == "fill":
        n, size = int(argv[2]), int(argv[3])
        os.fsync = lambda fd: None  # the set-up writes its entries without waiting for the disk
        cache = NodeCache(path, 1 << 62)
        data = b"x" * size
        t0 = time.perf_counter()
        for i in range(n):
            cache.put(f"s3://bench/{i:09d}", "e", 0, size, data)
        out["seconds"] = time.perf_counter() - t0
        with open(os.path.join(path, "state"), "rb") as f:
            out["total"] = int(f.read().split()[0])
        return out
    max_bytes, size, go, stop = int(argv[2]), int(argv[3]), argv[4], argv[5]
    cache = NodeCache(path, max_bytes)
    data = b"y" * size
    if mode == "evict":
        out["peak_reset"] = _reset_peak()
        out["rss_before"] = _status("VmRSS")
        open(go, "w").close()
        t0 = time.perf_counter()
        out["evicted"] = cache.put("s3://bench/evictor", "e", 0, size, data)
        out["pass_s"] = time.perf_counter() - t0
        out["peak_rss"] = _status("VmHWM")
        time.sleep(0.5)  # the other writer goes on a little after the pass
        open(stop, "w").close()
        return out
    _wait_for(go)
    time.sleep(0.2)  # the evicting process's write starts first: it is the one that evicts
    waits, left_out, j = [], 0, 0
    while not os.path.exists(stop):
        t0 = time.perf_counter()
        got = cache.put(f"s3://bench/w{os.getpid()}-{j}", "e", 0, size, data)
        waits.append(time.perf_counter() - t0)
        left_out += got is None
        j += 1
        time.sleep(0.005)
    waits.sort()
    out.update(
        puts=len(waits),
        left_out=left_out,
        longest_s=waits[-1] if waits else None,
        p99_s=waits[int(0.99 * (len(waits) - 1))] if waits else None,
        median_s=waits[len(waits) // 2] if waits else None,
    )
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
