"""The child process of test_exit_safety: imported once by the forkserver, which starts libfabric first."""
from __future__ import annotations

import threading
import time

import numpy as np

from raydl.native import pyfi

SIZE = 1 << 20
pyfi.available()  # libfabric's start-up, once, in the forkserver: the forked children skip it


def child(provider: str, conn, how: str) -> None:
    """Serve SIZE bytes, read them back on a thread forever, hand the address over, then exit as told."""
    import atexit
    import ctypes

    server = pyfi.serve(np.full(SIZE, 7, np.uint8), bind="127.0.0.1:0", provider=provider)
    client = pyfi.connect(server.address)

    def read_forever() -> None:
        dst = np.empty(SIZE, np.uint8)
        while True:
            try:
                client.read_into(dst, chunk_size=256 << 10, max_inflight=4)
            except Exception:  # noqa: BLE001 - the gate refuses once the process exits
                return

    threading.Thread(target=read_forever, daemon=True).start()
    conn.send(server.address)
    conn.recv()  # the parent has fetched
    if how == "exit":
        # What a Python process's exit does, in order: atexit handlers, then C's exit(), which runs
        # the shared libraries' destructors (libfabric's fi_fini) while daemon threads may still run.
        atexit._run_exitfuncs()
        ctypes.CDLL(None).exit(0)
    time.sleep(60)  # "term" / "kill": the parent signals
