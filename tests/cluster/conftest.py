"""The simulated multi-node cluster (`multinode.py`), one per test module."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest
import ray
from multinode import FAST_FAILURE_DETECTION, SimulatedCluster
from ray.cluster_utils import Cluster


def dashboard_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), where Ray's own ports
    (bound to port 0) come from: one picked there was once the very port Ray then gave
    the GCS, and the head failed to start."""
    while True:
        port = random.randrange(20_000, 32_000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


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
            "dashboard_port": dashboard_port(),
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
