"""How a loader meets Ray in a process of its own. It never starts Ray or joins a cluster from a background
thread: built outside `with` and left open, then ray.shutdown(), its threads end quietly, no Ray call connects
again, and using it says Ray is gone. The local Ray a loader starts gets raydl's Ray settings
(raydl.env.RAY_SYSTEM_CONFIG: the store frees dropped batches within 10 ms, not once a second).

Each runs in a child process with a Ray temp folder of its own (RAY_TMPDIR), so that even a Ray that did
connect on its own could only find this test's cluster; every process the child leaves behind is stopped by
its PID."""

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
    import json, os, sys, tempfile, time
    import psutil, ray, raydl
    from raydl.demo import make_images
    from raydl.errors import LoaderError

    root = tempfile.mkdtemp(prefix="raydl-session-")
    make_images(root, 12, corrupt=0)
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    loader = raydl.read_images(root).decode().center_crop(16).loader(batch_size=4)   # no `with`
    ray.shutdown()
    print("RAYDL-MARK ray is shut down", file=sys.stderr, flush=True)
    time.sleep(4)  # the launch thread would have started the workers 1 s after the loader was built
    out = {"initialized": ray.is_initialized()}
    try:
        loader.iterator(0)
    except LoaderError as exc:
        out["iterator"] = str(exc)
    loader.shutdown()
    time.sleep(1)
    out["initialized_at_end"] = ray.is_initialized()
    out["left"] = [(p.pid, p.name()) for p in psutil.Process().children(recursive=True)]
    print("RAYDL-RESULT " + json.dumps(out), flush=True)
""")


_CHILD_OWN_RAY = textwrap.dedent("""
    import json, tempfile
    import psutil, ray, raydl
    from raydl.demo import make_images

    root = tempfile.mkdtemp(prefix="raydl-config-")
    make_images(root, 8, corrupt=0)
    with raydl.read_images(root).decode().center_crop(16).loader(batch_size=4) as loader:   # no ray.init
        batches = sum(1 for _ in loader.iterator(0).iter_batches())
        config = dict(ray._private.worker._global_node._config)
    left = [(p.pid, p.name()) for p in psutil.Process().children(recursive=True)]
    ray.shutdown()
    print("RAYDL-RESULT " + json.dumps({"batches": batches, "config": config, "left": left}), flush=True)
""")


def _stop(pids: list[int]) -> None:
    procs = []
    for pid in pids:
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


def _run_child(code: str) -> tuple[dict, str]:
    """`code` run in a child process with a Ray temp folder of its own and no RAY_ADDRESS or Ray setting of
    this process's environment: its RAYDL-RESULT and its stderr. Every process it leaves behind (the result's
    "left", or all its children when it hangs) is stopped by its PID."""
    tmp = tempfile.mkdtemp(prefix="rdls-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_free_objects_period_milliseconds")}
    env["RAY_TMPDIR"] = tmp
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    started: set[int] = set()
    try:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            started = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"the child did not finish: {stderr[-3000:]}")
        result = [ln for ln in stdout.splitlines() if ln.startswith("RAYDL-RESULT ")]
        assert proc.returncode == 0 and result, stderr[-3000:]
        got = json.loads(result[0].split(" ", 1)[1])
        started = {pid for pid, _name in got["left"]}
        return got, stderr
    finally:
        _stop(sorted(started))
        shutil.rmtree(tmp, ignore_errors=True)


def test_an_open_loader_does_not_reconnect_after_ray_shutdown():
    """After ray.shutdown() nothing connects again: no "Connecting to existing Ray cluster", no local Ray started,
    no ray.init from a thread, no Ray process left; the loader then says Ray is gone, and shutdown() is quiet."""
    got, stderr = _run_child(_CHILD)
    after = stderr.split("RAYDL-MARK ray is shut down", 1)[1]
    assert "Connecting to existing Ray cluster" not in after, after[-3000:]
    assert "Started a local Ray instance" not in after, after[-3000:]
    assert "current thread is not the main thread" not in stderr, stderr[-3000:]  # ray.init from a thread
    assert not got["initialized"] and not got["initialized_at_end"], got
    assert got["left"] == [], got
    assert got["iterator"].startswith("Ray was shut down after this loader was built"), got


def test_the_local_ray_a_loader_starts_frees_dropped_batches_within_10_ms():
    """A loader in a process not connected to Ray starts a local Ray with free_objects_period_milliseconds=10,
    and takes its batches there."""
    got, _stderr = _run_child(_CHILD_OWN_RAY)
    assert got["batches"] == 2
    assert got["config"].get("free_objects_period_milliseconds") == 10, got["config"]
