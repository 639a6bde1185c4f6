"""One measurement of `raydl bench cache` or `raydl bench mix`, in a fresh child process: N epochs of one
loader, timed and counted epoch by epoch.

    python -m raydl.bench._epochs SPEC_JSON     # prints one JSON line on stdout

SPEC (a JSON object): "row" (its name), "peer" ("raydl", "raydl-mix" or "raydata"), "source" ("images"
or "webdataset"), "data" (a folder, a list of shard paths or URIs, or for raydl-mix a list of folders),
"epochs", "batch_size", "cpus", "seed", and optionally "batching" (raydl-mix), "endpoint" (the store
behind `data`: a latency proxy that counts requests is started in front of it for this run, "delay_ms"
each), "cache" (a fresh
folder for `raydl.Cache`), "cache_max_bytes", "env" (set before anything is imported), "store_pids"
(the server's processes, whose CPU is counted per epoch apart from the loader's), "raydata_read_cpus".

Per epoch it reports the images, the wall time, images/s (epoch 1: from its first batch to its last,
so that starting the loader's actors is left out, and apart from it the whole epoch; later epochs:
from the previous epoch's last batch to this one's), the requests that reached the store by method
(counted at the proxy, snapshot at each epoch's end), and the CPU seconds of this process tree (the
loader: driver, Ray and its workers) and of the store (server and proxy). A loader that prefetches
across an epoch's end makes the next epoch's first requests inside this one; the totals stay right.
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import time

import numpy as np
import psutil

from raydl.bench._clock import PeerSpec
from raydl.bench._runner import process_kind
from raydl.bench._setup import ray_init, raydl_ray
from raydl.bench._transform import CROP, open_rgb, train_transform

__all__ = ["measure", "method_counts"]

_METHODS = ("GET", "HEAD", "LIST")


def method_counts(snapshot: dict[str, int]) -> dict[str, int]:
    """The counting proxy's request kinds (`_listing_s3.request_kind`) as the bench reports them: GET
    (of an object or a range: shard, idx and other), HEAD, and LIST (listing pages, GETs too in HTTP)."""
    return {
        "GET": snapshot.get("shard", 0) + snapshot.get("idx", 0) + snapshot.get("other", 0),
        "HEAD": snapshot.get("head", 0),
        "LIST": snapshot.get("list", 0),
    }


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in _METHODS}


class _Cpu:
    """CPU seconds (user + system) of this process tree less `exclude` (the proxy), and of `store` pids."""

    def __init__(self, store: list[int], exclude: list[int]) -> None:
        self._root = psutil.Process()
        self._store = [p for p in (_process(pid) for pid in store) if p is not None]
        self._exclude = set(exclude)
        self._seen: dict[psutil.Process, float] = {}  # a process's largest CPU so far: exited ones keep it
        self._kind: dict[psutil.Process, str] = {}

    def by_kind(self) -> dict[str, float]:
        """The CPU seconds of `loader()`'s last call per kind of process (driver, LoaderWorker, raylet...)."""
        out: dict[str, float] = {}
        for proc, cpu in self._seen.items():
            kind = self._kind.get(proc, "?")
            out[kind] = out.get(kind, 0.0) + cpu
        return out

    def loader(self) -> float:
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            procs = [self._root]
        for proc in procs:
            if proc.pid in self._exclude:
                continue
            try:
                t = proc.cpu_times()
                # read each time: a Ray worker takes its actor's title ("ray::LoaderWorker") only once started
                self._kind[proc] = "driver" if proc is self._root else process_kind(proc.cmdline())
            except psutil.Error:
                continue
            self._seen[proc] = max(self._seen.get(proc, 0.0), t.user + t.system)
        return sum(self._seen.values())

    def store(self) -> float:
        total = 0.0
        for proc in self._store:
            try:
                for p in (proc, *proc.children(recursive=True)):
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.Error:
                continue
        return total


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


