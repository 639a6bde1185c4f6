#!/usr/bin/env python3
"""What faulting fresh anonymous memory in costs here: 4 KiB pages against transparent huge pages.

    .venv/bin/python scripts/fault_cost.py --size 512MiB --rounds 3

Each measurement is a fresh child process that waits --settle seconds (memory freed by the one
before is then back with the host on a VM with free page reporting, as between real fetches),
maps --size bytes, asks for huge pages or not, and faults it all in with MADV_POPULATE_WRITE on
1 or 2 threads. Prints wall seconds and the child's user + system CPU seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import os, sys, threading, time
from raydl.checkpoint.buffers import fresh, populate
size, huge, threads, settle = int(sys.argv[1]), sys.argv[2] == "huge", int(sys.argv[3]), float(sys.argv[4])
time.sleep(settle)
mm = fresh(size, huge)
c0, t0 = os.times(), time.perf_counter()
step = -(-size // threads)
spans = [(mm, i * step, min(step, size - i * step)) for i in range(threads)]
ts = [threading.Thread(target=populate, args=span) for span in spans]
[t.start() for t in ts]
[t.join() for t in ts]
wall, c1 = time.perf_counter() - t0, os.times()
print(f"{wall:.3f} {c1.user - c0.user + c1.system - c0.system:.3f}")
"""


def main() -> int:
    from raydl.bench.checkpoint import parse_size

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=3.0, help="seconds each child waits first")
    args = p.parse_args()
    print(f"{'pages':<8}{'threads':>8}{'wall s':>10}{'cpu s':>10}")
    for _ in range(args.rounds):
        for pages, threads in (("4k", 1), ("huge", 1), ("4k", 2), ("huge", 2)):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.size), pages, str(threads), str(args.settle)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            print(f"{pages:<8}{threads:>8}{out[0]:>10}{out[1]:>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
