"""RAYDL_CHECKPOINT_PREPARE parsing, the cold bench's warm-vs-raw figure, pyfi's libfabric defaults (pure, no Ray)."""
from __future__ import annotations

import os

import pytest

from raydl.bench._ckpt_cold import summarize_cold
from raydl.env import checkpoint_prepare

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("value", "want"), [(None, (True, 0)), ("1", (True, 0)), ("0", (False, 0)),
                                             ("512MiB", (True, 512 << 20)), ("2G", (True, 2 << 30)),
                                             ("4096", (True, 4096))])
def test_checkpoint_prepare_reads_on_off_or_a_size(monkeypatch, value, want):
    """Unset/1: fabric only; 0: off; a size: fabric and a receive buffer that large."""
    if value is None:
        monkeypatch.delenv("RAYDL_CHECKPOINT_PREPARE", raising=False)
    else:
        monkeypatch.setenv("RAYDL_CHECKPOINT_PREPARE", value)
    assert checkpoint_prepare() == want


def test_checkpoint_prepare_names_the_variable_on_a_bad_value(monkeypatch):
    """A value that is neither 0, 1 nor a size is a ValueError naming the variable."""
    monkeypatch.setenv("RAYDL_CHECKPOINT_PREPARE", "yes please")
    with pytest.raises(ValueError, match="RAYDL_CHECKPOINT_PREPARE"):
        checkpoint_prepare()


def test_warm_vs_raw_is_the_median_of_each_rounds_own_ratio():
    """The warm-fetch goal compares each round's warm fetch with the raw read of the same round."""
    def out(s):
        return {"seconds": s, "phases": {}}
    runs = [{"warm": out(1.0), "raw": out(0.9)}, {"warm": out(4.0), "raw": out(2.0)},
            {"warm": out(0.5), "raw": out(0.5)}]
    goal = next(g for g in summarize_cold(runs, None)["goals"] if g["name"].startswith("warm fetch"))
    assert goal["value"] == pytest.approx(0.9)


def test_pyfi_names_rxm_queue_size_unless_the_user_did(monkeypatch):
    """pyfi sets FI_OFI_RXM_MSG_RX_SIZE before libfabric starts (its default queue faulted in ~68 MiB per
    endpoint), and leaves a value the user set alone."""
    from raydl.native.pyfi._env import PROVIDER_DEFAULTS, apply_provider_defaults

    monkeypatch.delenv("FI_OFI_RXM_MSG_RX_SIZE", raising=False)
    apply_provider_defaults()
    assert os.environ["FI_OFI_RXM_MSG_RX_SIZE"] == PROVIDER_DEFAULTS["FI_OFI_RXM_MSG_RX_SIZE"]
    monkeypatch.setenv("FI_OFI_RXM_MSG_RX_SIZE", "4096")
    apply_provider_defaults()
    assert os.environ["FI_OFI_RXM_MSG_RX_SIZE"] == "4096"


def test_pyfi_names_rxm_bounce_buffers_with_the_eager_limit_or_neither(monkeypatch):
    """4 KiB bounce buffers (rxm's 16 KiB made every endpoint and connection slower to open), and the
    eager limit with them; a user who set either keeps rxm's own choice of the other."""
    from raydl.native.pyfi._env import PROVIDER_DEFAULTS, apply_provider_defaults

    both = ("FI_OFI_RXM_BUFFER_SIZE", "FI_OFI_RXM_EAGER_LIMIT")
    for name in both:
        monkeypatch.delenv(name, raising=False)
    apply_provider_defaults()
    assert [os.environ[n] for n in both] == [PROVIDER_DEFAULTS[n] for n in both] == ["4096", "4096"]
    for name in both:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FI_OFI_RXM_BUFFER_SIZE", "16384")
    apply_provider_defaults()
    assert os.environ["FI_OFI_RXM_BUFFER_SIZE"] == "16384" and "FI_OFI_RXM_EAGER_LIMIT" not in os.environ


def test_the_cold_table_heads_with_the_default_and_keeps_each_approach():
    """The default (import-only) first fetch is the first column and the first goal, with its ratio to
    ray.get; the --approaches columns each get a ratio too; a bad RAYDL_CHECKPOINT_FAULTS is named."""
    from raydl.bench._ckpt_cold import format_cold

    def out(s, cpu=0.1):
        return {"seconds": s, "cpu_seconds": cpu, "phases": {"transfer": s / 2}}

    runs = [{"cold": out(0.2), "cold_prepared": out(0.25), "cold_off": out(1.0), "warm": out(0.2),
             "raw": out(0.18), "faults=end-huge": out(1.6, 1.5), "ray_get": out(0.8)}]
    summary = summarize_cold(runs, None)
    assert summary["columns"][0] == "cold" and "faults=end-huge" in summary["columns"]
    assert "faults=reads" not in summary["columns"]  # no round has it
    first = summary["goals"][0]
    assert "by default" in first["name"] and first["value"] == pytest.approx(4.0)
    assert any(g["name"].startswith("first fetch (faults=end-huge)") and g["value"] == pytest.approx(0.5)
               for g in summary["goals"])
    table = format_cold(summary, "head")
    assert "first, by default" in table.splitlines()[2] and "x ray.get" in table


def test_checkpoint_faults_names_the_variable_on_a_bad_value(monkeypatch):
    from raydl.env import CHECKPOINT_FAULTS, checkpoint_faults

    monkeypatch.delenv("RAYDL_CHECKPOINT_FAULTS", raising=False)
    assert checkpoint_faults() == "hint" == CHECKPOINT_FAULTS[0]
    monkeypatch.setenv("RAYDL_CHECKPOINT_FAULTS", "sideways")
    with pytest.raises(ValueError, match="RAYDL_CHECKPOINT_FAULTS"):
        checkpoint_faults()
