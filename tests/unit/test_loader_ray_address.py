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


@pytest.mark.parametrize("env_value", [None, "50"])
def test_the_local_ray_gets_raydls_ray_settings_unless_the_environment_gives_them(
    image_folder, init_calls, monkeypatch, env_value
):
    """A local Ray starts with raydl.env.RAY_SYSTEM_CONFIG (dropped batches freed within 10 ms); a setting the
    environment gives as RAY_<name> is left to Ray, which reads it itself; a named cluster gets none."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env_value is None:
        monkeypatch.delenv("RAY_free_objects_period_milliseconds", raising=False)
    else:
        monkeypatch.setenv("RAY_free_objects_period_milliseconds", env_value)
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    with pytest.raises(_Stop):
        ds.loader(batch_size=8)
    _args, kwargs = init_calls[0]
    want = {"free_objects_period_milliseconds": 10} if env_value is None else {}
    assert kwargs["_system_config"] == want
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    with pytest.raises(_Stop):
        ds.loader(batch_size=8)
    assert "_system_config" not in init_calls[1][1]
