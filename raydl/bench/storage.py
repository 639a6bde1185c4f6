"""`raydl bench storage`: read rates on S3, GCS and Azure Blob servers, directly and behind added latency.

    raydl bench storage --stores s3,gcs,azure --objects 256 --size 65536 --concurrency 32 --delays 0,20,50

Each store in --stores gets a server on 127.0.0.1 in a child process, in memory: moto for s3 (unless
--endpoint-url names an S3 server), fake-gcs-server for gcs and azurite's blob service for azure
(raydl/bench/emulators.py; stopped by PID). A store whose server is missing is reported, not measured. Every
store holds the same objects: --objects small objects of --size bytes and --shards shards of --shard-size
bytes. Each delay gets a latency proxy per store (raydl/bench/latency_proxy.py, a TCP proxy: hosts, paths and
headers pass untouched) in its own process, adding that many milliseconds to every request. Two
measurements per store, peer and target, with the same concurrency:

* small: every small object read whole (objects/s);
* shards: every shard read in --range-size ranges (MB/s).

Peers, each in a fresh child process per measurement, taking turns round by round:

* raydl: raydl's storage for the store (S3Storage, GCSStorage, AzureStorage) read_range on the loader
  worker's IO pool (raydl.storage.fetch.IOPool);
* the store's own client on a thread pool, its connection pool sized to the concurrency: boto3
  (get_object with Range), google-cloud-storage (Blob.download_as_bytes, with start/end for a range),
  azure-storage-blob (download_blob(offset, length).readall());
* s3: s3dlio (get_many, small objects only) and s3torchconnector (the AWS CRT client's get_object);
* dataio (dataio-rs): dataio.fetch(uri, offset=, size=) on a thread pool, where it can reach the server.

Each cell gives the median rate and, in brackets, the server's own CPU seconds per wall second while it was
measured (psutil on the server's process tree): about 1 on one core means the server, not the client, set
the rate. The notes give the server's share of all CPU spent (client, proxy and server) and the goal line:
raydl at the largest delay against min(concurrency / delay, the store's direct ceiling).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["PEERS", "STORES", "add_parser", "main"]

STORES = ("s3", "gcs", "azure")
SCHEME = {"s3": "s3", "gcs": "gs", "azure": "az"}
NATIVE = {"s3": "boto3", "gcs": "google-cloud-storage", "azure": "azure-storage-blob"}
PEERS = {
    "s3": ("raydl", "boto3", "s3dlio", "s3torchconnector", "dataio"),
    "gcs": ("raydl", "google-cloud-storage", "dataio"),
    "azure": ("raydl", "azure-storage-blob", "dataio"),
}
WORKLOADS = ("small", "shards")
_REQUIRES = {
    ("s3", "raydl"): "boto3",
    ("gcs", "raydl"): "obstore",
    ("azure", "raydl"): "obstore",
    ("s3", "boto3"): "boto3",
    ("s3", "s3dlio"): "s3dlio",
    ("s3", "s3torchconnector"): "s3torchconnector",
    ("gcs", "google-cloud-storage"): "google.cloud.storage",
    ("azure", "azure-storage-blob"): "azure.storage.blob",
}
_PIP = {"google.cloud.storage": "google-cloud-storage", "azure.storage.blob": "azure-storage-blob"}
_BUCKET = "raydl-bench-storage"
_CREDS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "storage",
        help="S3, GCS and Azure read rates: raydl vs each store's client, s3dlio, s3torchconnector, dataio",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stores", default="s3,gcs,azure", help=f"stores to measure, from {','.join(STORES)}")
    p.add_argument("--endpoint-url", help="an S3-compatible server for s3 (default: start moto on 127.0.0.1)")
    p.add_argument("--objects", type=int, default=256, help="small objects, each read whole")
    p.add_argument("--size", type=int, default=64 << 10, help="bytes per small object")
    p.add_argument("--shards", type=int, default=4, help="shards, each read in ranges (0: none)")
    p.add_argument("--shard-size", type=int, default=8 << 20, help="bytes per shard")
    p.add_argument("--range-size", type=int, default=1 << 20, help="bytes per ranged read of a shard")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight, every peer")
    p.add_argument("--delays", default="0,20,50", help="added milliseconds per request (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--compare",
        default="native,s3dlio,s3torchconnector,dataio",
        help="peers besides raydl: native (each store's own client), "
        + ", ".join(sorted({p for ps in PEERS.values() for p in ps[1:]}))
        + "; a peer runs on the stores it reads",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    p.add_argument("--json", help="write every measurement and the medians here")
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _child(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM by PID, `grace_s` to exit, then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


class _Moto:
    """moto's S3 server in a child Python process (its own ceiling shows in the "direct" column)."""

    def __init__(self, env: dict) -> None:
        code = (
            "import logging,threading;logging.getLogger('werkzeug').setLevel(logging.ERROR);"
            "from moto.server import ThreadedMotoServer as S;"
            "s=S(ip_address='127.0.0.1',port=0,verbose=False);"
            "s.start();print(s.get_host_and_port()[1],flush=True);threading.Event().wait()"
        )
        self.proc = _child(["-c", code], env)
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            _stop(self.proc)
            raise RuntimeError("moto's server did not start (pip install 'moto[server]')")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid = self.proc.pid

    def stop(self) -> None:
        _stop(self.proc)