class _Epochs:
    """Times and counts the epochs: `begin()` once the loader is built, `batch(n)` per batch, `end()` at
    each epoch's end."""

    def __init__(self, proxy, cpu: _Cpu) -> None:
        self._proxy, self._cpu = proxy, cpu
        self.rows: list[dict] = []
        self.listing: dict[str, int] = {}
        self._start = self._first = None
        self._n = self._n_first = 0
        self._counts = self._requests()
        self._cpu_at = (0.0, 0.0)
        self._counters: dict[str, int] = {}
        self._kinds_at: dict[str, float] = {}

    def _requests(self) -> dict[str, int]:
        return method_counts(self._proxy.counts()) if self._proxy else dict.fromkeys(_METHODS, 0)

    def listed(self) -> None:
        """The listing's requests, made before the first epoch."""
        now = self._requests()
        self.listing = _delta(now, self._counts)
        self._counts = now

    def begin(self) -> None:
        """Just before the loader is built: the clock and the CPU baselines (Ray's start and the listing
        left out)."""
        self._cpu_at = (self._cpu.loader(), self._cpu.store())
        self._kinds_at = self._cpu.by_kind()
        self._start = time.perf_counter()

    def resume(self) -> None:
        """After an untimed pause between epochs: the next epoch's clock, CPU and request baselines start
        now."""
        self._counts = self._requests()
        self.begin()

    def batch(self, n: int) -> None:
        if self._first is None:
            self._first, self._n_first = time.perf_counter(), n
        self._n += n

    def end(self, counters: dict[str, int] | None = None) -> None:
        """An epoch's end; `counters`: the loader's own running totals (its cache's), kept per epoch."""
        now = time.perf_counter()
        counts, cpu = self._requests(), (self._cpu.loader(), self._cpu.store())
        row = {
            "epoch": len(self.rows) + 1,
            "images": self._n,
            "seconds": now - self._start,
            "requests": _delta(counts, self._counts),
            "loader_cpu_s": cpu[0] - self._cpu_at[0],
            "store_cpu_s": cpu[1] - self._cpu_at[1],
        }
        kinds = self._cpu.by_kind()
        row["loader_cpu_s_by_process"] = {
            k: round(v - self._kinds_at.get(k, 0.0), 3)
            for k, v in sorted(kinds.items(), key=lambda kv: self._kinds_at.get(kv[0], 0.0) - kv[1])
            if v - self._kinds_at.get(k, 0.0) >= 0.005
        }
        self._kinds_at = kinds
        if counters is not None:
            row["counters"] = {k: v - self._counters.get(k, 0) for k, v in counters.items()}
            self._counters = counters
        if not self.rows:  # the first epoch: from its first batch, actor start-up left out
            row["first_batch_s"] = self._first - self._start
            steady = now - self._first
            row["images_per_s"] = (self._n - self._n_first) / steady if steady > 0 else None
            row["epoch_images_per_s"] = self._n / row["seconds"]
        else:
            row["images_per_s"] = self._n / row["seconds"] if row["seconds"] > 0 else None
        self.rows.append(row)
        self._counts, self._cpu_at = counts, cpu
        self._start, self._first, self._n = now, None, 0


def _pipeline(ds):
    return ds.decode().random_resized_crop(CROP).random_hflip().normalize("imagenet")


def _raydl_source(spec: dict, data, s3):
    import raydl

    if spec["source"] == "webdataset":
        return raydl.read_webdataset(data, s3=s3)
    return raydl.read_images(data, s3=s3)


def run_raydl(spec: dict, epochs: _Epochs, s3_url: str | None) -> dict:
    import raydl

    s3 = raydl.S3Options(endpoint_url=s3_url) if s3_url else None
    out: dict = {}
    with raydl_ray(PeerSpec(data="", cpus=spec["cpus"], batch_size=1, seed=0, expected=0)):
        if spec["peer"] == "raydl-mix":
            sources = {f"s{i}": _pipeline(_raydl_source(spec, d, s3)) for i, d in enumerate(spec["data"])}
            weights = {k: 1 / len(sources) for k in sources}
            ds = raydl.mix(sources, weights=weights, batching=spec.get("batching", "stratified"))
        else:
            ds = _pipeline(_raydl_source(spec, spec["data"], s3))
        epochs.listed()
        options = {}
        if spec.get("cache"):
            options["cache"] = raydl.Cache(spec["cache"], max_bytes=spec["cache_max_bytes"])
        epochs.begin()
        loader = ds.loader(
            batch_size=spec["batch_size"],
            seed=spec["seed"],
            num_workers=1,
            threads_per_worker=spec["cpus"],
            **options,
        )
        try:
            it = loader.iterator(0)
            for epoch in range(spec["epochs"]):
                for batch in it.iter_batches():
                    epochs.batch(batch["image"].shape[0])
                epochs.end(_cache_counters(it.stats()))
                if epoch == 0 and spec["epochs"] > 1:
                    # The coordinator starts COORDINATOR_DELAY_S after the workers: its one-off start must
                    # not land in epoch 2 after a short epoch 1. refresh() starts it now, untimed.
                    loader.refresh()
                    epochs.resume()
            out["driver_batches"] = it.stats().driver_batches
        finally:
            loader.shutdown()
    return out


