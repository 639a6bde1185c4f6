"""`raydl bench checkpoint`: one checkpoint moved across simulated nodes by raydl and by Ray, side by side.

    raydl bench checkpoint --size 1GiB --peers 1,2,4 --nodes 2 --rounds 3 \\
        --json ckpt.json --plot ckpt.png

Starts a `ray.cluster_utils.Cluster` of --nodes nodes on this machine (1 CPU
each, an object store of 2.5x the checkpoint), publishers and peers listening
on 127.0.0.1. The checkpoint is a state dict of float32 and bfloat16 tensors
adding up to --size bytes, held by an actor on node 0. Each round runs every
method once, in turn, so that a noisy neighbour hits them all alike:

* raydl fetch, fabric: node 0 publishes; an actor on node 1 times
  `checkpoint.fetch(ref, transport="fabric")` (RMA reads, XXH3-64 digest per chunk,
  tensors built on the bytes);
* raydl fetch, object store: the same with transports=("object_store",);
* ray.get of the bytes: node 0 `ray.put`s the same bytes as one numpy uint8
  array; an actor on node 1 times `ray.get` (what users do today);
* pyfi raw read (ceiling): `raw_read_rate(size, 4 MiB, 8 in flight)`, a bare
  read_into loop into memory already faulted in, no checksums;
* fabtests fi_rma_bw (ceiling), when installed;
* broadcast: for each P in --peers, P CheckpointPeer actors on the nodes other
  than the publisher's; `checkpoint.broadcast(ref, peers)` timed from the
  driver, and its ratio to the single-peer fabric fetch.

GB/s is 1e9 bytes/s; every figure in the table is the median over the rounds.
A small warm-up of each method (not counted) runs first, so one-off costs
(fabric set-up, Ray's first cross-node connection) do not land in round 1.
Everything is unpublished, dropped or killed after each step, so memory stays
at about two copies of the checkpoint per node (plus P during a broadcast).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from raydl.bench._ckpt_report import LABELS, format_table, summarize, write_plot
from raydl.bench.report import peer_versions
from raydl.env import local_ray_config

__all__ = ["add_parser", "main"]

_WARM_SIZE = 1 << 20
_MIN_OBJECT_STORE = 128 << 20  # Ray refuses tiny object stores
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '8M', '1.5G', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 512MiB, 8M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _peers(text: str) -> list[int]:
    try:
        out = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--peers wants comma-separated counts, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--peers wants positive counts, got {text!r}")
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `checkpoint` to a `raydl bench` subparser group."""
    p = subparsers.add_parser(
        "checkpoint",
        help="move one checkpoint across simulated nodes: raydl fabric vs object store vs ray.get",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("1GiB"),
        help="checkpoint bytes, e.g. 1GiB, 512MiB (default: 1GiB)",
    )
    p.add_argument(
        "--peers", type=_peers, default=[1, 2, 4], help="broadcast widths, comma-separated (default: 1,2,4)"
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated Ray nodes (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--provider",
        default=None,
        help="libfabric provider, e.g. 'tcp;ofi_rxm' or sockets (default: raydl's choice)",
    )
    p.add_argument("--chunk-size", type=parse_size, default=4 << 20, help="checkpoint chunk (default: 4MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per step before it counts as failed")
    p.add_argument(
        "--cold",
        action="store_true",
        help="time first fetches in fresh processes, phase by phase, against a warm fetch and ray.get",
    )
    p.add_argument(
        "--approaches",
        action="store_true",
        help="with --cold: also a first fetch per other way of faulting the receive buffer in "
        "(RAYDL_CHECKPOINT_FAULTS: ahead, ahead-huge, end-huge, reads, first), each in its own fresh process",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="cap every fabric link (fetch and each broadcast hop) at this many Gbit/s: a simulated "
        "network, so that links and not the shared CPU bound the figures",
    )
    p.add_argument(
        "--window",
        type=parse_size,
        default=8 << 20,
        help="broadcast: bytes a peer reads between looks at its upstream's progress (default: 8MiB)",
    )
    p.add_argument("--json", help="write every round, the medians and the targets here")
    p.add_argument("--plot", help="write a PNG chart here (needs matplotlib)")
    p.add_argument("-v", "--verbose", action="store_true", help="show the Ray workers' logs")
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


# -- fabtests -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fi_rma_bw(exe: str, size: int, chunk: int, provider: str, timeout: float) -> float:
    """GB/s of fabtests' `fi_rma_bw -o read` over `provider` on 127.0.0.1 (size/chunk reads of chunk
    bytes)."""
    port = str(_free_port())
    common = [
        exe,
        "-p",
        provider,
        "-e",
        "rdm",
        "-o",
        "read",
        "-S",
        str(chunk),
        "-I",
        str(max(10, size // chunk)),
    ]
    server = subprocess.Popen(
        [*common, "-s", "127.0.0.1", "-B", port], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        time.sleep(0.5)  # let the server listen
        client = subprocess.run(
            [*common, "-P", port, "127.0.0.1"], capture_output=True, text=True, timeout=timeout
        )
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if client.returncode != 0:
        raise RuntimeError(
            f"fi_rma_bw exited {client.returncode}: {(client.stderr or client.stdout).strip()[-300:]}"
        )
    lines = [ln.split() for ln in client.stdout.splitlines() if ln.strip()]
    for i, cols in enumerate(lines[:-1]):
        if "MB/sec" in cols:
            return float(lines[i + 1][cols.index("MB/sec")]) / 1e3
    raise RuntimeError(f"no MB/sec column in fi_rma_bw's output: {client.stdout.strip()[-300:]}")


# -- the cluster and its actors -----------------------------------------------------------
class _Bench:
    """The simulated cluster, the Source (node 0) and Sink (node 1) actors, and one step per method."""

    def __init__(self, args, provider: str) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.args, self.provider, self.timeout = args, provider, args.timeout
        self.object_store = max(int(2.5 * args.size) + 4 * _WARM_SIZE, _MIN_OBJECT_STORE)
        node_args = {"num_cpus": 1, "object_store_memory": self.object_store}
        head_args = {**node_args, "include_dashboard": False, "_system_config": local_ray_config()}
        self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
        try:
            for _ in range(args.nodes - 1):
                self.cluster.add_node(**node_args)
        except BaseException:
            self.cluster.shutdown()
            raise
        self.source = self.sink = None
        try:
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, logging_level="ERROR", log_to_driver=args.verbose)
            nodes = [self.cluster.head_node, *sorted(self.cluster.worker_nodes, key=lambda n: n.node_id)]
            self.node_ids = [n.node_id for n in nodes]
            self.peer_nodes = self.node_ids[1:] or self.node_ids[:1]
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _affinity(self, node_id: str) -> dict:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}

    def _start_actors(self) -> None:
        import ray

        from raydl.bench._ckpt_actors import Sink, Source

        self.source = (
            ray.remote(Source)
            .options(**self._affinity(self.node_ids[0]))
            .remote(self.args.size, _WARM_SIZE, self.provider)
        )
        self.sink = ray.remote(Sink).options(**self._affinity(self.peer_nodes[0])).remote()
        # building the state dict (normal_ over --size bytes) takes a while on a busy core
        got = ray.get(
            [self.source.node_id.remote(), self.sink.node_id.remote()], timeout=max(self.timeout, 600)
        )
        assert got == [self.node_ids[0], self.peer_nodes[0]], got

    def restart_actors(self) -> None:
        """After a failed step: whatever it left behind (a wedged call, held memory) goes with the actors."""
        import ray

        for a in (self.source, self.sink):
            if a is not None:
                ray.kill(a)
        self._start_actors()

    def shutdown(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            self.cluster.shutdown()

    # -- steps: each returns a row (seconds, bytes, ...) or raises --------------------------
    def fetch(self, transport: str, kind: str = "full") -> dict:
        import ray

        ref = ray.get(
            self.source.publish.remote(kind, (transport,), self.args.chunk_size), timeout=self.timeout
        )
        try:
            out = ray.get(
                self.sink.fetch.remote(ref, transport, min(self.timeout, 60.0), self.args.link_gbps),
                timeout=self.timeout,
            )
        finally:
            ray.get(self.source.unpublish.remote(ref.key), timeout=self.timeout)
            del ref  # the last handle on an object-store copy
        if out["transport"] != transport:
            raise RuntimeError(f"asked for {transport}, fetched over {out['transport']}")
        return out

    def ray_get(self, kind: str = "full") -> dict:
        import ray

        wrapped = ray.get(self.source.put.remote(kind), timeout=self.timeout)
        try:
            return ray.get(self.sink.get.remote(wrapped, self.timeout), timeout=self.timeout)
        finally:
            ray.get(self.source.drop.remote(wrapped[0].hex()), timeout=self.timeout)
            del wrapped

    def raw(self, size: int | None = None) -> dict:
        from raydl.native.pyfi._bench import raw_read_rate

        size = size or self.args.size
        gbps = raw_read_rate(size, 4 << 20, 8, self.provider, repeats=1)
        return {"seconds": size / gbps / 1e9, "bytes": size}

    def fi_rma_bw(self, exe: str) -> dict:
        gbps = fi_rma_bw(exe, self.args.size, 4 << 20, self.provider, self.timeout)
        return {"seconds": self.args.size / gbps / 1e9, "bytes": self.args.size}

    def broadcast(self, n: int) -> dict:
        """n fresh peers, warmed with a 1 MiB broadcast, then the timed broadcast of the full checkpoint."""
        import ray

        from raydl import checkpoint

        peers = [
            checkpoint.peer_actor(self.peer_nodes[i % len(self.peer_nodes)], provider=self.provider)
            for i in range(n)
        ]
        keys = []
        try:
            ray.get([p.name.remote() for p in peers], timeout=self.timeout)
            warm = ray.get(
                self.source.publish.remote("warm", ("fabric",), self.args.chunk_size), timeout=self.timeout
            )
            keys.append(warm.key)
            checkpoint.broadcast(
                warm,
                peers,
                timeout=self.timeout,
                link_gbps=self.args.link_gbps,
                window_bytes=self.args.window,
            )
            ref = ray.get(
                self.source.publish.remote("full", ("fabric",), self.args.chunk_size), timeout=self.timeout
            )
            keys.append(ref.key)
            t0, wall0 = time.perf_counter(), time.time()
            results = checkpoint.broadcast(
                ref, peers, timeout=self.timeout, link_gbps=self.args.link_gbps, window_bytes=self.args.window
            )
            seconds = time.perf_counter() - t0
            firsts = [r.get("first_window_at") for r in results]
            return {
                "seconds": seconds,
                "bytes": ref.size,
                "peers": n,
                # the chain's fill: from the call until the last peer has its first verified chunk
                "fill_seconds": max(firsts) - wall0 if None not in firsts else None,
                "slowest_peer_seconds": max(r["seconds"] for r in results),
                "peer_cpu_seconds": [r.get("cpu_seconds") for r in results],
                "sources": [r["source"] for r in results],
                "retried": sum(r["retried"] for r in results),
            }
        finally:
            for key in keys:
                try:
                    ray.get([p.release.remote(key) for p in peers], timeout=30)
                except Exception:  # noqa: BLE001 - the peers are killed next anyway
                    pass
                ray.get(self.source.unpublish.remote(key), timeout=self.timeout)
            for p in peers:
                ray.kill(p)


# -- the run ------------------------------------------------------------------------------
def _row(round_no: int, step: str, fn, *a, **kw) -> dict:
    t0 = time.perf_counter()
    try:
        out = fn(*a, **kw)
    except Exception as exc:  # noqa: BLE001 - a failed step is a row in the report, not the end of the run
        return {
            "round": round_no,
            "step": step,
            "ok": False,
            "error": _error(exc),
            "wall_s": time.perf_counter() - t0,
        }
    row = {"round": round_no, "step": step, "ok": True, **out, "wall_s": time.perf_counter() - t0}
    if step != "broadcast":
        row["gbps"] = out["bytes"] / out["seconds"] / 1e9
    return row


def _progress(rounds: int, row: dict) -> None:
    name = f"broadcast to {row['peers']} peer(s)" if row["step"] == "broadcast" else LABELS[row["step"]]
    head = f"[round {row['round']}/{rounds}] {name:<28}"
    if not row["ok"]:
        _log(f"{head} FAILED: {row['error']}")
    elif row["step"] == "broadcast":
        cpu = [c for c in row.get("peer_cpu_seconds") or () if c is not None]
        cpu_text = f"   CPU per peer {sum(cpu) / len(cpu):.3f} s (max {max(cpu):.3f})" if cpu else ""
        fill = f"   fill {row['fill_seconds']:.3f} s" if row.get("fill_seconds") is not None else ""
        _log(
            f"{head} {row['seconds']:8.3f} s   slowest pull {row['slowest_peer_seconds']:.3f} s"
            f"{fill}{cpu_text}  ({row['wall_s']:.0f} s)"
        )
    else:
        _log(f"{head} {row['gbps']:8.2f} GB/s  {row['seconds']:7.3f} s  ({row['wall_s']:.0f} s)")


def _warm_up(bench: _Bench) -> None:
    """One small pass of every method, not counted: fabric set-up and Ray's first cross-node pull."""
    for name, fn, a in (
        ("fabric", bench.fetch, ("fabric", "warm")),
        ("object store", bench.fetch, ("object_store", "warm")),
        ("ray.get", bench.ray_get, ("warm",)),
        ("raw", bench.raw, (_WARM_SIZE,)),
    ):
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001 - the counted rounds will show it
            _log(f"warm-up {name} failed: {_error(exc)}")


def main(args: argparse.Namespace) -> int:
    """Run the rounds, print the table, write --json/--plot. 0 when every method and width ran at least
    once."""
    refused = _refusal(args)
    if refused:
        _log(f"error: {refused}")
        return 2
    from raydl.native import pyfi

    provider = pyfi.choose_provider(args.provider)
    fabtests = shutil.which("fi_rma_bw")
    methods = ["raydl_fabric", "raydl_object_store", "ray_get", "pyfi_raw"] + ["fi_rma_bw"] * bool(fabtests)
    notes = []
    if not fabtests:
        notes.append(
            "fabtests' fi_rma_bw is not installed here (Debian's libfabric-bin ships only fi_info, "
            "fi_pingpong and fi_strerror; build fabtests from the libfabric sources for it)"
        )
    if args.nodes == 1:
        notes.append("--nodes 1: publisher and fetcher share a node, so ray.get reads a local object")
    _log(
        f"checkpoint {_human(args.size)}, {args.nodes} node(s), provider {provider}, peers "
        f"{','.join(map(str, args.peers))}, {args.rounds} round(s) of: {' '.join(methods)} broadcast"
    )
    t_start = time.perf_counter()
    with _loopback_env():
        bench = None
        try:
            t0 = time.perf_counter()
            bench = _Bench(args, provider)
            _log(
                f"cluster and actors up in {time.perf_counter() - t0:.0f} s "
                f"(object store {_human(bench.object_store)} per node)"
            )
            if args.cold:
                return _main_cold(args, bench, provider)
            runs = _rounds(args, bench, fabtests)
        finally:
            if bench is not None:
                bench.shutdown()
    summary = summarize(methods, args.peers, runs, paced=bool(args.link_gbps))
    _report(args, provider, methods, summary, notes)
    if args.json:
        report = {
            "size": args.size,
            "nodes": args.nodes,
            "peers": args.peers,
            "rounds": args.rounds,
            "provider": provider,
            "chunk_size": args.chunk_size,
            "timeout": args.timeout,
            "object_store_memory_per_node": bench.object_store,
            "methods": methods,
            "versions": peer_versions(),
            "fi_rma_bw": fabtests,
            "summary": summary,
            "runs": runs,
            "notes": notes,
            "wall_s": time.perf_counter() - t_start,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _log(f"wrote {args.json}")
    if args.plot:
        write_plot(
            summary, args.plot, title=f"checkpoint {_human(args.size)}, {args.nodes} nodes, {provider}"
        )
        _log(f"wrote {args.plot}")
    ok = all(r["rounds_ok"] > 0 for r in summary["methods"]) and all(
        c["rounds_ok"] > 0 for c in summary["broadcast"]
    )
    return 0 if ok else 1


def _refusal(args: argparse.Namespace) -> str | None:
    """Why this run cannot go ahead (bad flags, no libfabric, Ray already up), or None."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'raydl-loader[bench]'"
    if args.nodes < 1 or args.rounds < 1 or args.timeout <= 0 or args.chunk_size <= 0:
        return "--nodes, --rounds, --timeout and --chunk-size must be positive"
    if args.link_gbps is not None and args.link_gbps <= 0:
        return "--link-gbps must be positive"
    if args.size % 4 or args.size < 64 << 10:
        return f"--size must be a multiple of 4 bytes and at least 64KiB, got {args.size}"
    from raydl.native import pyfi

    if not pyfi.available():
        return f"libfabric is unusable here, nothing to compare: {pyfi.unavailable_reason()}"
    import ray

    if ray.is_initialized():
        return "raydl bench checkpoint starts its own simulated cluster; call it without Ray initialised"
    return None


@contextlib.contextmanager
def _loopback_env():
    """Publishers and peers listen on loopback; the nodes' workers inherit this and can import raydl."""
    saved = {k: os.environ.get(k) for k in ("RAYDL_CHECKPOINT_BIND", "PYTHONPATH")}
    os.environ["RAYDL_CHECKPOINT_BIND"] = "127.0.0.1:0"
    here = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, saved["PYTHONPATH"]]))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rounds(args: argparse.Namespace, bench: _Bench, fabtests: str | None) -> list[dict]:
    """Every method and broadcast width once per round, in turn; the actors restart after a failure."""
    _warm_up(bench)
    runs: list[dict] = []
    for i in range(1, args.rounds + 1):
        steps = [
            ("raydl_fabric", bench.fetch, ("fabric",)),
            ("raydl_object_store", bench.fetch, ("object_store",)),
            ("ray_get", bench.ray_get, ()),
            ("pyfi_raw", bench.raw, ()),
        ]
        if fabtests:
            steps.append(("fi_rma_bw", bench.fi_rma_bw, (fabtests,)))
        steps += [("broadcast", bench.broadcast, (n,)) for n in args.peers]
        for step, fn, a in steps:
            row = _row(i, step, fn, *a)
            if step == "broadcast" and not row["ok"]:
                row["peers"] = a[0]
            runs.append(row)
            _progress(args.rounds, row)
            if not row["ok"] and step != "pyfi_raw" and step != "fi_rma_bw":
                _log("restarting the Source and Sink actors after the failure")
                bench.restart_actors()
    return runs


def _report(
    args: argparse.Namespace, provider: str, methods: list[str], summary: dict, notes: list[str]
) -> None:
    """The table and the notes under it, on stdout (the notes are kept for --json too)."""
    print(
        format_table(
            summary,
            header=(
                f"raydl bench checkpoint: {_human(args.size)} checkpoint (float32 + bfloat16 tensors), "
                f"{args.nodes} simulated node(s), provider {provider}, chunks {_human(args.chunk_size)}, "
                f"median of {args.rounds} round(s)"
            ),
        )
    )
    notes.append(
        "GB/s = 1e9 bytes/s. raydl fetches include connecting, an XXH3-64 digest of every chunk and building "
        "the tensors; the raw pyfi read does none of that and reads into memory already faulted in"
    )
    notes.append(
        "broadcast seconds: from the driver's broadcast() call to every peer holding a verified copy "
        "(peers started and warmed beforehand); fill: from that call until the last peer has its first "
        "verified chunk; x single = over the single-peer fabric fetch"
    )
    cores = len(os.sched_getaffinity(0))
    notes.append(
        f"all {args.nodes} simulated nodes share this machine's {cores} core(s) and its loopback: a "
        "P-peer broadcast moves P copies through the same cores, so x single grows with P here; the "
        "<= 2x target presumes a host and NIC per peer"
    )
    print()
    for note in notes:
        print(f"  * {note}")


def _main_cold(args, bench, provider: str) -> int:
    from raydl.bench._ckpt_cold import format_cold, run_cold, summarize_cold

    runs = run_cold(bench, args.rounds, _log, approaches=args.approaches)
    try:
        raw = bench.raw()["seconds"]
    except Exception as exc:  # noqa: BLE001 - the table says "-"
        _log(f"pyfi raw read failed: {_error(exc)}")
        raw = None
    summary = summarize_cold(runs, raw)
    link = f", links capped at {args.link_gbps:g} Gbit/s" if args.link_gbps else ""
    print(
        format_cold(
            summary,
            header=(
                f"raydl bench checkpoint --cold: {_human(args.size)} checkpoint, {args.nodes} simulated "
                f"node(s), provider {provider}{link}, median of {args.rounds} round(s)"
            ),
        )
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "size": args.size,
                    "provider": provider,
                    "cold": summary,
                    "runs": runs,
                    "link_gbps": args.link_gbps,
                },
                indent=2,
            )
            + "\n"
        )
        _log(f"wrote {args.json}")
    return (
        0
        if all(k in r for r in runs for k in ("cold_off", "cold", "cold_prepared", "warm", "raw", "ray_get"))
        else 1
    )


def _cli(argv: list[str] | None = None) -> int:
    """`python -m raydl.bench.checkpoint ...`, for use before the `raydl` CLI wires it in."""
    parser = argparse.ArgumentParser(prog="raydl bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    return main(parser.parse_args(["checkpoint", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(_cli())
