"""What several peers set up the same way: a fresh local Ray, raydl's Ray (one node or simulated nodes), and
torch's workers. A leaf that the workload modules (peers.py, _clip.py, _tokens.py) import."""

from __future__ import annotations

import contextlib

from raydl.bench._clock import EpochClock, Measurement, PeerSpec
from raydl.env import local_ray_config

__all__ = ["first_batch_phases", "ray_init", "raydl_epochs", "raydl_ray", "torch_worker_init"]


def ray_init(cpus: int, tries: int = 3) -> None:
    """A fresh local Ray (never a `ray start` cluster), without the dashboard, whose processes would eat the
    CPU budget. Retried: on an overloaded machine the raylet can miss Ray's fixed 30 s start-up deadline."""
    import ray

    for attempt in range(tries):
        try:
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                logging_level="ERROR",
                _system_config=local_ray_config(),  # as raydl's own local Ray (raydl.env)
            )
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(exc) or attempt + 1 == tries:
                raise
            ray.shutdown()


@contextlib.contextmanager
def raydl_ray(spec: PeerSpec):
    """Ray for the raydl rows: a local instance, or with spec.nodes > 1 a local `ray.cluster_utils.Cluster`
    of that many nodes sharing the CPU budget (each max(1, cpus // nodes) CPUs; the driver on the head), or
    with spec.ray_address a connection to a cluster that is already running."""
    import ray

    if spec.ray_address:  # a cluster started before this process (--running-cluster): connect only
        ray.init(address=spec.ray_address, logging_level="ERROR")
        try:
            yield
        finally:
            ray.shutdown()
        return
    if spec.nodes <= 1:
        ray_init(spec.cpus)
        try:
            yield
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    per_node = max(1, spec.cpus // spec.nodes)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": per_node,
            "include_dashboard": False,
            "_system_config": local_ray_config(),
        },
    )
    try:
        for _ in range(spec.nodes - 1):
            cluster.add_node(num_cpus=per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def torch_worker_init(_worker_id: int) -> None:
    import torch

    torch.set_num_threads(1)  # one process per CPU already; intra-op threads would oversubscribe


def first_batch_phases(clock: EpochClock, loader, t0: float, t1: float, t2: float) -> None:
    """Where raydl's first batch's time went, into clock.extra["first_batch_phases_s"] once: the listing
    (t0 to t1), loader() (t1 to t2), then either the batch a worker made, or the first task planned, made in
    the driver while the workers started and handed over. Call it as each batch arrives."""
    import time

    if "first_batch_phases_s" in clock.extra:
        return
    now = time.perf_counter()
    phases = {"listing": t1 - t0, "loader()": t2 - t1}
    task = loader.first_local_batch  # made in the driver while the workers started
    if task is None:  # made by a worker
        phases["batch"] = now - t2
    else:
        phases.update({"to task": task[0] - t2, "task": task[1] - task[0], "hand-over": now - task[1]})
    clock.extra["first_batch_phases_s"] = phases


def raydl_epochs(loader, spec: PeerSpec, clock: EpochClock, timed, *, torch: bool = False) -> Measurement:
    """Rank 0 of `loader` for spec.epochs epochs, each batch timed by `clock` on `timed(batch)` (which may
    check the batch first); then the loader's memory and the batches the driver made. Shuts the loader down.
    torch: batches from iter_torch_batches, else iter_batches."""
    try:
        it = loader.iterator(0)
        for epoch in range(spec.epochs):
            for batch in it.iter_torch_batches() if torch else it.iter_batches():
                clock.batch(timed(batch))
            if epoch == 0 and spec.epochs > 1:
                # The coordinator starts COORDINATOR_DELAY_S after the workers: after a short first epoch,
                # its one-off start would land in the later epochs. refresh() starts it now, untimed.
                loader.refresh()
                clock.resume_later()
        result = clock.result()
        clock.extra["memory"] = loader.memory()
        clock.extra["driver_batches"] = it.stats().driver_batches
        return result
    finally:
        loader.shutdown()
