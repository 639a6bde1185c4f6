"""Run one peer for one epoch in a fresh process and print one JSON line on stdout.

    python -m raydl.bench._runner --peer torch --data DIR --cpus 2 --expected 4000

A fresh process per run means no peer inherits another's warm caches, threads
or Ray instance, and "the process tree" is exactly what the peer started: the
runner, its torch workers, or, when it calls `ray.init()` itself, the raylet,
GCS and Ray workers. A thread samples that tree every 0.25 s:

* peak memory is the largest sum of PSS (proportional set size, so pages shared
  between processes, such as plasma's or forked workers', count once) seen
  while the epoch runs, kept per kind of process at that peak (`process_kind`)
  with each kind's share of shared-memory pages (the object store's); and the
  same peak of two parts of the tree on their own (`ray_service`): the
  loader's own processes (the runner, its actors and task workers, torch's
  workers) and Ray's services (GCS, raylet, agents, idle workers);
* CPU is, per process, the largest user+system time seen minus its value when
  the epoch started, summed over the tree, less the sampler's own CPU.

With `--epochs N` the peer runs N epochs; both figures stay the first epoch's, and
the CPU of the epochs after it is reported apart (`later_cpu_s_per_image`).

Everything a library prints on stdout is sent to stderr, so stdout carries the
JSON line alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import psutil

from raydl.bench._clock import EpochClock, PeerSpec, process_start_time
from raydl.bench._tokens import SEQ_LEN
from raydl.bench.peers import PEERS, WORKLOADS, peer_function
from raydl.bench.report import ray_service

_MIB = 1024 * 1024


class TreeSampler:
    """Peak PSS and CPU seconds of this process and all its descendants, over one window."""

    def __init__(self, interval: float = 0.25, *, also: tuple[int, ...] = ()):
        self._root = psutil.Process()
        # other trees to count as this one's (--running-cluster: the cluster's processes, which the run's
        # LoaderWorker lives among, are not its children)
        self._also = [psutil.Process(pid) for pid in also]
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._state = "before"  # before -> open -> closed; nothing is recorded once closed
        self._base: dict[psutil.Process, float] = {}  # CPU at window start; psutil hashes (pid, start time)
        self._max: dict[psutil.Process, float] = {}
        self._overhead = 0.0  # CPU the sampling itself cost, inside the window
        self.peak_pss = 0
        # PSS per kind of process (see process_kind) at the peak, and the part of it in shared memory
        # (the object store's pages, for Ray's processes)
        self.peak_by_kind: dict[str, int] = {}
        self.peak_shmem_by_kind: dict[str, int] = {}
        # Each part's own peak (it may fall at another sample than the total's): the loader's, Ray's
        self.peak_own = 0
        self.peak_ray = 0
        self.cpu_at_first: float | None = None
        self.first_epoch: tuple | None = (
            None  # (CPU s, peak PSS, its split, its shared part, own peak, Ray's peak) at epoch 1's end
        )
        self.first_cpu_by_kind: dict[
            str, float
        ] = {}  # CPU seconds per kind from the window's start to batch one
        self.first_epoch_cpu_by_kind: dict[str, float] | None = (
            None  # ... to the first epoch's end (epochs > 1)
        )
        self._kind: dict[psutil.Process, str] = {}
        self._thread = threading.Thread(target=self._loop, name="raydl-bench-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample(memory=True)

    def _sample(self, *, memory: bool) -> None:
        t0 = time.thread_time()
        with self._lock:
            if self._state == "closed":
                return
            procs = []
            for top in (self._root, *self._also):
                try:
                    procs += [top, *top.children(recursive=True)]
                except psutil.Error:
                    procs.append(top)
            pss = 0
            by_kind: dict[str, int] = {}
            shmem_by_kind: dict[str, int] = {}
            for proc in procs:
                try:
                    with proc.oneshot():
                        times = proc.cpu_times()
                        kind = "this process" if proc is self._root else process_kind(proc.cmdline())
                        self._kind[proc] = kind
                        if memory:
                            used, shmem = _pss(proc)
                            pss += used
                            by_kind[kind] = by_kind.get(kind, 0) + used
                            shmem_by_kind[kind] = shmem_by_kind.get(kind, 0) + shmem
                except psutil.Error:  # exited between listing and reading
                    continue
                cpu = times.user + times.system
                if cpu > self._max.get(proc, -1.0):
                    self._max[proc] = cpu
                if self._state == "before":
                    self._base[proc] = cpu
            if self._state == "open":
                if pss > self.peak_pss:
                    self.peak_pss, self.peak_by_kind, self.peak_shmem_by_kind = pss, by_kind, shmem_by_kind
                ray = sum(v for k, v in by_kind.items() if ray_service(k))
                self.peak_own, self.peak_ray = max(self.peak_own, pss - ray), max(self.peak_ray, ray)
                self._overhead += time.thread_time() - t0

    def open_window(self) -> None:
        """Called just before the loader is built: the CPU baseline and the start of the peak."""
        self._sample(memory=False)
        with self._lock:
            self._state = "open"
            self.peak_pss = self.peak_own = self.peak_ray = 0
        self._sample(memory=True)

    def close_window(self) -> None:
        """Called at the last batch, while every process that did the work is still alive."""
        if self._state == "open":
            self._sample(memory=True)
        with self._lock:
            self._state = "closed"
        self._stop.set()

    def mark_first_batch(self) -> None:
        """CPU used so far: what start-up (Ray, imports, listing) cost, so the steady state can be told
        apart."""
        self._sample(memory=False)
        self.cpu_at_first = self.cpu_seconds()
        self.first_cpu_by_kind = self.cpu_by_kind()

    def mark_first_epoch(self) -> None:
        """With several epochs: the first epoch's CPU and peak memory, kept apart from the later epochs'."""
        self._sample(memory=True)
        self.first_epoch = (
            self.cpu_seconds(),
            self.peak_pss,
            dict(self.peak_by_kind),
            dict(self.peak_shmem_by_kind),
            self.peak_own,
            self.peak_ray,
        )
        self.first_epoch_cpu_by_kind = self.cpu_by_kind()

    def cpu_by_kind(self) -> dict[str, float]:
        """CPU seconds per kind of process (`process_kind`) since the window opened (the sampler's own left
        in)."""
        out: dict[str, float] = {}
        with self._lock:
            for proc, peak in self._max.items():
                kind = self._kind.get(proc, "?")
                out[kind] = out.get(kind, 0.0) + peak - self._base.get(proc, 0.0)
        return out

    def cpu_seconds(self) -> float:
        with self._lock:
            used = sum(peak - self._base.get(proc, 0.0) for proc, peak in self._max.items())
            return max(0.0, used - self._overhead)

    def overhead(self) -> float:
        return self._overhead

    def processes(self) -> int:
        return len(self._max)


def process_kind(cmdline: list[str]) -> str:
    """What a process of the tree is, from its command line: a Ray actor or worker by its title
    ("ray::LoaderWorker", "ray::IDLE"), a Ray service by its program (raylet, gcs_server,
    dashboard agent, ...), else the program's file name."""
    if not cmdline:
        return "?"
    head = cmdline[0]
    if head.startswith("ray::"):  # Ray workers set their title to the actor class or task
        return head.split()[0].split(".")[0]
    for arg in cmdline[:4]:
        name = os.path.basename(arg)
        if name in ("raylet", "gcs_server"):
            return name
        if arg.endswith(".py"):
            parent = os.path.basename(os.path.dirname(arg))
            if name in ("agent.py", "main.py") and parent:
                return f"{parent}/{name}"  # dashboard/agent.py, runtime_env/agent/main.py
            return name
    return os.path.basename(head)


