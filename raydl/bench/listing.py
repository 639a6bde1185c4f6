"""`raydl bench listing`: what listing a dataset costs at the sizes users train on.

    raydl bench listing [--shards 1000 --per-shard 100 --delay-ms 50]
        [--samples 100000000 --catalog-shards 100000] [--parquet-files 10000 --row-groups 10 --rows 1000]
        [--image-classes 1000 --images-per-class 1280] [--only wds,catalog,parquet,images,tokens]
        [--corpus-tokens 1000000000 --corpus-documents 10000000 --synthetic-tokens 1000000000000]
        [--json PATH]

Five sections, each in its own child process (so a memory peak is its own):

* wds: N WebDataset shards of M samples (tiny JPEGs, webdataset's TarWriter)
  on a moto server started on 127.0.0.1, behind a proxy adding --delay-ms to
  every request and counting them. Rows: GET every shard once (whole, as many
  threads as the listing uses), first-time indexing (a fresh RAYDL_CACHE_DIR),
  the cached listing (the same folder again) and DALI .idx files beside the
  shards (a fresh folder; only where read_webdataset takes index=). Goals:
  cached <= 10 s, first-time <= 2 x GET-every-shard-once.
* catalog: a synthetic WebDataset catalog of --samples samples in
  --catalog-shards shards (from counts: no data), built with make_catalog;
  its driver memory and the time to plan one batch (EpochOrder positions ->
  ids -> Catalog.locate). Goals: <= 500 MB, <= 1 ms per batch.
* parquet: the same for --parquet-files files of --row-groups row groups of
  --rows rows (a part per row group).
* images: list_image_folder over a synthetic storage listing --image-classes x
  --images-per-class ImageNet-like keys; peak memory and the catalog's size.
  Goal: <= 200 MB. Then the same names as empty files in a temporary folder on
  local disk, listed for real (walk and stat): its time, CPU and the files it
  opened (an audit hook). Goals: <= 5 s a million files, none opened.
* tokens: a Megatron corpus of --corpus-tokens tokens in --corpus-documents documents
  (its .idx written for real in a temporary folder, its .bin a sparse file of the
  right size: listing reads the .idx alone), listed by read_tokens(seq_len 4,096):
  the time, the driver's catalog and the time to plan one batch; then planning on
  a synthetic token catalog of --synthetic-tokens tokens (from counts). Goals:
  listing <= 2 s, catalog <= 10 MB, <= 1 ms a batch whatever the corpus size.

Memory is tracemalloc's peak plus what Arrow's pool holds (tracemalloc does not
see it), and the growth of the child's peak RSS over its start.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["SECTIONS", "add_parser", "main"]

# The flags a section's child process gets (the WebDataset section takes its own).
_SECTION_OPTIONS = (
    "samples",
    "catalog_shards",
    "parquet_files",
    "row_groups",
    "rows",
    "image_classes",
    "images_per_class",
    "batch_size",
    "batches",
    "corpus_tokens",
    "corpus_documents",
    "synthetic_tokens",
    "seq_len",
)

SECTIONS = ("wds", "catalog", "parquet", "images", "tokens")
_MB = 1e6
_BUCKET = "raydl-bench-listing"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "listing",
        help="listing at scale: WebDataset on S3, 100 M-sample catalogs, image folders",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shards", type=int, default=1000, help="WebDataset shards on S3 (default 1000)")
    p.add_argument("--per-shard", type=int, default=100, help="samples per shard (default 100)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="added to every request (default 50)")
    p.add_argument(
        "--threads", type=int, default=None, help="GET-every-shard threads (default: the listing's own)"
    )
    p.add_argument("--samples", type=int, default=100_000_000, help="synthetic catalog samples")
    p.add_argument("--catalog-shards", type=int, default=100_000, help="synthetic catalog shards")
    p.add_argument("--parquet-files", type=int, default=10_000)
    p.add_argument("--row-groups", type=int, default=10, help="row groups per Parquet file")
    p.add_argument("--rows", type=int, default=1_000, help="rows per row group")
    p.add_argument("--image-classes", type=int, default=1000)
    p.add_argument("--images-per-class", type=int, default=1280)
    p.add_argument(
        "--corpus-tokens", type=int, default=1_000_000_000, help="tokens: the Megatron corpus's tokens"
    )
    p.add_argument("--corpus-documents", type=int, default=10_000_000, help="tokens: its documents")
    p.add_argument(
        "--synthetic-tokens", type=int, default=10**12, help="tokens: the synthetic token catalog's tokens"
    )
    p.add_argument("--seq-len", type=int, default=4096, help="tokens: the window (default 4096)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=100, help="batches to average the planning cost over")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, from {','.join(SECTIONS)}")
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env() -> dict:
    from raydl.bench.storage import _CREDS

    env = {**os.environ, **_CREDS}
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return env


def listing_threads() -> int:
    """The threads read_webdataset lists with (16 on every build so far)."""
    from raydl.sources import webdataset

    return int(getattr(webdataset, "_LISTING_THREADS", 16))


def has_shard_indexes() -> bool:
    """Whether this build's read_webdataset takes index= (shard indexes: DALI .idx, the node cache)."""
    import raydl

    return "index" in inspect.signature(raydl.read_webdataset).parameters


