"""fetch(into=path) where the bytes do not fit: a CheckpointError naming the path, the bytes needed and
the bytes free, no .part file left, the process alive; a commit fsyncs the directory after the rename.

Two real kernel refusals, each in a fresh process: a full filesystem (a 1 MiB tmpfs mounted in a
private mount namespace with `unshare -m`; skipped where this user cannot mount) and a file-size limit
(RLIMIT_FSIZE: EFBIG from the kernel, which any user can set, so it runs everywhere)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from raydl import checkpoint
from raydl.errors import CheckpointError
from raydl.native import pyfi

from _ckpt_child import write_checkpoint  # beside this file

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not pyfi.available(), reason=f"libfabric unavailable: {pyfi.unavailable_reason()}"),
]
CHILD = os.path.join(os.path.dirname(__file__), "_ckpt_child.py")
SIZE = 4 << 20


def _env(src_dir) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAYDL_CHECKPOINT_BIND", "RAY_ADDRESS")}
    return dict(env, CKPT_SRC_DIR=str(src_dir))


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit code {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_file_size_limit_is_a_checkpoint_error_and_leaves_nothing(tmp_path):
    """Under RLIMIT_FSIZE below the checkpoint's size, fetch(into=) raises CheckpointError naming the path,
    the size and the free space (regression: a bare OSError from ftruncate, and the .part file left)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, CHILD, "fetch-into", str(out), str(SIZE), str(1 << 20)],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=90)
    res = _result(proc)
    err = res.get("error", "")
    assert err.startswith("raydl.errors.CheckpointError: "), res
    assert f"into '{out / 'out.safetensors'}'" in err and f"needs {res['size']} bytes" in err, err
    assert "bytes free (File too large)" in err, err
    assert res["left"] == [], res


def _can_mount() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()}"


def test_a_full_filesystem_is_a_checkpoint_error_and_leaves_nothing(tmp_path):
    """A 4 MiB fetch into a 1 MiB tmpfs raises CheckpointError (No space left on device) with the free
    space, before any transfer (regression: a sparse file written through a mapping, so 'Bad address'
    from the provider over fabric, SIGBUS on the object-store path)."""
    why = _can_mount()
    if why:
        pytest.skip(why)
    small = tmp_path / "small"
    small.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {small} && "
              f"exec {sys.executable} {CHILD} fetch-into {small} {SIZE} 0")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=90)
    res = _result(proc)
    err = res.get("error", "")
    assert err.startswith("raydl.errors.CheckpointError: "), res
    assert f"needs {res['size']} bytes and its filesystem has 1048576 bytes free" in err, err
    assert "No space left on device" in err, err
    assert res["left"] == [], res


def test_into_a_missing_directory_is_a_checkpoint_error(tmp_path):
    """A temporary file that cannot be made is a CheckpointError naming the path, not a bare OSError."""
    path = tmp_path / "a.safetensors"
    ref = checkpoint.publish(write_checkpoint(str(path), 4096), transports=("fabric",), bind="127.0.0.1:0")
    try:
        missing = tmp_path / "nowhere" / "x.safetensors"
        with pytest.raises(CheckpointError, match=f"into '{missing}': No such file or directory"):
            checkpoint.fetch(ref, into=missing)
    finally:
        checkpoint.unpublish(ref)


def test_a_commit_fsyncs_the_file_then_its_directory(tmp_path, monkeypatch):
    """fetch(into=) fsyncs the file, renames it into place, then fsyncs the directory, so the name survives
    a crash with the bytes (regression: the directory was not fsynced)."""
    path = tmp_path / "a.safetensors"
    ref = checkpoint.publish(write_checkpoint(str(path), 4096), transports=("fabric",), bind="127.0.0.1:0")
    synced = []
    real_fsync = os.fsync

    def watching_fsync(fd):
        st = os.fstat(fd)
        synced.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(os, "fsync", watching_fsync)
    try:
        got = checkpoint.fetch(ref, into=out / "x.safetensors")
    finally:
        monkeypatch.undo()
        checkpoint.unpublish(ref)
    assert got.path == str(out / "x.safetensors")
    assert synced == [("file", os.stat(got.path).st_ino), ("dir", os.stat(out).st_ino)], synced
