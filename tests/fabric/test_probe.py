"""info(), diagnose(), fabric-info's report, and the provider choice."""
from __future__ import annotations

import pytest

from raydl.errors import FabricError
from raydl.native import pyfi

if not pyfi.available():
    pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)


def test_info_lists_rma_providers_with_decoded_attributes():
    """info() returns RMA-capable entries with provider, fabric, domain, endpoint type and decoded mr_mode."""
    entries = pyfi.info()
    assert entries and len(entries) == len(set(entries))
    names = {e.provider for e in entries}
    assert "tcp;ofi_rxm" in names or "sockets" in names
    for e in entries:
        assert e.ep_type.startswith("FI_EP_") and e.fabric and e.domain and e.max_msg_size > 0
        assert all(bit.startswith("FI_MR_") for bit in e.mr_mode)
        assert e.api_version.startswith("1.")


def test_diagnose_says_which_providers_fit_and_why_not():
    """Every known provider gets a verdict; a missing one says it is not available, a fitting one has its info."""
    fits = {f.provider: f for f in pyfi.diagnose()}
    assert tuple(fits) == pyfi.KNOWN_PROVIDERS
    for fit in fits.values():
        if fit.fits:
            assert fit.info is not None and fit.info.ep_type == "FI_EP_RDM" and fit.domains
        else:
            assert fit.reason and fit.reason != "fits"
    assert any(f.fits for f in fits.values())


def test_diagnose_explains_an_absent_provider():
    """A provider that is not built in is reported as not available, with fi_getinfo's text."""
    (fit,) = pyfi.diagnose(("no-such-provider",))
    assert not fit.fits and "not available" in fit.reason and "No data available" in fit.reason


def test_fabric_info_main_prints_the_diagnosis(capsys):
    """fabric_info_main prints one verdict per known provider and the default choice, returning 0 when one fits."""
    assert pyfi.fabric_info_main(None) == 0
    out = capsys.readouterr().out
    for name in pyfi.KNOWN_PROVIDERS:
        assert name in out
    assert "Provider used by default:" in out and "libfabric 1." in out


def test_choose_provider_argument_then_env_then_first_fit():
    """The argument wins, then RAYDL_FABRIC_PROVIDER, then the first fitting of efa, verbs, tcp, sockets."""
    fitting = ("sockets", "tcp;ofi_rxm")
    assert pyfi.choose_provider("sockets", env_provider="tcp;ofi_rxm", fitting=fitting) == "sockets"
    assert pyfi.choose_provider(None, env_provider="sockets", fitting=fitting) == "sockets"
    assert pyfi.choose_provider(None, env_provider="", fitting=fitting) == "tcp;ofi_rxm"
    assert pyfi.choose_provider(None, env_provider="", fitting=("efa", "sockets")) == "efa"
    with pytest.raises(FabricError, match="no RMA-capable"):
        pyfi.choose_provider(None, env_provider="", fitting=())


def test_env_provider_is_used_by_serve(monkeypatch):
    """serve() without a provider uses RAYDL_FABRIC_PROVIDER."""
    fits = {f.provider for f in pyfi.diagnose() if f.fits}
    if "sockets" not in fits:
        pytest.skip("sockets does not fit here")
    monkeypatch.setenv("RAYDL_FABRIC_PROVIDER", "sockets")
    with pyfi.serve(bytearray(64)) as server:
        assert server.address.provider == "sockets"


def test_env_provider_that_does_not_fit_makes_fabric_unavailable():
    """RAYDL_FABRIC_PROVIDER naming a provider that does not fit: available() is False and the reason names it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "from raydl.native import pyfi; print(pyfi.available()); print(pyfi.unavailable_reason())"
    env = {**os.environ, "RAYDL_FABRIC_PROVIDER": "no-such-provider",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("RAYDL_DISABLE_FABRIC", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    assert out.startswith("False\n") and "RAYDL_FABRIC_PROVIDER=no-such-provider does not fit" in out