# -- wds ------------------------------------------------------------------------------------------------


def run_wds(args: argparse.Namespace) -> dict:
    """The WebDataset-on-S3 rows: seconds and requests by kind, side by side."""
    from raydl.bench import _listing_s3 as s3
    from raydl.bench.storage import _start_moto

    env = _env()
    threads = args.threads or listing_threads()
    indexes = has_shard_indexes()
    n, m = args.shards, args.per_shard
    t0 = time.perf_counter()
    jpegs = s3.tiny_jpegs()
    shards = {f"wds/shard-{s:06d}.tar": s3.make_shard(s, m, jpegs) for s in range(n)}
    objects = dict(shards)
    if indexes:
        objects.update({f"dali/shard-{s:06d}.tar": shards[f"wds/shard-{s:06d}.tar"] for s in range(n)})
        objects.update(
            {f"dali/shard-{s:06d}.idx": s3.dali_index(shards[f"wds/shard-{s:06d}.tar"]) for s in range(n)}
        )
    made = time.perf_counter() - t0
    total = sum(len(b) for b in shards.values())
    moto, endpoint = _start_moto(env)
    proxy = None
    tmp = tempfile.mkdtemp(prefix="raydl-bench-listing-")
    rows: list[dict] = []
    try:
        s3.upload(endpoint, _BUCKET, objects, env)
        del objects
        _log(
            f"wds: {n} shards x {m} samples ({total / _MB:.1f} MB) made in {made:.1f} s and uploaded; "
            f"{args.delay_ms:g} ms per request, {threads} threads"
        )
        proxy = s3.ProxyChild(endpoint, args.delay_ms, env)
        pattern = f"s3://{_BUCKET}/wds/shard-{{{0:06d}..{n - 1:06d}}}.tar"
        cache = os.path.join(tmp, "cache")
        cases = [
            (
                "GET every shard once",
                {"what": "get", "uris": [f"s3://{_BUCKET}/{k}" for k in shards], "threads": threads},
            ),
            ("first-time indexing", {"what": "list", "url": pattern, "cache_dir": cache}),
            (
                "cached listing" if indexes else "second listing (no index cache in this build)",
                {"what": "list", "url": pattern, "cache_dir": cache},
            ),
        ]
        if indexes:
            cases.append(
                (
                    "DALI .idx beside the shards",
                    {
                        "what": "list",
                        "url": pattern.replace("/wds/", "/dali/"),
                        "cache_dir": os.path.join(tmp, "dali-cache"),
                    },
                )
            )
        for label, spec in cases:
            before = proxy.counts()
            result = s3.run_child({**spec, "endpoint": proxy.url}, env)
            after = proxy.counts()
            grew = {k: after[k] - before[k] for k in after}
            row = {"case": label, **result, "connections": grew.pop("connections"), "requests": grew}
            rows.append(row)
            _log(
                f"wds: {label}: "
                + (
                    f"{row['seconds']:.2f} s, {sum(row['requests'].values())} requests"
                    if "seconds" in row
                    else f"FAILED: {row['error']}"
                )
            )
        if not indexes:
            rows.append(
                {
                    "case": "DALI .idx beside the shards",
                    "skipped": "this build's read_webdataset takes no index= (no shard indexes yet)",
                }
            )
    finally:
        if proxy is not None:
            proxy.close()
        moto.kill()
        moto.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "shards": n,
        "per_shard": m,
        "bytes": total,
        "delay_ms": args.delay_ms,
        "threads": threads,
        "rows": rows,
    }


# -- synthetic sections (in a child: `python -m raydl.bench.listing --_section NAME ARGS`) ---------------


