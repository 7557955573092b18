"""The simulated multi-node cluster (`multinode.py`), one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from multinode import FAST_FAILURE_DETECTION, SimulatedCluster
from ray.cluster_utils import Cluster

from trainstack.runtime.local import free_port


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[SimulatedCluster]:
    if ray.is_initialized():  # another module's instance: this module needs its own
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            # The dashboard serves Ray's state API (leftover actors, placement groups).
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
            "object_store_memory": 80 * 2**20,
            "_system_config": FAST_FAILURE_DETECTION,
        },
    )
    ray.init(address=cluster.address, log_to_driver=False)
    harness = SimulatedCluster(cluster)
    try:
        yield harness
    finally:
        ray.shutdown()
        cluster.shutdown()
