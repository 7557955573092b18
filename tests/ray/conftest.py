"""One local Ray instance for the whole `tests/ray/` session."""

import os
from collections.abc import Iterator

import pytest
import ray

# The controller collects reports on this period; the default 2 s slows every test.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    # "local": a new instance, never a cluster another test (or `ray start`) left behind.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
