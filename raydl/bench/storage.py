"""`raydl bench storage`: fetch rate against an S3-compatible server, directly and behind added latency.

    raydl bench storage --objects 256 --size 65536 --concurrency 32 --delays 0,20,50 --rounds 3

Without --endpoint-url a moto server is started in a child process on
127.0.0.1 (moto is a Python server: its own ceiling is what the "direct" column
shows). Each delay gets a latency proxy (raydl/bench/latency_proxy.py) in its
own process, adding that many milliseconds to every request. Every peer
fetches the same objects (each one whole, by a ranged GET) with the same
concurrency, in a fresh child process per measurement, the peers taking turns
round by round:

* raydl: S3Storage.read_range on the loader worker's IO pool (raydl.storage.fetch.IOPool);
* boto3: a plain boto3 client (pool of --concurrency connections) on a thread pool;
* s3dlio: s3dlio.get_many(uris, max_in_flight=--concurrency) (Rust, tokio);
* s3torchconnector: the AWS CRT client of s3torchconnector (S3Client.get_object) on a thread pool.

The table gives the median requests/s and MB/s per peer and delay, and the goal
line: raydl at the largest delay against min(concurrency / delay, ceiling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["add_parser", "main"]

PEERS = ("raydl", "boto3", "s3dlio", "s3torchconnector")
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
        help="S3 fetch rate: raydl vs boto3, s3dlio, s3torchconnector",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--endpoint-url", help="an S3-compatible server (default: start moto on 127.0.0.1)")
    p.add_argument("--objects", type=int, default=256, help="objects to fetch per measurement")
    p.add_argument("--size", type=int, default=64 << 10, help="bytes per object")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight, every peer")
    p.add_argument("--delays", default="0,20,50", help="added milliseconds per request (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--compare",
        default="boto3,s3dlio,s3torchconnector",
        help=f"peers besides raydl, from {','.join(PEERS[1:])}",
    )
    p.add_argument("--json", help="write every measurement and the medians here")
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _child(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def _start_moto(env: dict) -> tuple[subprocess.Popen, str]:
    code = (
        "import logging,threading;logging.getLogger('werkzeug').setLevel(logging.ERROR);"
        "from moto.server import ThreadedMotoServer as S;s=S(ip_address='127.0.0.1',port=0,verbose=False);"
        "s.start();print(s.get_host_and_port()[1],flush=True);threading.Event().wait()"
    )
    proc = _child(["-c", code], env)
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


def _start_proxy(endpoint: str, delay_ms: float, env: dict) -> tuple[subprocess.Popen, str]:
    proc = _child(["-m", "raydl.bench.latency_proxy", endpoint.removeprefix("http://"), str(delay_ms)], env)
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


def _fill(endpoint: str, objects: int, size: int) -> list[str]:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=16))
    try:
        client.create_bucket(Bucket=_BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    keys = [f"obj/{i:06d}.bin" for i in range(objects)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=_BUCKET, Key=k, Body=os.urandom(size)), keys))
    return [f"s3://{_BUCKET}/{k}" for k in keys]


# -- one measurement, in a child process ------------------------------------------------------------


def _measure(peer: str, endpoint: str, uris: list[str], size: int, concurrency: int) -> dict:
    """Fetch every URI once (after a warm-up of `concurrency` requests); requests/s and MB/s."""
    if peer == "raydl":
        from raydl.options import S3Options
        from raydl.storage.fetch import IOPool
        from raydl.storage.s3 import S3Storage

        storage = S3Storage(S3Options(endpoint_url=endpoint, max_concurrency=concurrency))
        pool = IOPool(concurrency)

        def run(batch):
            return [f.result() for f in [pool.submit(storage.read_range, u, 0, size) for u in batch]]
    elif peer == "boto3":
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=concurrency))
        tpool = ThreadPoolExecutor(concurrency)

        def get(uri):
            bucket, key = uri[5:].split("/", 1)
            return client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{size - 1}")["Body"].read()

        def run(batch):
            return list(tpool.map(get, batch))
    elif peer == "s3dlio":
        import s3dlio

        s3dlio.configure_s3(endpoint_url=endpoint, region="us-east-1")

        def run(batch):
            return [bytes(d) for _, d in s3dlio.get_many(batch, max_in_flight=concurrency)]
    elif peer == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        client = S3Client(
            "us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
        )
        tpool = ThreadPoolExecutor(concurrency)

        def get(uri):
            bucket, key = uri[5:].split("/", 1)
            return client.get_object(bucket, key).read()

        def run(batch):
            return list(tpool.map(get, batch))
    else:
        raise ValueError(f"unknown peer {peer!r}")
    run(uris[:concurrency])  # connections, clients, threads: warm
    t0 = time.perf_counter()
    out = run(uris)
    took = time.perf_counter() - t0
    got = sum(len(b) for b in out)
    if got != size * len(uris):
        raise RuntimeError(f"{peer} fetched {got} bytes, expected {size * len(uris)}")
    return {"req_s": len(uris) / took, "mb_s": got / took / 1e6, "seconds": took}


_REQUIRES = {"raydl": "boto3", "boto3": "boto3", "s3dlio": "s3dlio", "s3torchconnector": "s3torchconnector"}


def _run_child(peer, endpoint, uris, size, concurrency, env, timeout=600.0) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "raydl.bench.storage",
        "--_measure",
        json.dumps(
            {"peer": peer, "endpoint": endpoint, "uris": uris, "size": size, "concurrency": concurrency}
        ),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"ok": False, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return {"ok": True, **json.loads(lines[-1])}


# -- the driver --------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    peers = ["raydl"] + [p.strip() for p in args.compare.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        _log(f"error: unknown peer(s) {unknown}; choose from {', '.join(PEERS[1:])}")
        return 2
    import importlib.util

    for p in list(peers):
        if importlib.util.find_spec(_REQUIRES[p]) is None:
            _log(f"{p} skipped: {_REQUIRES[p]} is not installed (pip install {_REQUIRES[p]})")
            peers.remove(p)
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    children = []
    if args.endpoint_url:
        endpoint = args.endpoint_url
    else:
        env.update(_CREDS)
        os.environ.update(_CREDS)
        moto, endpoint = _start_moto(env)
        children.append(moto)
    try:
        uris = _fill(endpoint, args.objects, args.size)
        targets = [("direct", 0.0, endpoint)]
        for d in delays:
            proxy, url = _start_proxy(endpoint, d, env)
            children.append(proxy)
            targets.append((f"{d:g} ms", d, url))
        _log(
            f"{args.objects} objects of {args.size} B, concurrency {args.concurrency}, "
            f"{args.rounds} round(s); server {endpoint}"
        )
        runs = []
        for r in range(1, args.rounds + 1):
            for label, delay, url in targets:
                for peer in peers:
                    row = _run_child(peer, url, uris, args.size, args.concurrency, env)
                    row.update(round=r, peer=peer, target=label, delay_ms=delay)
                    runs.append(row)
                    _log(
                        f"[round {r}] {label:>7} {peer:<17} "
                        + (
                            f"{row['req_s']:8.1f} req/s {row['mb_s']:8.2f} MB/s"
                            if row["ok"]
                            else f"FAILED: {row['error']}"
                        )
                    )
    finally:
        for c in children:
            c.kill()
            c.wait()
    summary = _summarize(peers, targets, runs)
    ceiling = max((v["req_s"] for (p, t), v in summary.items() if t == "direct" and v), default=0.0)
    print(_table(peers, targets, summary, args, ceiling))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "objects": args.objects,
                    "size": args.size,
                    "concurrency": args.concurrency,
                    "rounds": args.rounds,
                    "endpoint": args.endpoint_url or "moto (child process)",
                    "ceiling_req_s": ceiling,
                    "summary": [{"peer": p, "target": t, **(v or {})} for (p, t), v in summary.items()],
                    "runs": runs,
                },
                indent=2,
            )
            + "\n"
        )
        _log(f"wrote {args.json}")
    return 0 if all(v for (p, t), v in summary.items() if p == "raydl") else 1


def _summarize(peers, targets, runs) -> dict:
    out = {}
    for p in peers:
        for label, _, _ in targets:
            ok = [r for r in runs if r["peer"] == p and r["target"] == label and r["ok"]]
            out[(p, label)] = (
                {
                    "req_s": statistics.median(r["req_s"] for r in ok),
                    "mb_s": statistics.median(r["mb_s"] for r in ok),
                    "rounds_ok": len(ok),
                }
                if ok
                else None
            )
    return out


def _table(peers, targets, summary, args, ceiling) -> str:
    head = f"{'peer':<17}" + "".join(f"{label:>22}" for label, _, _ in targets)
    lines = [
        f"raydl bench storage: {args.objects} x {args.size} B, concurrency {args.concurrency}, "
        f"median of {args.rounds} round(s); requests/s (MB/s)",
        head,
        "-" * len(head),
    ]
    for p in peers:
        cells = []
        for label, _, _ in targets:
            v = summary[(p, label)]
            cells.append(f"{v['req_s']:>12.1f} ({v['mb_s']:6.2f})" if v else f"{'failed':>22}")
        lines.append(f"{p:<17}" + "".join(f"{c:>22}" for c in cells))
    lines.append("")
    lines.append(f"  * server ceiling (best direct rate of any peer): {ceiling:.1f} req/s")
    for label, delay, _ in targets[1:]:
        if delay <= 0:
            continue
        ideal = min(args.concurrency / (delay / 1000), ceiling)
        v = summary[("raydl", label)]
        best = max((summary[(p, label)]["req_s"] for p in peers if summary[(p, label)]), default=0.0)
        if v:
            lines.append(
                f"  * {label}: raydl {v['req_s']:.1f} req/s = {v['req_s'] / ideal:.2f} x "
                f"min({args.concurrency}/{delay / 1000:g} s, ceiling) (goal >= 0.8); "
                f"{v['req_s'] / best:.2f} x the best peer"
            )
    return "\n".join(lines)


def _cli(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--_measure"]:
        spec = json.loads(argv[1])
        print(
            json.dumps(
                _measure(spec["peer"], spec["endpoint"], spec["uris"], spec["size"], spec["concurrency"])
            )
        )
        return 0
    parser = argparse.ArgumentParser(prog="raydl bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    return main(parser.parse_args(["storage", *argv]))


if __name__ == "__main__":
    sys.exit(_cli())
