"""No process exits with a pyfi thread inside libfabric: 50 serve / fetch / exit-or-kill cycles, no crash.

The Ray worker segfault in CoreWorker::HandleExit came from libfabric's own
destructor (fi_fini, run by exit()) tearing providers down under a serving
thread still inside fi_cq_sread. Each cycle here is a process that serves a
region and keeps a reader thread busy in libfabric; the test fetches from it,
then the process exits the way a Ray worker does (Python's atexit, then C's
exit() with its library destructors) or is killed. Processes are forked from a
forkserver that has imported pyfi and started libfabric once, so 50 of them
fit in seconds.
"""
from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

from raydl.native import pyfi

if not pyfi.available():
    pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}", allow_module_level=True)

from _exit_child import SIZE, child  # noqa: E402 - beside this file; the forkserver preloads it

CYCLES = 50
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


@pytest.mark.timeout(300)  # ~20 s on a quiet machine; 80-120 s at load average 15-20
def test_fifty_serve_fetch_exit_cycles_never_crash(monkeypatch):
    """50 processes serving with reader threads inside libfabric exit or are killed without a crash."""
    # The forkserver imports its preload from PYTHONPATH (it ignores the parent's sys.path).
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    provider = pyfi.choose_provider()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["_exit_child"])
    ways = ["exit", "exit", "term", "kill"]
    crashed = []
    for i in range(CYCLES):
        how = ways[i % len(ways)]
        parent, child_end = ctx.Pipe()
        proc = ctx.Process(target=child, args=(provider, child_end, how), daemon=True)
        proc.start()
        assert parent.poll(30), f"cycle {i}: the child did not serve"
        address = parent.recv()
        with pyfi.connect(address) as conn:
            dst = np.zeros(SIZE, np.uint8)
            conn.read_into(dst, timeout=10)
        assert (dst == 7).all()
        parent.send("go")
        if how == "term":
            os.kill(proc.pid, signal.SIGTERM)
        elif how == "kill":
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        code = proc.exitcode
        if code is None or (how == "exit" and code != 0) or -code in CRASH_SIGNALS or code - 128 in CRASH_SIGNALS:
            crashed.append((i, how, code))
    assert crashed == [], f"cycles that crashed (cycle, way, exit code): {crashed}"


@pytest.mark.timeout(120)
def test_exit_right_after_import_while_libfabric_starts_in_the_background():
    """Importing raydl.checkpoint starts libfabric on a thread; exiting at once never crashes, and a
    process that lives on has libfabric started but no endpoint open (nothing listens before a publish)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAYDL_CHECKPOINT_PREPARE"}
    quick = "import raydl.checkpoint"
    waits = ("import raydl.checkpoint as c; p = c.api._PROCESS; p.wait_prepared(); "
             "from raydl.native.pyfi import _probe; "
             "assert _probe._diagnosis.cache_info().currsize or _probe._diagnose_cached.cache_info().currsize, "
             "'libfabric not started at import'; "
             "assert not p._endpoints and (p._fabric is None or not p._fabric._endpoints), 'endpoint at import'")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for code in (quick, waits)]
    for proc in procs:
        _, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, f"exit code {proc.returncode}: {err[-2000:]}"