def _start_moto(env: dict) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a child process: (the process, its endpoint URL). The listing and cache benches
    start theirs so."""
    moto = _Moto(env)
    return moto.proc, moto.url


def _start_proxy(port: int, delay_ms: float, env: dict) -> tuple[subprocess.Popen, str]:
    proc = _child(["-m", "raydl.bench.latency_proxy", f"127.0.0.1:{port}", str(delay_ms)], env)
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


class _Store:
    """One store under test: its server (None for an outside S3 endpoint), its objects, its targets."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server = None
        self.endpoint = ""  # the server's own URL
        self.error = ""  # why the store is not measured
        self.targets: list[tuple[str, float, str, int | None]] = []  # label, delay, url, proxy pid

    @property
    def server_pid(self) -> int | None:
        return self.server.pid if self.server is not None else None


def _start(store: _Store, args, env: dict, tmp: Path) -> None:
    from raydl.bench import emulators

    if store.name == "s3":
        if args.endpoint_url:
            store.endpoint = args.endpoint_url
            return
        store.server = _Moto(env)
    elif store.name == "gcs":
        store.server = emulators.FakeGCS(tmp)
    else:
        store.server = emulators.Azurite(tmp)
    store.endpoint = store.server.url


def _fill(store: _Store, objects: dict[str, bytes]) -> None:
    """The same keys and bytes into every store, through its own API."""
    if store.name == "s3":
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=store.endpoint, config=Config(max_pool_connections=16))
        try:
            client.create_bucket(Bucket=_BUCKET)
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            pass
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(lambda kv: client.put_object(Bucket=_BUCKET, Key=kv[0], Body=kv[1]), objects.items())
            )
    elif store.name == "gcs":
        store.server.create_bucket(_BUCKET)
        store.server.put_many(_BUCKET, objects)
    else:
        store.server.create_container(_BUCKET)
        store.server.put_many(_BUCKET, objects)


def _endpoint(store: str, url: str) -> str:
    """What a peer is given: azurite's URLs carry the account in the path."""
    if store == "azure":
        from raydl.bench.emulators import AZURITE_ACCOUNT

        return f"{url}/{AZURITE_ACCOUNT}"
    return url


# -- one measurement, in a child process ------------------------------------------------------------


