"""Where loader() starts Ray when this process is not connected: a local Ray of its own, or the cluster that
RAY_ADDRESS names (as `ray job submit` sets it), never another cluster running on the machine. No Ray is
started: ray.init is replaced by a recorder."""

from __future__ import annotations

import pytest

import raydl

pytestmark = pytest.mark.timeout(60)


class _Stop(Exception):
    pass


@pytest.fixture
def init_calls(monkeypatch):
    import ray

    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Stop

    monkeypatch.setattr(ray, "init", record)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return calls


@pytest.mark.parametrize("address", [None, "10.0.0.7:6379"])
def test_loader_starts_a_local_ray_unless_ray_address_names_one(image_folder, init_calls, monkeypatch, address):
    """Without RAY_ADDRESS, ray.init(address="local"), so a cluster Ray recorded on this machine is not joined; with
    it, the cluster it names."""
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    with pytest.raises(_Stop):
        ds.loader(batch_size=8)
    assert len(init_calls) == 1
    args, kwargs = init_calls[0]
    assert args == () and kwargs.get("address") == (address or "local")
