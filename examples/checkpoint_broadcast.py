"""A checkpoint broadcast peer to peer to actors on several nodes.

    python examples/checkpoint_broadcast.py [--nodes 3] [--mib 16]     # simulated nodes on this machine
    python examples/checkpoint_broadcast.py --address auto              # the nodes of a running cluster

A "trainer" actor on the first node publishes its weights once
(`raydl.checkpoint.publish`); a checkpoint peer on every other node receives
them through `checkpoint.broadcast`, a chain in which each peer serves on what
it already holds, so the publisher sends the bytes once. Each peer's copy is
then compared with the trainer's, tensor by tensor, without moving them again.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl import checkpoint


class Trainer:
    """Stands in for rank 0 of a training job: it holds the weights and serves them."""

    def __init__(self, mib: int) -> None:
        torch.manual_seed(0)
        rows = max(1, mib * (1 << 20) // 4 // 1024)
        self.state = {
            "layer1.weight": torch.randn(rows, 1024),
            "layer1.bias": torch.zeros(1024),
            "step": torch.tensor([1000]),
        }

    def publish(self):
        return checkpoint.publish(self.state)

    def summary(self) -> dict:
        return {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in self.state.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3, help="simulated nodes (ignored with --address)")
    parser.add_argument("--mib", type=int, default=16, help="size of the state dict")
    parser.add_argument("--address", help="an existing cluster (auto, host:port)")
    args = parser.parse_args()
    cluster = None
    if args.address:
        ray.init(address=args.address)
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster()
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=1, object_store_memory=128 << 20, include_dashboard=False)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        trainer = (
            ray.remote(Trainer)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0], soft=False))
            .remote(args.mib)
        )
        ref = ray.get(trainer.publish.remote())
        peers = [checkpoint.peer_actor(n) for n in nodes[1:]]
        t0 = time.perf_counter()
        results = checkpoint.broadcast(ref, peers)
        seconds = time.perf_counter() - t0
        want = ray.get(trainer.summary.remote())
        for peer, res in zip(peers, results, strict=True):
            assert ray.get(peer.summary.remote(ref.key)) == want, f"peer {res['holder']} holds other bytes"
        how = "fabric chain" if results and results[0].get("ref") is not None else "object store"
        print(
            f"broadcast {ref.size / 2**20:.1f} MiB from node {nodes[0][:8]} to {len(peers)} peers on other "
            f"nodes in {seconds:.2f} s over the {how}; every copy matches the trainer's"
        )
        for res in results:
            print(f"  {res['holder']}: read from {res['source']} in {res['seconds']:.2f} s")
        for p in peers:
            ray.get(p.close.remote())
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