def _getter(store: str, peer: str, endpoint: str, concurrency: int):
    """(get(uri, offset, length, whole) -> bytes, many(items) -> list[bytes] or None) for one peer."""
    from raydl.bench.emulators import AZURITE_ACCOUNT, AZURITE_KEY

    if peer == "raydl":
        if store == "s3":
            from raydl.options import S3Options
            from raydl.storage.s3 import S3Storage

            storage = S3Storage(S3Options(endpoint_url=endpoint, max_concurrency=concurrency))
        elif store == "gcs":
            from raydl.options import GCSOptions
            from raydl.storage.gcs import GCSStorage

            storage = GCSStorage(GCSOptions(endpoint_url=endpoint, max_concurrency=concurrency))
        else:
            from raydl.options import AzureOptions
            from raydl.storage.azure import AzureStorage

            storage = AzureStorage(
                AzureOptions(
                    account_name=AZURITE_ACCOUNT,
                    account_key=AZURITE_KEY,
                    endpoint_url=endpoint,
                    max_concurrency=concurrency,
                )
            )
        from raydl.storage.fetch import IOPool

        pool = IOPool(concurrency)

        def many(items):
            return [f.result() for f in [pool.submit(storage.read_range, u, o, n) for u, o, n, _ in items]]

        return None, many
    if peer == "boto3":
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=concurrency))

        def get(uri, offset, length, whole):
            bucket, key = uri[5:].split("/", 1)
            rng = f"bytes={offset}-{offset + length - 1}"
            return client.get_object(Bucket=bucket, Key=key, Range=rng)["Body"].read()

        return get, None
    if peer == "google-cloud-storage":
        import requests.adapters
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        client = gcs.Client(
            project="bench", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
        )
        adapter = requests.adapters.HTTPAdapter(pool_connections=concurrency, pool_maxsize=concurrency)
        client._http.mount("http://", adapter)
        blobs: dict = {}

        def get(uri, offset, length, whole):
            bucket, key = uri[5:].split("/", 1)
            blob = blobs.get(uri) or blobs.setdefault(uri, client.bucket(bucket).blob(key))
            if whole:
                return blob.download_as_bytes()
            return blob.download_as_bytes(start=offset, end=offset + length - 1)

        return get, None
    if peer == "azure-storage-blob":
        import requests
        import requests.adapters
        from azure.storage.blob import BlobServiceClient

        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=concurrency, pool_maxsize=concurrency)
        session.mount("http://", adapter)
        service = BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint};",
            session=session,
        )

        def get(uri, offset, length, whole):
            container, key = uri[5:].split("/", 1)
            blob = service.get_blob_client(container, key)
            if whole:
                return blob.download_blob().readall()
            return blob.download_blob(offset=offset, length=length).readall()

        return get, None
    if peer == "s3dlio":
        import s3dlio

        s3dlio.configure_s3(endpoint_url=endpoint, region="us-east-1")

        def many(items):
            if not all(whole for *_, whole in items):
                raise RuntimeError("not measured: s3dlio.get_many reads whole objects")
            return [bytes(d) for _, d in s3dlio.get_many([u for u, *_ in items], max_in_flight=concurrency)]

        return None, many
    if peer == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        client = S3Client(
            "us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
        )

        def get(uri, offset, length, whole):
            bucket, key = uri[5:].split("/", 1)
            if whole:
                return client.get_object(bucket, key).read()
            reader = client.get_object(bucket, key)
            reader.seek(offset)
            return reader.read(length)

        return get, None
    if peer == "dataio":
        import dataio

        scheme = SCHEME[store]
        dataio.configure_endpoint(scheme, endpoint)
        if store == "s3":
            dataio.configure_credentials("s3", access_key_id="bench", secret_access_key="bench")
        elif store == "azure":
            dataio.configure_credentials(
                "az", method="azure_key", account_name=AZURITE_ACCOUNT, account_key=AZURITE_KEY
            )
        else:
            dataio.configure_credentials("gs", method="default")

        def get(uri, offset, length, whole):
            if whole:
                return dataio.fetch(uri)
            return dataio.fetch(uri, offset=offset, size=length)

        return get, None
    raise ValueError(f"unknown peer {peer!r}")


def _cpu(pid: int | None) -> float | None:
    """CPU seconds (user + system) of `pid` and its children so far; None when unknown."""
    if pid is None:
        return None
    import psutil

    try:
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return None


