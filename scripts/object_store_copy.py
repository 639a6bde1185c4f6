#!/usr/bin/env python3
"""What returning one batch through Ray's object store costs the actor that makes it: CPU and minor page
faults per batch, against a plain copy of the same bytes in that actor.

    .venv/bin/python scripts/object_store_copy.py                  # the object store at Ray's default size
    .venv/bin/python scripts/object_store_copy.py --store-mib 1024

An actor returns one reused, already faulted-in batch of a train workload's size (256 x 3 x 224 x 224
float32) again and again, while this process keeps three in flight and drops each once it has it, as a rank
does. Ray copies the array once into the node's store; the actor's page faults are its first touches of the
store's pages, and its resident shared memory (psutil) is the store's pages it has written so far, which
its PSS counts. It starts its own local Ray (`address="local"`) and stops it.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import ray

SIZE = 256 * 3 * 224 * 224 * 4


@ray.remote(num_cpus=0, max_concurrency=4)
class _Maker:
    def __init__(self) -> None:
        self.buf = np.ones(SIZE, np.uint8)

    def run(self, k: int) -> dict:
        return {"image": self.buf, "id": np.arange(256)}

    def usage(self) -> tuple[float, int]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, r.ru_minflt

    def shared_mib(self) -> float:
        import psutil

        return psutil.Process().memory_info().shared / 2**20

    def memcpy(self, n: int) -> float:
        dst = np.full(SIZE, 1, np.uint8)  # written once: its pages are in before the clock starts
        t0 = time.process_time()
        for _ in range(n):
            np.copyto(dst, self.buf)
        return (time.process_time() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-mib", type=int, default=0, help="object store size (default: Ray's)")
    parser.add_argument("--batches", type=int, default=40, help="batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    store = args.store_mib << 20 or None
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", object_store_memory=store
    )
    try:
        maker = _Maker.remote()
        ray.get(maker.usage.remote())
        print(
            f"a plain copy of one batch ({SIZE / 2**20:.0f} MiB) in the actor: "
            f"{1e3 * ray.get(maker.memcpy.remote(10)):.1f} ms CPU"
        )
        for rnd in range(args.rounds):
            c0, f0 = ray.get(maker.usage.remote())
            t0 = time.perf_counter()
            refs = [maker.run.remote(k) for k in range(3)]
            for k in range(args.batches):
                ray.get(refs.pop(0))
                if k + 3 < args.batches:
                    refs.append(maker.run.remote(k + 3))
            c1, f1 = ray.get(maker.usage.remote())
            n = args.batches
            shared = ray.get(maker.shared_mib.remote())
            print(
                f"round {rnd}: actor {1e3 * (c1 - c0) / n:.1f} ms CPU and {(f1 - f0) / n:.0f} minor faults a "
                f"batch ({SIZE // 4096} pages), {1e3 * (time.perf_counter() - t0) / n:.1f} ms wall; "
                f"the store's pages it has written: {shared:.0f} MiB ({shared * 2**20 / SIZE:.1f} batches)"
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
