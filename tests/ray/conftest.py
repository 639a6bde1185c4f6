"""One local Ray per test module: start-up costs seconds, so tests share it."""
from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="module")
def ray_local():
    """A local single-node Ray with 2 CPUs, shut down after the module."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