def _measure(spec: dict) -> dict:
    """Each workload's items read once (after a warm-up of `concurrency` of them): rate, MB/s, CPU."""
    store, peer, concurrency = spec["store"], spec["peer"], spec["concurrency"]
    get, many = _getter(store, peer, spec["endpoint"], concurrency)
    if many is None:
        tpool = ThreadPoolExecutor(concurrency)

        def many(items):
            return list(tpool.map(lambda it: get(*it), items))

    out = {}
    for workload in WORKLOADS:
        items = [tuple(it) for it in spec["items"][workload]]
        if not items:
            continue
        try:
            many(items[:concurrency])  # connections, clients, threads: warm
            cpu0 = [_cpu(spec["server_pid"]), _cpu(spec["proxy_pid"]), _cpu(os.getpid())]
            t0 = time.perf_counter()
            data = many(items)
            took = time.perf_counter() - t0
            cpu1 = [_cpu(spec["server_pid"]), _cpu(spec["proxy_pid"]), _cpu(os.getpid())]
        except Exception as exc:  # noqa: BLE001 - the row says why
            text = str(exc).strip().splitlines()
            out[workload] = {"ok": False, "error": f"{type(exc).__name__}: {text[0] if text else ''}"[:300]}
            continue
        want = sum(n for _, _, n, _ in items)
        got = sum(len(b) for b in data)
        if got != want:
            out[workload] = {"ok": False, "error": f"read {got} bytes, expected {want}"}
            continue
        server, proxy, client = (
            None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1, strict=True)
        )
        out[workload] = {
            "ok": True,
            "rate": len(items) / took,
            "mb_s": got / took / 1e6,
            "seconds": took,
            "server_cpu_s": server,
            "proxy_cpu_s": proxy,
            "client_cpu_s": client,
        }
    return out


def _run_child(spec: dict, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "raydl.bench.storage", "--_measure"]
    try:
        proc = subprocess.run(
            cmd, input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {w: {"ok": False, "error": f"timed out after {timeout:.0f} s"} for w in WORKLOADS}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        err = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return {w: {"ok": False, "error": err} for w in WORKLOADS}
    return json.loads(lines[-1])


# -- the driver --------------------------------------------------------------------------------------


def _peers(args) -> tuple[dict[str, list[str]], dict[tuple[str, str], str]]:
    """Each store's peers, and why a peer of a store is not run (not installed)."""
    wanted = ["raydl"] + [p.strip() for p in args.compare.split(",") if p.strip()]
    known = {p for ps in PEERS.values() for p in ps} | {"native"}
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(sorted(known - {'raydl'}))}")
    out, skipped = {}, {}
    for store in STORES:
        names = [NATIVE[store] if p == "native" else p for p in wanted]
        out[store] = [p for p in PEERS[store] if p in names]
        for p in out[store]:
            module = _REQUIRES.get((store, p), p)
            if importlib.util.find_spec(module.split(".")[0]) is None or ("." in module and _missing(module)):
                skipped[(store, p)] = f"not installed (pip install {_PIP.get(module, module)})"
                if p == "dataio":
                    skipped[(store, p)] = "not installed (pip install dataio-rs)"
    return out, skipped


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:
        return True


def _objects(args) -> tuple[dict[str, bytes], dict[str, list]]:
    """The keys and bytes every store holds, and each workload's items (key, offset, length, whole)."""
    objects, small, shards = {}, [], []
    for i in range(args.objects):
        key = f"obj/{i:06d}.bin"
        objects[key] = os.urandom(args.size)
        small.append((key, 0, args.size, True))
    for i in range(args.shards):
        key = f"shard/{i:04d}.bin"
        objects[key] = os.urandom(args.shard_size)
        for off in range(0, args.shard_size, args.range_size):
            shards.append((key, off, min(args.range_size, args.shard_size - off), False))
    return objects, {"small": small, "shards": shards}


