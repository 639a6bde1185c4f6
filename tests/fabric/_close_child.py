"""The child process of test_server_close_stress: a crash here (SIGSEGV) fails the test instead of pytest.

Each cycle opens a ServerEndpoint, serves a region, starts readers that pull it over their own
connections, and closes the endpoint as soon as every read has moved bytes, with the reads in flight
(a reader still connecting at the close can leave a socket behind in libfabric 1.17, which the fd
check below would count).
Three cycles in four close() is given no time to wait for the serving thread (its join cut to 0), so the
thread closes the endpoint itself as it leaves: the path a loaded machine takes. Prints one line: `cycles N reads R intact I failed F`; exits 1 on a torn read or a leak.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import numpy as np

from raydl.errors import FabricError
from raydl.native import pyfi
from raydl.native.pyfi import _server

SIZE = 4 << 20
READERS = 2


def _fds() -> dict[str, str]:
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return links


def _serving_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pyfi-serve ")]


def main(provider: str, cycles: int) -> int:
    join_s = _server._JOIN_S
    src = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    pyfi.available()  # libfabric's start-up, before the fd count below
    fds = _fds()
    outcomes: list[str] = []
    endpoints = []
    for i in range(cycles):
        _server._JOIN_S = join_s if i % 4 == 3 else 0.0
        endpoint = pyfi.ServerEndpoint(provider, bind="127.0.0.1:0")
        server = endpoint.serve(src)  # held: a collected Server revokes its region
        address = server.address
        moving = [threading.Event() for _ in range(READERS)]
        lock = threading.Lock()

        def read(moved: threading.Event) -> None:
            dst = np.zeros(SIZE, np.uint8)
            try:
                with pyfi.connect(address) as conn:
                    conn.read_into(dst, chunk_size=64 << 10, max_inflight=4, timeout=2.0,
                                   progress=lambda done: moved.set())
                outcome = "intact" if np.array_equal(dst, src) else "torn"
            except FabricError:
                outcome = "failed"
            moved.set()
            with lock:
                outcomes.append(outcome)

        readers = [threading.Thread(target=read, args=(moved,)) for moved in moving]
        for t in readers:
            t.start()
        if not all(moved.wait(30) for moved in moving):
            print("no read moved within 30 s", flush=True)
            return 1
        endpoint.close()
        for t in readers:
            t.join(30)
        if any(t.is_alive() for t in readers):
            print("a read outlived its 2 s timeout by 30 s", flush=True)
            return 1
        endpoints.append(endpoint)
    deadline = time.monotonic() + 30
    while _serving_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    intact, failed = outcomes.count("intact"), outcomes.count("failed")
    print(f"cycles {cycles} reads {len(outcomes)} intact {intact} failed {failed}", flush=True)
    if outcomes.count("torn"):
        print(f"{outcomes.count('torn')} read(s) returned without error but with the wrong bytes", flush=True)
        return 1
    if _serving_threads():
        print(f"{len(_serving_threads())} serving thread(s) still running after 30 s", flush=True)
        return 1
    open_stacks = sum(not e._stack.fabric.closed for e in endpoints)
    if open_stacks:
        print(f"{open_stacks} endpoint(s) left open after their serving thread stopped", flush=True)
        return 1
    leaked = {fd: link for fd, link in _fds().items() if fds.get(fd) != link}
    if leaked:
        print(f"file descriptor(s) leaked: {leaked}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
