"""The loader coordinator: one actor per loader that owns the loader workers.

Every copy of a Loader (the driver's, and the handles Ray Train workers
unpickle) asks this one actor for the current workers and reports dead ones to
it, so a lost actor is replaced once, not once per rank, and nodes that join
get their actors once. It stays off the data path: when its worker list
changes it tells the workers the list's new version, every batch carries that
version back to its rank, and only a rank holding an older list calls here
(one call per rank per change). It is a plain class; `start_coordinator` applies
`ray.remote` and starts it. The first workers are started by the Loader itself,
before this actor (which the Loader starts a few seconds later, or when a call needs it), and handed to
it; later ones it starts itself.

What it has to say (a worker died and is replaced, a node is gone, a worker did
not start) it logs here and also keeps as numbered events that every Loader
copy fetches with the workers and logs in its own process, so the warnings
reach the driver even when Ray does not forward actor logs (log_to_driver=False).
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl.actors.launch import READY_TIMEOUT_S, free_cpus, launch_workers, live_nodes, remote_class
from raydl.options import LoaderConfig
from raydl.plan import scheduling
from raydl.plan.scheduling import WorkerInfo

logger = logging.getLogger(__name__)

__all__ = ["LoaderCoordinator", "start_coordinator"]

REFRESH_S = 5.0  # how often the coordinator looks for joined nodes
# how long a node where a worker died gets no new worker: Ray may still list a lost node alive meanwhile
LOST_NODE_S = 120.0
MAX_EVENTS = 100  # the newest warnings kept for Loader copies to fetch


class LoaderCoordinator:
    """Keeps `num_workers` workers on each eligible node and replaces dead ones (once).

    It holds the worker spec and the catalog as ObjectRefs (each wrapped in a one-item
    list, so that Ray passes the reference rather than the value) and never unpickles
    them: its process imports ray and this module's few dependencies, not numpy,
    pyarrow or the decoders, and so starts in a fraction of the CPU a worker needs.
    """

    def __init__(
        self, spec_ref: list, catalog_ref: list, config: LoaderConfig, started: list | None = None
    ) -> None:
        self._spec = spec_ref[0]  # the WorkerSpec's ObjectRef, handed on to the workers it starts
        self._catalog_ref = catalog_ref[0]  # wrapped in a list so Ray passes the reference, not the catalog
        self._config = config
        self._lock = threading.Lock()
        self._workers: list[WorkerInfo] = []
        self._dead: set[str] = set()  # names reported dead
        # nodes where a worker died, and when: Ray may still list them alive for a while (LOST_NODE_S)
        self._lost_nodes: dict[str, float] = {}
        self._version = 0
        self._events: list[tuple[int, str]] = []
        self._event_seq = 0
        self._replacing: list[threading.Thread] = []
        self._replacing_on: dict[str, int] = {}  # replacements starting, per node: placed already
        self._closed = False
        self._short: dict[str, int] = {}  # nodes last found without room (warned once per change)
        # Workers the Loader started with this actor: (handle, node_id). Counted as placed at once,
        # so that the first refresh does not start more of them.
        self._starting = list(started or [])
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raydl-refresh", daemon=True)
        self._thread.start()

    # -- what iterators call -------------------------------------------------------------
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def workers(self) -> tuple[int, list[WorkerInfo], list[tuple[int, str]]]:
        """(version, live workers, recent warnings as (sequence number, message))."""
        with self._lock:
            return self._version, list(self._workers), list(self._events)

    def report_dead(self, name: str) -> tuple[int, list[WorkerInfo], list[tuple[int, str]]]:
        """Drop the named worker and start its replacement in the background. Idempotent."""
        with self._lock:
            dead = next((w for w in self._workers if w.name == name), None)
            if dead is not None and not self._closed:
                self._dead.add(name)
                self._workers.remove(dead)
                self._lost_nodes[dead.node_id] = time.monotonic()
                self._version += 1
                self._announce()
                self._warn(f"raydl: loader worker {dead.name} on node {dead.node_id[:8]} died; replacing it")
                t = threading.Thread(target=self._replace, args=(dead,), daemon=True)
                self._replacing.append(t)
                t.start()
        if dead is not None:  # reported dead while it may still live (unreachable for a while): never two
            try:
                ray.kill(dead.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        return self.workers()

    def refresh_now(self) -> tuple[int, list[WorkerInfo], list[tuple[int, str]]]:
        """Wait for replacements under way, start workers on nodes that lack them, and wait for those."""
        self._started.wait(READY_TIMEOUT_S)
        with self._lock:
            replacing, self._replacing = self._replacing, []
        for t in replacing:
            t.join(READY_TIMEOUT_S)
        self._start_missing()
        return self.workers()

    def shutdown(self) -> list[WorkerInfo]:
        """Kill every worker; returns them so the caller can wait for them to be gone."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
            starting, self._starting = self._starting, []
            self._version += 1
        for h in [w.handle for w in workers] + [h for h, _node in starting]:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        return workers

    # -- mechanism -----------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        """Log here and keep for the Loader copies to log in their processes. Call with the lock held."""
        logger.warning("%s", message)
        self._event_seq += 1
        self._events = (self._events + [(self._event_seq, message)])[-MAX_EVENTS:]
        self._version += 1  # so that the ranks fetch the list, and with it this warning
        self._announce()

    def _run(self) -> None:
        if self._starting:
            self._add(self._await([h for h, _node in self._starting]))
            with self._lock:
                self._starting = []
        self._started.set()
        while not self._closed:
            try:
                self._start_missing()
            except Exception as exc:  # noqa: BLE001 - a failed refresh is retried next period
                with self._lock:
                    self._warn(f"raydl: refreshing loader workers failed: {type(exc).__name__}: {exc}")
            time.sleep(REFRESH_S)

    def _eligible(self) -> list[scheduling.NodeInfo]:
        c = self._config
        nodes = live_nodes()
        ok = set(
            scheduling.eligible_nodes(nodes, cpus_per_worker=c.cpus_per_worker, node_resource=c.node_resource)
        )
        return [n for n in nodes if n.node_id in ok]

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self._workers:
            counts[w.node_id] = counts.get(w.node_id, 0) + 1
        for _h, node in self._starting:
            counts[node] = counts.get(node, 0) + 1
        for node, n in self._replacing_on.items():
            counts[node] = counts.get(node, 0) + n
        return counts

    def _launch(self, node: scheduling.NodeInfo, count: int, *, soft: bool) -> list:
        return launch_workers(
            self._spec, self._catalog_ref, self._config, node.node_id, count, node_cpus=node.cpus, soft=soft
        )

    def _await(self, handles: list) -> list[WorkerInfo]:
        """Workers that came up; ones that died starting are left out, ones still pending killed."""
        refs = [h.ready.remote() for h in handles]
        _ready, pending = ray.wait(refs, num_returns=len(refs), timeout=READY_TIMEOUT_S)
        out = []
        for h, ref in zip(handles, refs, strict=True):
            if self._closed:  # shut down while it started: nothing to say
                ray.kill(h, no_restart=True)
                continue
            if ref in pending:
                with self._lock:
                    self._warn(
                        f"raydl: a loader worker did not start within {READY_TIMEOUT_S:.0f} s; "
                        "giving up on it (is its node short of CPUs or memory?)"
                    )
                ray.kill(h, no_restart=True)
                continue
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                with self._lock:
                    self._warn(f"raydl: a loader worker died before this coordinator took it over: {exc}")
                continue
            out.append(WorkerInfo(h, info["node_id"], info["name"], info["node_ip"]))
        return out

    def _add(self, new: list[WorkerInfo]) -> None:
        with self._lock:
            if self._closed:
                for w in new:
                    ray.kill(w.handle, no_restart=True)
                return
            self._workers.extend(new)
            self._version += 1
            self._announce()

    def _announce(self) -> None:
        """Tell every worker the list's version (under the lock); their batches carry it to the ranks."""
        for w in self._workers:
            try:
                w.handle.set_membership.remote(self._version)
            except Exception:  # noqa: BLE001 - a dead worker is found and replaced through the ranks
                pass

    def _start_missing(self) -> None:
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            self._lost_nodes = {n: t for n, t in self._lost_nodes.items() if now - t < LOST_NODE_S}
            eligible = {n.node_id: n for n in self._eligible() if n.node_id not in self._lost_nodes}
            deficit = scheduling.placement_deficit(list(eligible), self._counts(), self._config.num_workers)
        if deficit and self._config.cpus_per_worker > 0:
            free = free_cpus()
            if free is not None:
                fits = scheduling.fit_to_room(deficit, free, self._config.cpus_per_worker)
                short = {n[:8]: k - fits.get(n, 0) for n, k in deficit.items() if fits.get(n, 0) < k}
                if short and short != self._short:
                    with self._lock:
                        self._warn(
                            f"raydl: no room yet for {sum(short.values())} loader worker(s) reserving "
                            f"{self._config.cpus_per_worker:g} CPUs on nodes {short}; retrying every "
                            f"{REFRESH_S:.0f} s"
                        )
                self._short = short
                deficit = fits
        if deficit:
            handles = [h for node, k in deficit.items() for h in self._launch(eligible[node], k, soft=False)]
            self._add(self._await(handles))

    def _replace(self, dead: WorkerInfo) -> None:
        with self._lock:
            nodes = {n.node_id: n for n in self._eligible()}
            alive = set(nodes)
            gone = [w for w in self._workers if w.node_id not in alive]
            if gone:
                self._warn(
                    f"raydl: node(s) {sorted({w.node_id[:8] for w in gone})} are gone; dropping their "
                    f"{len(gone)} loader worker(s)"
                )
            self._workers = [w for w in self._workers if w.node_id in alive]  # workers of dead nodes too
            # every worker lost gets a replacement: the one reported, and those its dead node took with it
            lost = [dead, *(w for w in gone if w.name != dead.name)]
            self._dead.update(w.name for w in lost)
            placed = []
            for w in lost:
                # Prefer another node: the dead worker's node may be dying (Ray notices a lost node late);
                # the replacements placed so far count where they go
                others = sorted(alive - {w.node_id}) or sorted(alive)
                node = scheduling.replacement_node(others, self._counts())
                if node is None:
                    self._warn(f"raydl: no live node can host a replacement for loader worker {w.name}")
                    continue
                self._replacing_on[node] = self._replacing_on.get(node, 0) + 1
                placed.append((w, node))
        try:
            launched = [(w, node, self._launch(nodes[node], 1, soft=True)) for w, node in placed]
            for w, node, handles in launched:
                new = self._await(handles)
                with self._lock:
                    for n in new:
                        self._warn(f"raydl: loader worker {n.name} on node {n.node_id[:8]} replaces {w.name}")
                self._add(new)
                with self._lock:
                    self._replacing_on[node] -= 1
                placed.remove((w, node))
        finally:
            with self._lock:  # those not started (a launch that failed)
                for _w, node in placed:
                    self._replacing_on[node] -= 1


def start_coordinator(spec_ref, catalog_ref, config: LoaderConfig, started: list, node_id: str):
    """Start a loader's coordinator on `node_id` (the driver's, whose loss ends the job anyway), handing it
    the workers already `started` ((handle, node) pairs); the spec and catalog stay ObjectRefs."""
    return (
        remote_class(LoaderCoordinator)
        .options(
            num_cpus=0,
            max_concurrency=16,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote([spec_ref], [catalog_ref], config, started)
    )
