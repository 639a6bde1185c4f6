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


def _ray_init_kwargs(image_folder, init_calls, monkeypatch, **env) -> dict:
    """The keyword arguments of the ray.init that loader() calls with `env` set (a None value unset)."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    with pytest.raises(_Stop):
        ds.loader(batch_size=8)
    args, kwargs = init_calls[-1]
    assert args == ()
    return kwargs


@pytest.mark.parametrize("address", [None, "local", "10.0.0.7:6379"])
def test_loader_starts_a_local_ray_unless_ray_address_names_one(image_folder, init_calls, monkeypatch, address):
    """Without RAY_ADDRESS (or with RAY_ADDRESS=local), ray.init(address="local") with raydl's local Ray
    settings, so a cluster Ray recorded on this machine is not joined; with an address, the cluster it names."""
    kwargs = _ray_init_kwargs(
        image_folder, init_calls, monkeypatch, RAY_ADDRESS=address, RAY_free_objects_period_milliseconds=None
    )
    assert len(init_calls) == 1
    assert kwargs.get("address") == (address or "local")
    assert ("_system_config" in kwargs) == (address in (None, "local"))


@pytest.mark.parametrize("env_value", [None, "50"])
def test_the_local_ray_gets_raydls_ray_settings_unless_the_environment_gives_them(
    image_folder, init_calls, monkeypatch, env_value
):
    """A local Ray starts with raydl.env.RAY_SYSTEM_CONFIG (dropped batches freed within 10 ms); a setting the
    environment gives as RAY_<name> is left to Ray, which reads it itself; a named cluster gets none."""
    kwargs = _ray_init_kwargs(
        image_folder, init_calls, monkeypatch, RAY_ADDRESS=None, RAY_free_objects_period_milliseconds=env_value
    )
    want = {"free_objects_period_milliseconds": 10} if env_value is None else {}
    assert kwargs["_system_config"] == want
    kwargs = _ray_init_kwargs(image_folder, init_calls, monkeypatch, RAY_ADDRESS="10.0.0.7:6379")
    assert "_system_config" not in kwargs
