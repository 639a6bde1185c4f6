"""Raw read rate of the transfer engine over loopback, for the checkpoint benchmark.

    python -m raydl.native.pyfi._bench --size 256M --provider 'tcp;ofi_rxm'

Serves `size` bytes and pulls them with read_into into another buffer in the
same process (server thread + client), timing only the read; the first read
warms up the connection (rxm connects on first use) and is not counted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raydl.native.pyfi._client import connect
from raydl.native.pyfi._server import serve


def raw_read_rate(size: int, chunk: int, inflight: int, provider: str | None, repeats: int = 3) -> float:
    """GB/s (1e9 bytes/s, best of `repeats`) of read_into of `size` bytes in
    `chunk`-byte reads with `inflight` outstanding, over `provider` on 127.0.0.1."""
    src = np.empty(size, dtype=np.uint8)
    src[::4096] = (np.arange(len(src[::4096])) % 251).astype(np.uint8)  # fault in every page
    dst = np.ones(size, dtype=np.uint8)  # faulted in: time the transfer, not page faults
    best = float("inf")
    with serve(src, provider=provider, bind="127.0.0.1:0") as server, connect(server.address) as conn:
        conn.read_into(dst[: min(size, chunk)], chunk_size=chunk, max_inflight=inflight)  # warm up
        for _ in range(repeats):
            start = time.perf_counter()
            conn.read_into(dst, chunk_size=chunk, max_inflight=inflight, timeout=60.0)
            best = min(best, time.perf_counter() - start)
    if not np.array_equal(src[::4096], dst[::4096]):
        raise AssertionError("read_into returned different bytes")
    return size / best / 1e9


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=_size, default=256 << 20)
    parser.add_argument("--chunk", type=_size, default=4 << 20)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--provider", action="append", help="repeatable; default: tcp;ofi_rxm and sockets")
    args = parser.parse_args(argv)
    for provider in args.provider or ["tcp;ofi_rxm", "sockets"]:
        rate = raw_read_rate(args.size, args.chunk, args.inflight, provider, repeats=args.repeats)
        print(
            f"{provider:<12} {args.size / 2**20:.0f} MiB, chunks {args.chunk / 2**20:g} MiB, "
            f"{args.inflight} in flight: {rate:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