def run_synthetic(name: str, opts: dict) -> dict:
    """One synthetic section in this process: memory and (for catalogs) the planning cost."""
    from raydl.bench import _listing_synthetic as syn

    if name == "images-disk":
        return _run_disk(opts)
    if name == "tokens":
        return _run_tokens(opts)
    if name in ("images", "images-walk"):
        from raydl.sources.images import list_image_folder

        storage = syn.ImageNetListing(
            opts["image_classes"], opts["images_per_class"], local=name == "images-walk"
        )
        cat, mem = syn.measure_memory(lambda: list_image_folder(storage.root, storage=storage))
        out = {"samples": len(cat), "parts": cat.num_parts, "shards": cat.shards.num_rows}
    else:
        if name == "catalog":
            build = lambda: syn.webdataset_catalog(opts["samples"], opts["catalog_shards"])  # noqa: E731
        else:
            build = lambda: syn.parquet_catalog(opts["parquet_files"], opts["row_groups"], opts["rows"])  # noqa: E731
        cat, mem = syn.measure_memory(build)
        out = {"samples": len(cat), "parts": cat.num_parts, "shards": cat.shards.num_rows}
        runs = [syn.plan_cost(cat, batch_size=opts["batch_size"], batches=opts["batches"]) for _ in range(5)]
        out.update(plan_s=min(runs), plan_runs_s=runs)
    out.update(
        nbytes=cat.nbytes,
        peak_bytes=mem.peak_bytes,
        rss_bytes=mem.rss_bytes,
        held_bytes=mem.held_bytes,
        build_s=mem.seconds,
    )
    return out


