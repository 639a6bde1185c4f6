"""`raydl bench loader --running-cluster`: a Ray cluster started before the runs, as a user's already is.

The bench starts `ray start --head --block` on 127.0.0.1 (its own port, token
authentication off, the
same CPU budget and core pinning as the runs, Ray's workers at niceness 0 as
in every other run), waits until a driver can connect, and connects once so
that what a first connection sets up is done before the first run; each raydl
run is then a fresh process that imports ray and raydl, calls
`ray.init(address=...)`, lists, builds the loader and takes its batches. The
cluster is stopped by killing its process tree, by PID, at the end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from raydl.env import local_ray_config

__all__ = ["RunningCluster"]

_READY_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningCluster:
    """`with RunningCluster(cpus, logdir) as address: ...`: a head node on 127.0.0.1, stopped on exit."""

    def __init__(self, cpus: int, logdir: Path, *, pin: bool = True) -> None:
        self.cpus, self.logdir, self.pin = cpus, logdir, pin
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.connect_s: float | None = None  # the warm-up connection's ray.init, a fresh process's

    def __enter__(self) -> str:
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [
            ray if os.path.exists(ray) else "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            f"--num-cpus={self.cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        # Ray 2.5x+ turns token authentication on for `ray start`; a bench on 127.0.0.1 has no token to
        # hand its drivers, so it is off for the cluster and (through this process's environment, which
        # the runs inherit) for every run that connects to it.
        self._auth = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"
        env = {**os.environ, "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0")}
        # the Ray settings docs/cluster.md asks of a cluster's `ray start`, where the environment sets none
        env.update({f"RAY_{k}": str(v) for k, v in local_ray_config().items()})
        env.pop("RAY_ADDRESS", None)
        cores = sorted(os.sched_getaffinity(0))[: self.cpus]
        log = open(self.logdir / "ray-start.log", "w")  # noqa: SIM115 - closed in __exit__
        self._log = log
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if self.pin else None,
        )
        try:
            self._wait_ready(env)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.address

    def _wait_ready(self, env: dict) -> None:
        """Until a fresh driver connects (it is the first connection: what that sets up is done here)."""
        probe = (
            "import time, ray; t = time.perf_counter(); "
            f"ray.init(address={self.address!r}, logging_level='ERROR'); "
            "print(time.perf_counter() - t); ray.shutdown()"
        )
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                tail = (self.logdir / "ray-start.log").read_text()[-2000:]
                raise RuntimeError(f"ray start --head exited {self.proc.returncode}:\n{tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ray start --head: nothing listens on {self.address}") from None
                time.sleep(0.2)
        left = max(10.0, deadline - time.monotonic())
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=left
        )
        if out.returncode:
            raise RuntimeError(
                f"could not connect to the running cluster at {self.address}: {out.stderr[-2000:]}"
            )
        self.connect_s = float(out.stdout.strip().splitlines()[-1])

    def __exit__(self, *exc) -> None:
        from raydl.bench._epochs_report import kill_tree

        if self.proc is not None:
            kill_tree(self.proc.pid)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        self._log.close()
        if self._auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self._auth
