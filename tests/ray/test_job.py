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
        self.demo_dir = Path(self.tmp) / "demo"  # configs/local-demo.yaml's data and state (RAYDL_DEMO_DIR)
        self.env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(ROOT),
                        RAY_AUTH_MODE="token", RAYDL_CHECKPOINT_BIND="127.0.0.1:0", RAYDL_DEMO_DIR=str(self.demo_dir))
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

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited: {self.head_log()}"
            try:
                if self.ray("job", "list", check=False, timeout=60).returncode == 0 and self._upload_works():
                    return
            except subprocess.TimeoutExpired:
                pass  # a loaded machine: the dashboard is still coming up
            time.sleep(1)
        raise TimeoutError(f"the head's job server did not answer within {timeout} s: {self.head_log()}")

    def _upload_works(self) -> bool:
        """A tiny job with a working dir: a freshly started (and loaded) head was seen to drop the first upload."""
        tiny = Path(self.tmp) / "probe"
        tiny.mkdir(exist_ok=True)
        (tiny / "probe.txt").write_text("raydl\n")
        r = subprocess.run([str(BIN / "ray"), "job", "submit", "--working-dir", str(tiny), "--", "true"],
                           env=self.client_env, cwd=self.tmp, capture_output=True, text=True, timeout=180)
        return r.returncode == 0

    def head_log(self) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text()
        errors = [ln for ln in text.splitlines() if re.search(r"Error|Exception|timed out|failed", ln)]
        return "\n".join(errors[-10:]) + "\n...\n" + text[-1500:]

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
    for attempt in range(2):  # on a loaded machine Ray's own start-up can time out: one more try, fresh ports
        h = Head()
        try:
            h.wait_ready()
            break
        except (AssertionError, TimeoutError):
            h.close()
            if attempt:
                raise
    try:
        yield h
    finally:
        h.close()


def _job_args(epochs: int) -> list[str]:
    return ["--working-dir", ".", "--", "python", "examples/train.py", "--config", "configs/local-demo.yaml",
            "--set", f"job.epochs={epochs}", "--set", "job.steps_per_epoch=2"]


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


def _submit(head: Head, job_id: str, *args: str) -> None:
    """`ray job submit --no-wait`, tried again when a loaded head drops the connection before answering."""
    for attempt in range(3):
        r = head.ray("job", "submit", "--submission-id", job_id, "--no-wait", *args, check=False)
        if r.returncode == 0 or head.ray("job", "status", job_id, check=False).returncode == 0:
            return
        assert "Connection aborted" in r.stdout + r.stderr and attempt < 2, r.stdout[-3000:] + r.stderr[-3000:]
        time.sleep(2)


def _readme_job_block() -> str:
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
              if "ray job submit" in b]
    assert len(blocks) == 1, "README.md should have one bash block that submits the job"
    return blocks[0]


@pytest.mark.timeout(900)
def test_readme_job_then_stopped_and_resubmitted_resumes(head):
    """README's `ray job submit` block trains 2 epochs with token auth on; a job stopped part-way and submitted
    again resumes from the state it persisted, at the epoch after the last finished one."""
    block = _readme_job_block()
    env = {k: v for k, v in head.client_env.items() if k != "RAY_AUTH_MODE"}  # the block must turn it on
    for _attempt in range(2):  # a loaded head may drop an upload before the job exists: then once more
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        if r.returncode == 0 or "Connection aborted" not in r.stderr or "raydl-train" in r.stdout + r.stderr:
            break
    assert r.returncode == 0, f"README block failed:\n{block}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    logs = r.stdout + r.stderr
    lines = [m.groups() for m in EPOCH_LINE.finditer(logs)]
    assert [ln[:2] for ln in lines] == [("1", "2"), ("2", "2")], logs[-3000:]
    assert int(lines[0][2]) == 4 * 2 * 32 and lines[0][3] == "0"  # 4 steps x 2 ranks x batch 32, none skipped
    for epoch in (1, 2):
        assert re.search(rf"raydl-train eval epoch {epoch}: accuracy [\d.]+ on 64 validation samples", logs), logs
    state_file = head.demo_dir / "state" / "state.json"
    assert json.loads(state_file.read_text())["epoch"] == 2

    # Resubmitted for many more epochs: it resumes at epoch 3; stopped once epoch 3 is on disk.
    _submit(head, "raydl-job-2", *_job_args(100))
    deadline = time.monotonic() + 420  # a Ray Train job's start-up is slow on a loaded machine
    while json.loads(state_file.read_text())["epoch"] < 3:
        assert _status(head, "raydl-job-2") in ("PENDING", "RUNNING"), head.ray("job", "logs", "raydl-job-2").stdout
        assert time.monotonic() < deadline, head.ray("job", "logs", "raydl-job-2").stdout
        time.sleep(0.5)
    head.ray("job", "stop", "raydl-job-2")
    assert _wait_status(head, "raydl-job-2", {"STOPPED", "SUCCEEDED", "FAILED"}, 60) == "STOPPED"
    logs = head.ray("job", "logs", "raydl-job-2").stdout
    assert f"resumed from {head.demo_dir}/state: epoch 2" in logs, logs[-3000:]
    assert [m.groups()[:2] for m in EPOCH_LINE.finditer(logs)][0] == ("3", "100"), logs[-3000:]

    done = json.loads(state_file.read_text())["epoch"]  # epochs finished before the stop took effect
    _submit(head, "raydl-job-3", *_job_args(done + 1))
    assert _wait_status(head, "raydl-job-3", {"STOPPED", "SUCCEEDED", "FAILED"}, 420) == "SUCCEEDED"
    logs = head.ray("job", "logs", "raydl-job-3").stdout
    assert f"resumed from {head.demo_dir}/state: epoch {done}" in logs, logs[-3000:]
    lines = [m.groups() for m in EPOCH_LINE.finditer(logs)]
    assert [ln[:2] for ln in lines] == [(str(done + 1), str(done + 1))], logs[-3000:]
    assert int(lines[0][2]) == 2 * 2 * 32  # 2 steps x 2 ranks x batch 32, continuing the loader's epoch
    assert "raydl-train: done" in logs
    assert json.loads(state_file.read_text())["epoch"] == done + 1


@pytest.mark.timeout(60)
def test_submit_without_the_token_is_refused(head):
    """With token authentication on, a client without RAY_AUTH_MODE=token is refused (the docs' set-up is needed)."""
    env = {k: v for k, v in head.client_env.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    r = subprocess.run([str(BIN / "ray"), "job", "list"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode != 0 and "authentication token" in (r.stdout + r.stderr).lower()
