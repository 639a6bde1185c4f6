"""Time S3 reads from a server on 127.0.0.1 that sends one byte every 0.5 s.

    .venv/bin/python scripts/slow_drip_read.py

Each case reads one range through raydl's S3Storage with S3Options(timeout_s=1.0, retries=...) and
prints how long it took and how it ended. A case is given up on after `--cap` seconds (the read is left
running in a daemon thread: the old code has no bound of its own).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "s3"))
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from slow_drip import SlowDrip  # noqa: E402

import raydl  # noqa: E402
from raydl.storage.s3 import S3Storage  # noqa: E402


def _case(name: str, payload: bytes, length: int, cap: float, retries: int, **drip) -> None:
    with SlowDrip(payload, **drip) as server:
        storage = S3Storage(raydl.S3Options(endpoint_url=server.url, timeout_s=1.0, retries=retries))
        out: dict = {}

        def read() -> None:
            try:
                out["data"] = storage.read_range("s3://bucket/key", 0, length)
            except Exception as exc:  # noqa: BLE001 - printed
                out["error"] = f"{type(exc).__name__}: {exc}"

        t0 = time.monotonic()
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(cap)
        took = time.monotonic() - t0
        if thread.is_alive():
            how = f"still reading after {cap:.0f} s (given up)"
        elif "error" in out:
            how = out["error"]
        else:
            how = f"read {len(out['data'])} bytes"
        print(f"{name}: {took:.2f} s, {server.connections} connection(s): {how}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=float, default=30.0, help="seconds after which a case is given up on")
    args = ap.parse_args()
    small = b"0123456789" * 100
    _case("12 B, every connection drips, retries=1", small, 12, args.cap, 1)
    _case("12 B, every connection drips, retries=3", small, 12, args.cap, 3)
    _case("12 B, first connection drips, retries=3", small, 12, args.cap, 3, stall=lambda n: n == 0)
    _case("12 B, headers drip, retries=1", small, 12, args.cap, 1, phase="headers")
    big = bytes(16 << 20)
    _case("16 MiB, 4 KiB every 0.5 s, retries=1", big, 16 << 20, args.cap, 1, drip_bytes=4096)


if __name__ == "__main__":
    main()
