"""The simulated multi-node cluster (`multinode.py`), one per test module."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest
import ray
from multinode import FAST_FAILURE_DETECTION, SimulatedCluster
from ray.cluster_utils import Cluster


def free_ports(count: int) -> list[int]:
    """Distinct free ports on 127.0.0.1 (held all at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in held:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in held]


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[SimulatedCluster]:
    if ray.is_initialized():  # another module's instance: this module needs its own
        ray.shutdown()
    # GCS and dashboard ports chosen together: a dashboard port picked alone was once
    # the very port Ray then gave the GCS, and the head failed to start.
    gcs_port, dashboard_port = free_ports(2)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "gcs_server_port": gcs_port,
            # The dashboard serves Ray's state API (leftover actors, placement groups).
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
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