def _cache_counters(stats) -> dict[str, int]:
    """The iterator's node-cache counters (hits, misses, bytes from the store and from the cache,
    evictions, corrupt entries), where this build has them."""
    return {
        k: v
        for k, v in vars(stats).items()
        if k.startswith(("cache_", "bytes_")) and isinstance(v, int) and not isinstance(v, bool)
    }


def _raydata_transform(batch: dict) -> dict:
    rng = random.Random()
    column = "bytes" if "bytes" in batch else next(k for k in batch if k.endswith(("jpg", "jpeg")))
    out = np.empty((len(batch[column]), 3, CROP, CROP), dtype=np.float32)
    for i, data in enumerate(batch[column]):
        train_transform(open_rgb(io.BytesIO(data)), rng, out[i])
    return {"image": out}


def run_raydata(spec: dict, epochs: _Epochs, s3_url: str | None) -> dict:
    """Ray Data on the same objects: read_binary_files (images) or read_webdataset (shards) through a
    pyarrow S3FileSystem pointed at the proxy, and the train transform in map_batches. Each pass over
    the Dataset is an epoch; Ray Data reads the store again in each."""
    import ray
    import ray.data

    ray_init(spec["cpus"])
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        fs = None
        data = spec["data"]
        if s3_url:
            from pyarrow.fs import S3FileSystem

            fs = S3FileSystem(
                endpoint_override=s3_url.removeprefix("http://"),
                scheme="http",
                access_key=os.environ["AWS_ACCESS_KEY_ID"],
                secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            )
            data = [d.removeprefix("s3://") for d in data] if isinstance(data, list) else data[5:]
        remote = {"num_cpus": spec.get("raydata_read_cpus", 1.0)}
        if spec["source"] == "webdataset":
            ds = ray.data.read_webdataset(data, filesystem=fs, decoder=None, ray_remote_args=remote)
        else:
            ds = ray.data.read_binary_files(
                data, filesystem=fs, file_extensions=["jpg", "jpeg", "png"], ray_remote_args=remote
            )
        ds = ds.map_batches(_raydata_transform, batch_format="numpy")
        epochs.listed()
        epochs.begin()
        for _ in range(spec["epochs"]):
            for batch in ds.iter_batches(batch_size=spec["batch_size"], batch_format="numpy"):
                epochs.batch(batch["image"].shape[0])
            epochs.end()
        return {}
    finally:
        ray.shutdown()


def measure(spec: dict) -> dict:
    """Run the spec's epochs; its row (spec's name, the epochs, what the loader counted)."""
    from raydl.bench._listing_s3 import ProxyChild

    proxy = None
    if spec.get("endpoint"):
        proxy = ProxyChild(spec["endpoint"], spec.get("delay_ms", 0.0), dict(os.environ))
    try:
        cpu = _Cpu(spec.get("store_pids", []) + ([proxy.pid] if proxy else []), [proxy.pid] if proxy else [])
        epochs = _Epochs(proxy, cpu)
        run = run_raydata if spec["peer"] == "raydata" else run_raydl
        extra = run(spec, epochs, proxy.url if proxy else None)
        return {"row": spec["row"], "ok": True, "listing": epochs.listing, "epochs": epochs.rows, **extra}
    finally:
        if proxy:
            proxy.close()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    os.environ.update(spec.get("env", {}))  # before raydl or Ray is imported: e.g. RAYDL_CACHE_DIR
    json_out = os.dup(1)
    os.dup2(2, 1)  # Ray and its workers print to fd 1; keep it for the JSON line
    try:
        row = measure(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes a row, not a lost run
        import traceback

        traceback.print_exc()
        row = {"row": spec.get("row"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.flush()
    os.write(json_out, (json.dumps(row) + "\n").encode())
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
