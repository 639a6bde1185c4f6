"""`raydl bench listing`: its flags and defaults, the DALI index it writes against wds2idx's, the requests its
proxy counts, and a tiny run (5 shards of 4 samples on moto, small synthetic catalogs) with every row reported."""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.bench import _listing_s3 as s3
from raydl.bench import listing

pytestmark = pytest.mark.timeout(120)

WDS2IDX = Path(sys.executable).parent / "wds2idx"
TINY = [
    "--shards", "5", "--per-shard", "4", "--delay-ms", "5",
    "--samples", "100000", "--catalog-shards", "100", "--parquet-files", "10", "--row-groups", "10",
    "--rows", "100", "--image-classes", "10", "--images-per-class", "10", "--batches", "10",
    "--corpus-tokens", "20000000", "--corpus-documents", "200000", "--synthetic-tokens", "10000000000",
]  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="raydl bench")
    listing.add_parser(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(["listing", *argv])


def test_the_defaults_are_the_issues_sizes_and_bad_flags_are_refused(capsys):
    """Defaults: 1,000 shards x 100 samples at 50 ms; 100 M samples in 100,000 shards; 10,000 Parquet files of
    10 x 1,000 rows; 1.28 M images. An unknown section or a size under 1 is exit 2, naming it."""
    a = _parse([])
    assert (a.shards, a.per_shard, a.delay_ms) == (1000, 100, 50.0)
    assert (a.samples, a.catalog_shards) == (100_000_000, 100_000)
    assert (a.parquet_files, a.row_groups, a.rows) == (10_000, 10, 1_000)
    assert a.image_classes * a.images_per_class == 1_280_000 and a.batch_size == 256
    assert (a.corpus_tokens, a.corpus_documents, a.seq_len) == (10**9, 10**7, 4096)
    assert listing.main(_parse(["--only", "wds,bogus"])) == 2
    assert "bogus" in capsys.readouterr().err
    assert listing.main(_parse(["--per-shard", "0"])) == 2
    assert "--per-shard" in capsys.readouterr().err


@pytest.mark.skipif(
    not WDS2IDX.exists() or shutil.which("tar") is None, reason="DALI's wds2idx is not installed"
)
def test_the_dali_index_is_the_one_wds2idx_writes(tmp_path):
    """The .idx files the bench puts beside its shards are byte for byte what DALI's wds2idx writes for them."""
    shard = tmp_path / "shard.tar"
    shard.write_bytes(s3.make_shard(7, 6, s3.tiny_jpegs(3)))
    subprocess.run([str(WDS2IDX), str(shard)], check=True, capture_output=True, cwd=tmp_path)
    assert (tmp_path / "shard.idx").read_bytes() == s3.dali_index(shard.read_bytes())


def test_the_proxy_counts_requests_by_kind():
    """Each request through the counting proxy is counted once by kind: LIST pages, HEADs, shard and .idx GETs."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Ok(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with s3.CountingProxy("127.0.0.1", server.server_address[1], delay_s=0.0) as proxy:
            conn = http.client.HTTPConnection(
                "127.0.0.1", proxy.port, timeout=10
            )  # one kept-alive connection
            for method, path in [
                ("GET", "/b?list-type=2&prefix=d%2F"),
                ("HEAD", "/b/d/0.tar"),
                ("GET", "/b/d/0.tar"),
                ("GET", "/b/d/1.tar"),
                ("GET", "/b/d/0.idx"),
                ("GET", "/b/d/x.json"),
            ]:
                conn.request(method, path)
                conn.getresponse().read()
            conn.close()
            assert proxy.snapshot() == {
                "list": 1,
                "head": 1,
                "shard": 2,
                "idx": 1,
                "other": 1,
                "connections": 1,
            }
    finally:
        server.shutdown()


@pytest.mark.timeout(300)  # five child processes; minutes on a loaded machine
def test_a_tiny_run_reports_every_row(tmp_path, capsys):
    """5 shards of 4 samples on moto behind 5 ms: GET every shard is 5 shard GETs; each listing finds 20 samples;
    with shard indexes the first listing reads each shard at most once and makes no HEAD,
    the cached one and the DALI one read no shard; the synthetic rows all come back, within their goals."""
    out = tmp_path / "listing.json"
    assert listing.main(_parse([*TINY, "--json", str(out)])) == 0
    text = capsys.readouterr().out
    got = json.loads(out.read_text())
    rows = {r["case"]: r for r in got["wds"]["rows"]}
    assert rows["GET every shard once"]["requests"] == {
        "list": 0,
        "head": 0,
        "shard": 5,
        "idx": 0,
        "other": 0,
    }
    listed = [r for r in rows.values() if "samples" in r]
    assert len(listed) >= 2 and all(r["samples"] == 20 for r in listed)
    if listing.has_shard_indexes():
        first, cached, dali = (
            rows["first-time indexing"],
            rows["cached listing"],
            rows["DALI .idx beside the shards"],
        )
        assert first["requests"]["head"] == 0 and first["requests"]["shard"] <= 5, first
        assert cached["requests"]["shard"] == 0 and cached["requests"]["head"] == 0, cached
        assert dali["requests"]["shard"] == 0 and dali["requests"]["idx"] == 5, dali
    else:
        assert "skipped" in rows["DALI .idx beside the shards"]
    for name in ("catalog", "parquet", "images", "images-walk", "tokens"):
        assert "error" not in got[name], got[name]
    tokens = got["tokens"]  # a Megatron corpus listed for real (its .bin sparse), and a synthetic catalog
    assert tokens["samples"] == (20_000_000 - 1) // 4096 and tokens["nbytes"] < 10e6 and tokens["plan_s"] > 0
    assert 150_000 < tokens["documents"] < 250_000 and tokens["idx_bytes"] == 42 + 20 * tokens["documents"]
    assert tokens["synthetic_samples"] == (10**10 - 1) // 4096 and tokens["synthetic_plan_s"] > 0
    assert got["catalog"]["samples"] == 100_000 and got["catalog"]["parts"] == 100
    assert got["parquet"]["samples"] == 10 * 10 * 100 and got["images"]["samples"] == 100
    for label in (
        "GET every shard once",
        "first-time indexing",
        "WebDataset catalog",
        "Parquet catalog",
        "images on S3",
        "images on local disk",
        "Megatron corpus (read_tokens, seq_len 4096)",
        "synthetic token catalog",
    ):
        assert label in text
