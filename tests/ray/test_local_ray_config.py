"""The local Ray that loader() starts for a process not connected to one gets raydl's Ray settings
(raydl.env.RAY_SYSTEM_CONFIG: the store frees dropped batches within 10 ms, not once a second). Run in a
child process with a Ray temp folder of its own; every process it leaves behind is stopped by its PID."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import psutil
import pytest

pytestmark = pytest.mark.timeout(240)

_CHILD = textwrap.dedent("""
    import json, tempfile
    import psutil, ray, raydl
    from raydl.demo import make_images

    root = tempfile.mkdtemp(prefix="raydl-config-")
    make_images(root, 8, corrupt=0)
    with raydl.read_images(root).decode().center_crop(16).loader(batch_size=4) as loader:
        batches = sum(1 for _ in loader.iterator(0).iter_batches())
        config = dict(ray._private.worker._global_node._config)
    left = [p.pid for p in psutil.Process().children(recursive=True)]
    ray.shutdown()
    print("RAYDL-RESULT " + json.dumps({"batches": batches, "config": config, "left": left}), flush=True)
""")


def test_the_local_ray_a_loader_starts_frees_dropped_batches_within_10_ms():
    tmp = tempfile.mkdtemp(prefix="rdlc-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k != "RAY_free_objects_period_milliseconds"}
    env["RAY_TMPDIR"] = tmp
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    left: list[int] = []
    try:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            left = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"the child did not finish: {stderr[-3000:]}")
        result = [ln for ln in stdout.splitlines() if ln.startswith("RAYDL-RESULT ")]
        assert proc.returncode == 0 and result, stderr[-3000:]
        got = json.loads(result[0].split(" ", 1)[1])
        left = got["left"]
        assert got["batches"] == 2
        assert got["config"].get("free_objects_period_milliseconds") == 10, got["config"]
    finally:
        procs = []
        for pid in left:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
