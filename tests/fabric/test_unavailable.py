"""Without libfabric pyfi still imports and says why; FabricError carries its fields. Needs no libfabric."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raydl.errors import FabricError, RaydlError

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_disabled_fabric_is_unavailable_with_the_reason():
    """With RAYDL_DISABLE_FABRIC=1, import works, available() is False with that reason, and calls raise FabricError."""
    code = textwrap.dedent("""
        from raydl.errors import FabricError
        from raydl.native import pyfi
        assert pyfi.available() is False
        print("REASON", pyfi.unavailable_reason())
        try:
            pyfi.serve(bytearray(16))
        except FabricError as exc:
            print("SERVE", exc.call, exc)
        print("DIAG", all(not f.fits for f in pyfi.diagnose()))
        print("RC", pyfi.fabric_info_main(None))
    """)
    env = {**os.environ, "RAYDL_DISABLE_FABRIC": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    assert "REASON disabled by RAYDL_DISABLE_FABRIC=1" in out
    assert "SERVE load libfabric bindings unavailable: disabled by RAYDL_DISABLE_FABRIC=1" in out
    assert "DIAG True" in out and "RC 1" in out
    assert "Ray object store" in out


def test_fabric_error_fields_survive_pickling():
    """FabricError is a RaydlError and keeps call, code and strerror through pickle (as Ray sends it)."""
    exc = FabricError("fi_mr_reg failed", call="fi_mr_reg", code=266, strerror="Required key not available")
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, RaydlError)
    assert (str(back), back.call, back.code, back.strerror) == (
        "fi_mr_reg failed", "fi_mr_reg", 266, "Required key not available")


def test_missing_compiled_module_is_unavailable_and_says_what_to_install():
    """When raydl.native.pyfi._pyfi cannot be imported, available() is False and the reason names libfabric-dev."""
    code = textwrap.dedent("""
        import sys
        sys.modules["raydl.native.pyfi._pyfi"] = None  # what a missing build looks like to import
        from raydl.native import pyfi
        print("AVAILABLE", pyfi.available())
        print("REASON", pyfi.unavailable_reason())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAYDL_DISABLE_FABRIC", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    assert "AVAILABLE False" in out
    assert "libfabric-dev" in out and "_build_pyfi" in out