def main(args: argparse.Namespace) -> int:
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    bad = [s for s in stores if s not in STORES]
    if bad or not stores:
        _log(f"error: unknown store(s) {bad}; choose from {', '.join(STORES)}")
        return 2
    try:
        peers, skipped = _peers(args)
    except ValueError as exc:
        _log(f"error: {exc}")
        return 2
    for (store, p), why in skipped.items():
        if store in stores:
            _log(f"{store} {p}: {why}")
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    if not args.endpoint_url:
        env.update(_CREDS)
        os.environ.update(_CREDS)
    objects, items = _objects(args)
    tmp = Path(tempfile.mkdtemp(prefix="raydl-bench-storage-"))
    state = {s: _Store(s) for s in stores}
    proxies: list[subprocess.Popen] = []
    runs: list[dict] = []
    try:
        for st in state.values():
            try:
                _start(st, args, env, tmp)
                _fill(st, objects)
            except Exception as exc:  # noqa: BLE001 - the store's rows say why
                st.error = f"{type(exc).__name__}: {exc}"
                _log(f"{st.name}: not measured: {st.error}")
                continue
            port = int(st.endpoint.rsplit(":", 1)[1].split("/")[0])
            st.targets.append(("direct", 0.0, st.endpoint, None))
            for d in delays:
                proxy, url = _start_proxy(port, d, env)
                proxies.append(proxy)
                st.targets.append((f"{d:g} ms", d, url, proxy.pid))
        _log(
            f"{args.objects} objects of {args.size} B, {args.shards} shards of {args.shard_size} B in "
            f"{args.range_size} B ranges, concurrency {args.concurrency}, {args.rounds} round(s)"
        )
        for r in range(1, args.rounds + 1):
            for st in state.values():
                if st.error:
                    continue
                scheme = SCHEME[st.name]
                spec_items = {
                    w: [(f"{scheme}://{_BUCKET}/{k}", o, n, whole) for k, o, n, whole in its]
                    for w, its in items.items()
                }
                for label, delay, url, proxy_pid in st.targets:
                    for peer in peers[st.name]:
                        if (st.name, peer) in skipped:
                            continue
                        spec = {
                            "store": st.name,
                            "peer": peer,
                            "endpoint": _endpoint(st.name, url),
                            "items": spec_items,
                            "concurrency": args.concurrency,
                            "server_pid": st.server_pid,
                            "proxy_pid": proxy_pid,
                        }
                        result = _run_child(spec, env, args.timeout)
                        for w in WORKLOADS:
                            if not items[w]:
                                continue
                            row = dict(result.get(w) or {"ok": False, "error": "no result"})
                            row.update(
                                round=r, store=st.name, workload=w, peer=peer, target=label, delay_ms=delay
                            )
                            runs.append(row)
                            unit = "obj/s" if w == "small" else "req/s"
                            _log(
                                f"[round {r}] {st.name:<5} {w:<6} {label:>7} {peer:<20} "
                                + (
                                    f"{row['rate']:8.1f} {unit} {row['mb_s']:8.2f} MB/s"
                                    if row["ok"]
                                    else f"FAILED: {row['error']}"
                                )
                            )
    finally:
        for p in proxies:
            _stop(p)
        for st in state.values():
            if st.server is not None:
                st.server.stop()
    summary = _summarize(state, peers, runs, items)
    print(_table(state, peers, skipped, summary, runs, args, items))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "stores": stores,
                    "objects": args.objects,
                    "size": args.size,
                    "shards": args.shards,
                    "shard_size": args.shard_size,
                    "range_size": args.range_size,
                    "concurrency": args.concurrency,
                    "rounds": args.rounds,
                    "not_measured": {s: st.error for s, st in state.items() if st.error},
                    "skipped": [
                        {"store": s, "peer": p, "why": w} for (s, p), w in skipped.items() if s in stores
                    ],
                    "summary": [
                        {"store": s, "workload": w, "peer": p, "target": t, **(v or {})}
                        for (s, w, p, t), v in summary.items()
                    ],
                    "runs": runs,
                },
                indent=2,
            )
            + "\n"
        )
        _log(f"wrote {args.json}")
    raydl_ok = all(v for (s, w, p, t), v in summary.items() if p == "raydl")
    return 0 if raydl_ok else 1


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summarize(state, peers, runs, items) -> dict:
    out = {}
    for s, st in state.items():
        if st.error:
            continue
        for w in WORKLOADS:
            if not items[w]:
                continue
            for p in peers[s]:
                for label, *_ in st.targets:
                    ok = [
                        r
                        for r in runs
                        if (r["store"], r["workload"], r["peer"], r["target"]) == (s, w, p, label) and r["ok"]
                    ]
                    if not ok:
                        out[(s, w, p, label)] = None
                        continue
                    share = []
                    for r in ok:
                        parts = [r["server_cpu_s"], r["proxy_cpu_s"] or 0.0, r["client_cpu_s"]]
                        if r["server_cpu_s"] is not None and r["client_cpu_s"] is not None and sum(parts) > 0:
                            share.append(r["server_cpu_s"] / sum(parts))
                    out[(s, w, p, label)] = {
                        "rate": statistics.median(r["rate"] for r in ok),
                        "mb_s": statistics.median(r["mb_s"] for r in ok),
                        "server_busy": _median(
                            None if r["server_cpu_s"] is None else r["server_cpu_s"] / r["seconds"]
                            for r in ok
                        ),
                        "server_share": _median(share),
                        "rounds_ok": len(ok),
                    }
    return out


