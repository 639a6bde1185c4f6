"""A strict run (RAYDL_TEST_STRICT_SKIPS=1, as scripts/test.sh runs the suite) fails when a test skips for
anything but this machine's hardware, and says which skips it refused; a plain run lets every skip pass."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

MISSING_DEPENDENCY = '''
import pytest

def test_needs_a_module():
    """Skips as pytest.importorskip does when a test dependency is not installed."""
    pytest.importorskip("raydl_no_such_module")

def test_runs():
    """Passes."""
'''

MODULE_SKIP = '''
import pytest

pytest.skip("libfabric unavailable: libfabric.so.1 not found", allow_module_level=True)

def test_never_collected():
    """Never runs."""
'''

HARDWARE = '''
import pytest

def test_gpu():
    """Skips as the GPU tests do on a CPU machine."""
    pytest.skip("no CUDA device on this machine")

@pytest.mark.parametrize("level", ["avx512"])
def test_simd(level):
    """Skips as the AVX-512 kernel test does on a CPU without it."""
    pytest.skip("this CPU has no AVX-512 BW + VNNI path (AVX2)")
'''


def _pytest(tmp_path: Path, body: str, strict: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_planted.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "RAYDL_TEST_STRICT_SKIPS"}
    if strict is not None:
        env["RAYDL_TEST_STRICT_SKIPS"] = strict
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100, env=env)


@pytest.mark.parametrize("body, reason", [
    (MISSING_DEPENDENCY, "could not import 'raydl_no_such_module'"),
    (MODULE_SKIP, "libfabric unavailable: libfabric.so.1 not found"),
])
def test_a_strict_run_fails_on_a_skip_for_a_missing_dependency(tmp_path, body, reason):
    """Strict: a skip for a missing module or library fails the run, which names the reason and counts it."""
    proc = _pytest(tmp_path, body, "1")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "skips that a strict run refuses" in proc.stdout and f"   1 x {reason}" in proc.stdout, proc.stdout[-3000:]


def test_a_strict_run_lets_hardware_skips_pass(tmp_path):
    """Strict: skips for a missing GPU or CPU feature pass the run, and are not listed as refused."""
    proc = _pytest(tmp_path, HARDWARE, "1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 skipped" in proc.stdout and "strict run refuses" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("strict", [None, "0"])
def test_a_plain_run_lets_every_skip_pass(tmp_path, strict):
    """Not strict (pytest run by hand): the missing dependency's skip passes, as before."""
    proc = _pytest(tmp_path, MISSING_DEPENDENCY, strict)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-3000:]
