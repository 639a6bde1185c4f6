"""A fresh process for test_security and test_full_disk: `python _ckpt_child.py SCENARIO ARGS...` prints one
JSON line. It needs no torch: the checkpoints are safetensors files written here by hand."""
from __future__ import annotations

import json
import os
import resource
import struct
import sys


def safetensors_bytes(n: int) -> bytes:
    """A .safetensors file holding one uint8 tensor "x" of n bytes (0, 1, ... 255, 0, ...)."""
    header = json.dumps({"x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(i % 256 for i in range(n))


def write_checkpoint(path: str, n: int) -> str:
    with open(path, "wb") as f:
        f.write(safetensors_bytes(n))
    return path


def listening() -> list[list]:
    import psutil

    conns = psutil.Process().net_connections(kind="inet")
    return sorted([c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN)


def scenario_listen(workdir: str, bind: str | None) -> dict:
    """Listening sockets before import, after import (libfabric started), after two publishes, after
    unpublishing one, and after unpublishing the last."""
    out = {"before": listening()}
    from raydl import checkpoint

    checkpoint.prepare(wait=True)
    out["import"] = listening()
    kw = {} if bind is None else {"bind": bind}
    a = checkpoint.publish(write_checkpoint(os.path.join(workdir, "a.safetensors"), 4096),
                           transports=("fabric",), **kw)
    b = checkpoint.publish(write_checkpoint(os.path.join(workdir, "b.safetensors"), 4096),
                           transports=("fabric",), **kw)
    out["published"] = listening()
    out["hosts"] = [a.fabric.host, b.fabric.host]
    checkpoint.unpublish(a)
    out["one_left"] = listening()
    checkpoint.unpublish(b)
    out["none_left"] = listening()
    c = checkpoint.publish(os.path.join(workdir, "a.safetensors"), transports=("fabric",), **kw)
    out["again"] = listening()
    got = checkpoint.fetch(c)  # a fetch: its client endpoint binds where the server is
    out["fetched"] = int(got["x"].sum())
    out["fetching"] = listening()
    checkpoint.unpublish(c)
    return out


def scenario_fetch_into(target_dir: str, size: int, fsize_limit: int) -> dict:
    """Publish a `size`-byte tensor over fabric, fetch it into target_dir/out.safetensors (with RLIMIT_FSIZE
    at fsize_limit when > 0); report the error and what is left in target_dir."""
    from raydl import checkpoint

    src_dir = os.environ.get("CKPT_SRC_DIR", "/dev/shm")
    src = write_checkpoint(os.path.join(src_dir, f"raydl-test-src-{os.getpid()}.safetensors"), size)
    try:
        ref = checkpoint.publish(src, transports=("fabric",))
        if fsize_limit > 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
        out: dict = {"size": ref.size}
        try:
            got = checkpoint.fetch(ref, into=os.path.join(target_dir, "out.safetensors"), timeout=10)
            out["ok"] = int(got["x"].sum())
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        out["left"] = sorted(os.listdir(target_dir))
        checkpoint.unpublish(ref)
        return out
    finally:
        os.unlink(src)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "listen":
        result = scenario_listen(args[0], args[1] if len(args) > 1 else None)
    elif name == "fetch-into":
        result = scenario_fetch_into(args[0], int(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown scenario {name}")
    print(json.dumps(result))
    sys.stdout.flush()