def _cell(v, workload) -> str:
    if not v:
        return "failed"
    value = v["rate"] if workload == "small" else v["mb_s"]
    busy = "" if v["server_busy"] is None else f" [{v['server_busy']:.2f}]"
    return f"{value:.1f}{busy}"


def _table(state, peers, skipped, summary, runs, args, items) -> str:
    labels = ["direct"] + [f"{float(d):g} ms" for d in args.delays.split(",") if d.strip()]
    head = f"{'store':<6}{'workload':<9}{'peer':<22}" + "".join(f"{lb:>18}" for lb in labels)
    lines = [
        f"raydl bench storage: small = {args.objects} x {args.size} B read whole (objects/s); shards = "
        f"{args.shards} x {args.shard_size} B in {args.range_size} B ranges (MB/s); concurrency "
        f"{args.concurrency}, median of {args.rounds} round(s); [server CPU s per wall s]",
        head,
        "-" * len(head),
    ]
    notes = []
    for s, st in state.items():
        if st.error:
            lines.append(f"{s:<6}not measured: {st.error}")
            continue
        for w in WORKLOADS:
            if not items[w]:
                continue
            for p in peers[s]:
                if (s, p) in skipped:
                    lines.append(f"{s:<6}{w:<9}{p:<22}{skipped[(s, p)]}")
                    continue
                cells = [_cell(summary.get((s, w, p, lb)), w) for lb in labels]
                lines.append(f"{s:<6}{w:<9}{p:<22}" + "".join(f"{c:>18}" for c in cells))
                errors = {
                    r["error"]
                    for r in runs
                    if (r["store"], r["workload"], r["peer"]) == (s, w, p) and not r["ok"]
                }
                for e in sorted({re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", e) for e in errors})[:2]:
                    notes.append(f"  * {s} {w} {p} failed: {e}")
    lines.append("")
    lines.extend(notes)
    server = {"s3": "moto", "gcs": "fake-gcs-server", "azure": "azurite"}
    for s, st in state.items():
        if st.error:
            continue
        for w in WORKLOADS:
            if not items[w]:
                continue
            shares = []
            for lb in labels:
                v = summary.get((s, w, "raydl", lb))
                if v and v["server_share"] is not None:
                    shares.append(f"{lb} {v['server_share']:.0%}")
            if shares:
                notes_line = ", ".join(shares)
                lines.append(
                    f"  * {s} {w}: {server[s]}'s share of all CPU (raydl + proxy + server): {notes_line}"
                )
        direct = [
            v for (s2, w, p, lb), v in summary.items() if s2 == s and w == "small" and lb == "direct" and v
        ]
        ceiling = max((v["rate"] for v in direct), default=0.0)
        delay = max((d for _, d, *_ in st.targets), default=0.0)
        v = summary.get((s, "small", "raydl", f"{delay:g} ms"))
        if delay > 0 and v and ceiling:
            ideal = min(args.concurrency / (delay / 1000), ceiling)
            best = max(
                (summary[(s, "small", p, f"{delay:g} ms")] or {"rate": 0})["rate"]
                for p in peers[s]
                if (s, "small", p, f"{delay:g} ms") in summary
            )
            lines.append(
                f"  * {s} small at {delay:g} ms: raydl {v['rate']:.1f} objects/s = {v['rate'] / ideal:.2f} x "
                f"min({args.concurrency}/{delay / 1000:g} s, direct ceiling {ceiling:.1f}) (goal >= 0.8); "
                f"{v['rate'] / best:.2f} x the best peer"
            )
    return "\n".join(lines)


def _cli(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--_measure"]:
        print(json.dumps(_measure(json.loads(sys.stdin.read()))))
        return 0
    parser = argparse.ArgumentParser(prog="raydl bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    return main(parser.parse_args(["storage", *argv]))


if __name__ == "__main__":
    sys.exit(_cli())