def _run_disk(opts: dict) -> dict:
    """The image listing of a real folder of --image-classes x --images-per-class empty files on local disk
    (made first, in a temporary folder, and removed after): its time, its CPU, its memory and the files it
    opened (an audit hook counts them; the goal is none)."""
    from raydl.bench import _listing_synthetic as syn
    from raydl.sources.images import list_image_folder

    top = tempfile.mkdtemp(prefix="raydl-bench-listing-")
    try:
        t0 = time.perf_counter()
        root = syn.make_empty_folder(top, opts["image_classes"], opts["images_per_class"])
        made_s = time.perf_counter() - t0
        opened = syn.watch_opens(root)
        cpu: list[float] = []

        def build():
            c0 = time.process_time()
            cat = list_image_folder(root)
            cpu.append(time.process_time() - c0)
            return cat

        cat, mem = syn.measure_memory(build)
        return {
            "samples": len(cat),
            "parts": cat.num_parts,
            "shards": cat.shards.num_rows,
            "nbytes": cat.nbytes,
            "peak_bytes": mem.peak_bytes,
            "rss_bytes": mem.rss_bytes,
            "held_bytes": mem.held_bytes,
            "build_s": mem.seconds,
            "cpu_s": cpu[0],
            "files_opened": len(opened),
            "made_s": made_s,
        }
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _run_tokens(opts: dict) -> dict:
    """read_tokens of a Megatron corpus of --corpus-tokens tokens in --corpus-documents documents (the .idx
    written first in a temporary folder, the .bin sparse; removed after): the listing's time and memory,
    the catalog's size and the planning cost; then the planning cost on a synthetic token catalog."""
    import raydl
    from raydl.bench import _listing_synthetic as syn
    from raydl.bench._windows import write_megatron_corpus

    top = tempfile.mkdtemp(prefix="raydl-bench-listing-tokens-")
    try:
        t0 = time.perf_counter()
        prefix = write_megatron_corpus(
            os.path.join(top, "corpus"),
            tokens=opts["corpus_tokens"],
            documents=opts["corpus_documents"],
            sparse=True,
        )
        made_s = time.perf_counter() - t0
        idx_bytes = os.path.getsize(prefix + ".idx")
        warm = write_megatron_corpus(os.path.join(top, "warm"), tokens=10_000, documents=10)
        raydl.read_tokens(warm, seq_len=opts["seq_len"])  # the listing's imports and first-call costs
        cat, mem = syn.measure_memory(lambda: raydl.read_tokens(prefix, seq_len=opts["seq_len"]).catalog)
        documents = (idx_bytes - 34 - 8) // 20
        runs = [syn.plan_cost(cat, batch_size=opts["batch_size"], batches=opts["batches"]) for _ in range(5)]
        big = syn.token_catalog(opts["synthetic_tokens"], opts["seq_len"])
        big_runs = [
            syn.plan_cost(big, batch_size=opts["batch_size"], batches=opts["batches"]) for _ in range(5)
        ]
        return {
            "samples": len(cat),
            "parts": cat.num_parts,
            "shards": cat.shards.num_rows,
            "tokens": opts["corpus_tokens"],
            "seq_len": opts["seq_len"],
            "documents": documents,
            "idx_bytes": idx_bytes,
            "nbytes": cat.nbytes,
            "peak_bytes": mem.peak_bytes,
            "rss_bytes": mem.rss_bytes,
            "held_bytes": mem.held_bytes,
            "build_s": mem.seconds,
            "plan_s": min(runs),
            "plan_runs_s": runs,
            "made_s": made_s,
            "synthetic_tokens": opts["synthetic_tokens"],
            "synthetic_samples": len(big),
            "synthetic_parts": big.num_parts,
            "synthetic_nbytes": big.nbytes,
            "synthetic_plan_s": min(big_runs),
        }
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _section_child(name: str, args: argparse.Namespace, env: dict) -> dict:
    import subprocess

    opts = {k: getattr(args, k) for k in _SECTION_OPTIONS}
    cmd = [sys.executable, "-m", "raydl.bench.listing", "--_section", name, json.dumps(opts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(lines[-1])


# -- the report -----------------------------------------------------------------------------------------

GOALS = {
    "catalog": (500 * _MB, 1e-3),
    "parquet": (500 * _MB, 1e-3),
    "images": (200 * _MB, None),
    "images-walk": (200 * _MB, None),
    "images-disk": (200 * _MB, None),
}
DISK_GOAL_S = 5.0  # a million files on local disk, listed (no file read)
_WHAT = {
    "catalog": "WebDataset catalog (synthetic)",
    "parquet": "Parquet catalog (synthetic)",
    "images": "images on S3 (key order, etags)",
    "images-walk": "images on local disk (os.walk order)",
    "images-disk": "empty files on this disk (walk + stat)",
}


TOKENS_GOALS = (2.0, 10 * _MB, 1e-3)  # listing seconds, catalog bytes, planning seconds a batch


def _tokens_report(r: dict) -> list[str]:
    """The tokens section: the real corpus's listing, catalog and planning, and the synthetic catalog's."""
    if "error" in r:
        return [f"Megatron corpus (read_tokens)  FAILED: {r['error']}", ""]
    list_goal, cat_goal, plan_goal = TOKENS_GOALS
    ok = r["build_s"] <= list_goal and r["nbytes"] <= cat_goal and r["plan_s"] <= plan_goal
    big_ok = r["synthetic_plan_s"] <= plan_goal
    rss = f"{r['rss_bytes'] / _MB:.1f}" if r["rss_bytes"] is not None else "?"
    head = f"Megatron corpus (read_tokens, seq_len {r['seq_len']})"
    return [
        f"{head}: {r['tokens']:,} tokens in {r['documents']:,} documents (.idx "
        f"{r['idx_bytes'] / _MB:.0f} MB, .bin sparse; written in {r['made_s']:.0f} s, not counted)",
        f"  listing {r['build_s']:.2f} s, catalog {r['nbytes'] / _MB:.3f} MB ({r['samples']:,} windows in "
        f"{r['parts']:,} parts), peak {r['peak_bytes'] / _MB:.1f} MB (RSS+ {rss} MB), planning a batch "
        f"{r['plan_s'] * 1e3:.3f} ms (goals <= {list_goal:g} s, <= {cat_goal / _MB:g} MB, "
        f"<= {plan_goal * 1e3:g} ms): {'ok' if ok else 'MISSED'}",
        f"  synthetic token catalog of {r['synthetic_tokens']:,} tokens ({r['synthetic_samples']:,} "
        f"windows, {r['synthetic_parts']:,} parts, {r['synthetic_nbytes'] / _MB:.1f} MB): planning a "
        f"batch {r['synthetic_plan_s'] * 1e3:.3f} ms (goal <= {plan_goal * 1e3:g} ms): "
        f"{'ok' if big_ok else 'MISSED'}",
        "",
    ]


def report(results: dict) -> str:
    """The tables: the WebDataset rows side by side, the tokens section, then one row per synthetic
    section."""
    lines: list[str] = []
    if "tokens" in results:
        lines += _tokens_report(results["tokens"])
    wds = results.get("wds")
    if wds:
        lines += [
            f"WebDataset on S3 (moto on 127.0.0.1 + {wds['delay_ms']:g} ms per request): "
            f"{wds['shards']} shards x {wds['per_shard']} samples, {wds['bytes'] / _MB:.1f} MB, "
            f"{wds['threads']} threads",
            f"{'case':<46}{'seconds':>9}{'requests':>10}   list head shard  idx other  connections",
        ]
        by = {r["case"]: r for r in wds["rows"]}
        for r in wds["rows"]:
            if "skipped" in r or "error" in r:
                why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['error']}"
                lines.append(f"{r['case']:<46}  {why}")
                continue
            q = r["requests"]
            lines.append(
                f"{r['case']:<46}{r['seconds']:>9.2f}{sum(q.values()):>10}   "
                f"{q['list']:>4} {q['head']:>4} {q['shard']:>5} {q['idx']:>4} {q['other']:>5}"
                f"{r.get('connections', 0):>13}"
            )
        get, first = by.get("GET every shard once", {}), by.get("first-time indexing", {})
        cached = by.get("cached listing", {})
        if "seconds" in get and "seconds" in first:
            ratio = first["seconds"] / get["seconds"]
            lines.append(
                f"  * first-time indexing = {ratio:.2f} x GET every shard once (goal <= 2): "
                f"{'ok' if ratio <= 2 else 'MISSED'}"
            )
        if "seconds" in cached:
            lines.append(
                f"  * cached listing {cached['seconds']:.2f} s (goal <= 10 s): "
                f"{'ok' if cached['seconds'] <= 10 else 'MISSED'}"
            )
        lines.append("")
    rows = [(name, results[name]) for name in _WHAT if name in results]
    if rows:
        lines.append(
            f"{'driver memory':<40}{'samples':>13}{'parts':>11}{'nbytes MB':>10}{'peak MB':>9}"
            f"{'RSS+ MB':>9}{'build s':>9}{'plan ms':>9}  goal"
        )
        for name, r in rows:
            if "error" in r:
                lines.append(f"{_WHAT[name]:<40}  FAILED: {r['error']}")
                continue
            mem_goal, plan_goal = GOALS[name]
            plan = f"{r['plan_s'] * 1e3:>9.3f}" if "plan_s" in r else f"{'-':>9}"
            rss = r["rss_bytes"]
            ok = max(r["peak_bytes"], rss or 0) <= mem_goal and (
                plan_goal is None or r["plan_s"] <= plan_goal
            )
            goal = f"<= {mem_goal / _MB:.0f} MB" + (f", <= {plan_goal * 1e3:g} ms" if plan_goal else "")
            rss_cell = f"{rss / _MB:>9.1f}" if rss is not None else f"{'?':>9}"
            if "files_opened" in r:  # the real folder: its time per million files and the files it opened
                per_m = r["build_s"] * 1e6 / max(r["samples"], 1)
                ok = ok and per_m <= DISK_GOAL_S and r["files_opened"] == 0
                goal += f", <= {DISK_GOAL_S:g} s a million files, none opened"
            lines.append(
                f"{_WHAT[name]:<40}{r['samples']:>13,}{r['parts']:>11,}{r['nbytes'] / _MB:>10.1f}"
                f"{r['peak_bytes'] / _MB:>9.1f}{rss_cell}{r['build_s']:>9.2f}{plan}  "
                f"{goal}: {'ok' if ok else 'MISSED'}"
            )
            if "files_opened" in r:
                lines.append(
                    f"  * {r['samples']:,} files: {r['build_s']:.2f} s, {r['cpu_s']:.2f} s CPU, "
                    f"{r['files_opened']} opened, {r['nbytes'] / max(r['samples'], 1):.0f} bytes of catalog "
                    f"a file (made in {r['made_s']:.0f} s, not counted)"
                )
        lines.append(
            "  * peak: tracemalloc's peak + Arrow's pool; RSS+: the rise of the child's peak RSS (a bare "
            "build); plan ms: per batch, the best of 5 runs (rank 0 of 8)"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        _log(f"error: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
        return 2
    for flag in ("shards", "per_shard", *_SECTION_OPTIONS):
        if getattr(args, flag) < 1:
            _log(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
            return 2
    results: dict = {}
    env = _env()
    for name in only:
        t0 = time.perf_counter()
        if name == "wds":
            results[name] = run_wds(args)
        else:  # the image listing as S3 lists (key order, etags), as a local disk does (a sort more), and
            # of a real folder on this disk (walk and stat)
            for part in (name, "images-walk", "images-disk") if name == "images" else (name,):
                results[part] = _section_child(part, args, env)
        _log(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        _log(f"wrote {args.json}")
    failed = any("error" in r for r in results.values()) or any(
        "error" in row for row in results.get("wds", {}).get("rows", [])
    )
    return 1 if failed else 0


def _cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_section"]:
        print(json.dumps(run_synthetic(argv[1], json.loads(argv[2]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="raydl bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    return main(parser.parse_args(["listing", *argv]))


if __name__ == "__main__":
    sys.exit(_cli())
