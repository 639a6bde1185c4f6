"""examples/train.py as a real Ray job: `ray job submit` to a head this module starts, with token auth on."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EPOCH_LINE = re.compile(r"raydl-train epoch (\d+)/(\d+): (\d+) samples on 2 ranks, [\d.]+ images/s, wait [\d.]+ s, "
                        r"skipped (\d+), loss [\d.]+, checkpoint [\d.]+ s \([\d.]+ MB over (fabric|object_store)")


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the head and everything it started, then SIGKILL what is left: only this tree, never `ray stop`."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


class Head:
    """A Ray head started by `ray start --head --block` as this test's child process."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="rdlj-", dir="/tmp")  # short: Ray's socket paths have a length limit
        gcs, dash, client, agent, agent_grpc, runtime_env, metrics = _free_ports(7)
        self.dashboard = f"http://127.0.0.1:{dash}"
        # The job's `python` is this venv's, and its raydl this checkout's (PYTHONPATH reaches the job).
        self.env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(ROOT),
                        RAY_AUTH_MODE="token", RAYDL_CHECKPOINT_BIND="127.0.0.1:0")
        self.env.pop("RAY_ADDRESS", None)
        self.client_env = dict(self.env, RAY_API_SERVER_ADDRESS=self.dashboard)  # what `ray job` talks to
        self.log = open(os.path.join(self.tmp, "head.log"), "w+")
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
             f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
             f"--temp-dir={self.tmp}/ray", "--include-dashboard=true", "--disable-usage-stats",
             "--object-store-memory=300000000"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.tmp)

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited: {self.head_log()}"
            r = self.ray("job", "list", check=False, timeout=30)
            if r.returncode == 0:
                return
            time.sleep(1)
        raise TimeoutError(f"the head's job server did not answer within {timeout} s: {self.head_log()}")

    def head_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def ray(self, *args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
        r = subprocess.run([str(BIN / "ray"), *args], env=self.client_env, cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
        if check:
            assert r.returncode == 0, f"ray {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        return r

    def close(self) -> None:
        _stop_tree(self.proc)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        h.wait_ready()
        yield h
    finally:
        h.close()


def _job_args(data: Path, epochs: int) -> list[str]:
    return ["--working-dir", ".", "--", "python", "examples/train.py", "--config", "configs/local-demo.yaml",
            "--set", f"source.path={data}/train", "--set", f"val.source.path={data}/val",
            "--set", f"job.state_dir={data}/state", "--set", f"job.epochs={epochs}", "--set", "job.steps_per_epoch=2"]


def _status(head: Head, job_id: str) -> str:
    out = head.ray("job", "status", job_id).stdout
    m = re.search(r"Status for job '[^']+': (\w+)", out)
    if m:
        return m.group(1)
    for words, status in (("was stopped", "STOPPED"), ("succeeded", "SUCCEEDED"), ("failed", "FAILED")):
        if f"'{job_id}' {words}" in out:
            return status
    return out


def _wait_status(head: Head, job_id: str, wanted: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _status(head, job_id)
        if status in wanted:
            return status
        time.sleep(1)
    raise TimeoutError(f"job {job_id} still {status} after {timeout} s")


@pytest.mark.timeout(420)
def test_job_is_stopped_and_resubmitted_and_resumes(head, tmp_path):
    """A submitted job trains and logs its epoch lines; stopped and submitted again, it resumes from its state."""
    # A job that would run long: stop it once an epoch has finished and its state is on disk.
    head.ray("job", "submit", "--submission-id", "raydl-job-1", "--no-wait", *_job_args(tmp_path, 100))
    state_file = tmp_path / "state" / "state.json"
    deadline = time.monotonic() + 240
    while not state_file.exists():
        assert _status(head, "raydl-job-1") in ("PENDING", "RUNNING"), head.ray("job", "logs", "raydl-job-1").stdout
        assert time.monotonic() < deadline, head.ray("job", "logs", "raydl-job-1").stdout
        time.sleep(0.5)
    head.ray("job", "stop", "raydl-job-1")
    assert _wait_status(head, "raydl-job-1", {"STOPPED", "SUCCEEDED", "FAILED"}, 60) == "STOPPED"
    logs = head.ray("job", "logs", "raydl-job-1").stdout
    first = [m.groups() for m in EPOCH_LINE.finditer(logs)]
    assert first and first[0][:2] == ("1", "100"), logs[-3000:]
    assert "Missing authentication token" not in logs

    done = json.loads(state_file.read_text())["epoch"]  # epochs finished before the stop
    r = head.ray("job", "submit", "--submission-id", "raydl-job-2", *_job_args(tmp_path, done + 1))
    assert _status(head, "raydl-job-2") == "SUCCEEDED"
    logs = head.ray("job", "logs", "raydl-job-2").stdout
    assert f"resumed from {tmp_path}/state: epoch {done}" in logs, logs[-3000:]
    lines = [m.groups() for m in EPOCH_LINE.finditer(logs)]
    assert [ln[:2] for ln in lines] == [(str(done + 1), str(done + 1))], logs[-3000:]
    assert int(lines[0][2]) == 2 * 2 * 32  # 2 steps x 2 ranks x batch 32, continuing the loader's epoch
    assert re.search(rf"raydl-train eval epoch {done + 1}: accuracy [\d.]+ on 64 validation samples", logs), logs
    assert "raydl-train: done" in logs and "succeeded" in r.stdout
    assert json.loads(state_file.read_text())["epoch"] == done + 1


@pytest.mark.timeout(60)
def test_submit_without_the_token_is_refused(head):
    """With token authentication on, a client without RAY_AUTH_MODE=token is refused (the docs' set-up is needed)."""
    env = {k: v for k, v in head.client_env.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    r = subprocess.run([str(BIN / "ray"), "job", "list"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode != 0 and "authentication token" in (r.stdout + r.stderr).lower()