def _pss(proc: psutil.Process) -> tuple[int, int]:
    """(PSS, the part of it in shared memory such as the object store's /dev/shm pages), in bytes.

    From /proc/PID/smaps_rollup (one short read) where the kernel has it, else psutil's smaps walk.
    """
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines()[1:] if b":" in line)
        return int(fields[b"Pss"].split()[0]) * 1024, int(fields.get(b"Pss_Shmem", b"0 kB").split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return _pss_psutil(proc), 0


def _pss_psutil(proc: psutil.Process) -> int:
    try:
        return proc.memory_full_info().pss
    except (AttributeError, psutil.AccessDenied):  # no smaps here: RSS over-counts shared pages
        return proc.memory_info().rss


def _pin(cpus: int) -> list[int]:
    """Hold the tree to `cpus` cores, so native pools (Rust, OpenMP) see the same budget."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpus < len(allowed):
        allowed = allowed[:cpus]
        os.sched_setaffinity(0, allowed)
    return allowed


def _per_image(before: dict[str, float], after: dict[str, float], images: int) -> dict[str, float]:
    """CPU ms per image of each kind of process between two `cpu_by_kind` snapshots, largest first."""
    ms = {k: 1000 * (v - before.get(k, 0.0)) / images for k, v in after.items()}
    return {k: round(v, 3) for k, v in sorted(ms.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def _row(peer: str, spec: PeerSpec, sampler: TreeSampler, clock: EpochClock, wall: float) -> dict:
    m = clock.result()
    cpu_all = sampler.cpu_seconds()
    cpu, peak, by_kind, shmem_by_kind, own, ray = (
        sampler.first_epoch
        if sampler.first_epoch is not None
        else (
            cpu_all,
            sampler.peak_pss,
            sampler.peak_by_kind,
            sampler.peak_shmem_by_kind,
            sampler.peak_own,
            sampler.peak_ray,
        )
    )
    started = process_start_time()
    row = {
        "peer": peer,
        "ok": True,
        "images": m.images,
        "images_per_s": m.images_per_s,
        "first_batch_s": m.first_batch_s,
        # From this process's start: imports, ray.init and the loader, as a user's script sees it.
        "first_batch_from_start_s": m.first_batch_at - started,
        "steady_images": m.steady_images,
        "steady_s": m.steady_s,
        "steady_batches": max(0, m.batches - 1),
        # Start-up included: what a short job sees, and what prefetch cannot flatter.
        "epoch_images_per_s": m.images / (m.first_batch_s + m.steady_s),
        # The whole epoch from this process's start (imports, Ray, the loader, every batch).
        "epoch_from_start_per_s": m.images / (m.first_batch_at - started + m.steady_s),
        "peak_pss_mib": peak / _MIB,
        # The same peak of the loader's own processes alone, and of Ray's services alone (ray_service)
        "own_pss_mib": own / _MIB,
        "ray_pss_mib": ray / _MIB,
        "cpu_s": cpu,
        "peak_pss_by_process_mib": {
            k: round(v / _MIB, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "peak_shmem_by_process_mib": {k: round(v / _MIB, 1) for k, v in shmem_by_kind.items() if v >= _MIB},
        # Who used the CPU while the first batch was made (this process: listing, loader(), the batch).
        "first_batch_cpu_s_by_process": {
            k: round(v, 2)
            for k, v in sorted(sampler.first_cpu_by_kind.items(), key=lambda kv: -kv[1])
            if v >= 0.01
        },
        "cpu_s_per_image": cpu / m.images if m.images else None,
        # After the first batch: the per-image cost without start-up, what a long epoch pays.
        "steady_cpu_s_per_image": (
            (cpu - sampler.cpu_at_first) / m.steady_images
            if m.steady_images and sampler.cpu_at_first is not None
            else None
        ),
        "batch_shape": list(m.batch_shape),
        "batch_dtype": m.batch_dtype,
        "processes": sampler.processes(),
        "sampler_cpu_s": sampler.overhead(),
        "wall_s": wall,
    }
    # Where the steady CPU went: per kind of process, ms per image after the first batch (epoch 1).
    end_by_kind = sampler.cpu_by_kind()
    epoch1_by_kind = sampler.first_epoch_cpu_by_kind or end_by_kind
    if m.steady_images:
        row["steady_cpu_ms_per_image_by_process"] = _per_image(
            sampler.first_cpu_by_kind, epoch1_by_kind, m.steady_images
        )
    if m.later_images:  # --epochs N: the epochs after the first, start-up long done
        row.update(
            epochs=spec.epochs,
            later_images=m.later_images,
            later_s=m.later_s,
            later_images_per_s=m.later_images / m.later_s if m.later_s > 0 else None,
            later_cpu_s_per_image=(cpu_all - cpu) / m.later_images,
            later_peak_pss_mib=sampler.peak_pss / _MIB,
            later_own_pss_mib=sampler.peak_own / _MIB,
            later_ray_pss_mib=sampler.peak_ray / _MIB,
            later_cpu_ms_per_image_by_process=_per_image(epoch1_by_kind, end_by_kind, m.later_images),
        )
    row.update(clock.extra)
    if clock.checksum is not None:
        row["checksum"] = clock.checksum
    # A peer that returns the wrong tensors is not doing the workload; say so loudly.
    if peer in ("ceiling", "floor"):
        pass
    elif spec.workload == "windows":
        if m.batch_shape[1:] != (spec.seq_len,) or m.batch_dtype != "int64":
            row.update(
                ok=False,
                error=f"batches are {m.batch_dtype} {list(m.batch_shape)}, not int64 [B, {spec.seq_len}]",
            )
    elif spec.workload == "tokens":
        if m.batch_shape[1:] != (SEQ_LEN,) or m.batch_dtype not in ("int32", "int64"):
            row.update(
                ok=False, error=f"batches are {m.batch_dtype} {list(m.batch_shape)}, not int [B, {SEQ_LEN}]"
            )
    elif spec.workload == "buckets":
        if m.batch_shape[-1:] != (3,) or len(m.batch_shape) != 4 or m.batch_dtype != "uint8":
            row.update(
                ok=False, error=f"batches are {m.batch_dtype} {list(m.batch_shape)}, not uint8 [B, H, W, 3]"
            )
    elif m.batch_shape[1:] != (3, 224, 224) or m.batch_dtype != "float32":
        row.update(
            ok=False, error=f"batches are {m.batch_dtype} {list(m.batch_shape)}, not float32 [B, 3, 224, 224]"
        )
    if m.images != spec.expected:
        row["warning"] = f"delivered {m.images} images of {spec.expected}"
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raydl.bench._runner")
    p.add_argument("--peer", required=True, choices=sorted(set(PEERS) | set(WORKLOADS)))
    p.add_argument("--data", required=True)
    p.add_argument("--cpus", type=int, required=True)
    p.add_argument("--expected", type=int, required=True, help="images in --data")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default="train", choices=["train", "buckets", "clip", "tokens", "windows"])
    p.add_argument("--no-pin", action="store_true", help="do not set CPU affinity")
    p.add_argument("--source", default="images", choices=["images", "webdataset", "parquet"])
    p.add_argument("--endpoint-url")
    p.add_argument("--image-column", default="image")
    p.add_argument("--label-column", default="label")
    p.add_argument("--nodes", type=int, default=1, help="raydl only: simulated nodes (ray.cluster_utils)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of the same loader (peers in MULTI_EPOCH)")
    p.add_argument("--seq-len", type=int, default=0, help="windows: tokens of a window's input ids")
    p.add_argument("--checksum", action="store_true", help="report a digest of every row delivered (slower)")
    p.add_argument("--ray-address", help="raydl only: connect to this running cluster (ray start --head)")
    p.add_argument(
        "--cluster-pid", type=int, help="with --ray-address: the cluster's root process, sampled too"
    )
    args = p.parse_args(argv)

    cores = list(range(os.cpu_count() or 1)) if args.no_pin else _pin(args.cpus)
    # Native pools size themselves when first imported; these must be set before that.
    os.environ["DATAIO_CPU_WORKERS"] = str(args.cpus)
    os.environ["DATAGO_MAX_TASKS"] = str(args.cpus)
    json_out = os.dup(1)
    os.dup2(2, 1)  # Ray, Rust loggers and children print to fd 1; keep it for the JSON line

    spec = PeerSpec(
        data=args.data,
        cpus=args.cpus,
        batch_size=args.batch_size,
        seed=args.seed,
        expected=args.expected,
        workload=args.workload,
        source=args.source,
        endpoint_url=args.endpoint_url,
        image_column=args.image_column,
        label_column=args.label_column,
        nodes=args.nodes,
        epochs=args.epochs,
        ray_address=args.ray_address,
        seq_len=args.seq_len,
        checksum=args.checksum,
    )
    sampler = TreeSampler(also=(args.cluster_pid,) if args.cluster_pid else ())
    clock = EpochClock(
        args.expected,
        on_start=sampler.open_window,
        on_finish=sampler.close_window,
        on_first=sampler.mark_first_batch,
        epochs=args.epochs,
        on_first_epoch=sampler.mark_first_epoch,
        checksum=args.checksum,
    )
    t0 = time.perf_counter()
    try:
        peer_function(args.peer, args.workload)(spec, clock)
        row = _row(args.peer, spec, sampler, clock, time.perf_counter() - t0)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes a row, not a lost run
        row = {"peer": args.peer, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        import traceback

        traceback.print_exc()
    finally:
        sampler.close_window()
    row["cores"] = cores
    sys.stdout.flush()
    os.write(json_out, (json.dumps(row) + "\n").encode())
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
