"""The simulated multi-node cluster (`multinode.py`), one for every test in this folder.

Each test brings the nodes it needs (`SimulatedCluster.workers`, `add_service_node`)
and leaves no run behind; the cluster is shut down after the folder's last test, so
the rest of the suite starts Ray on a quiet machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from multinode import FAST_FAILURE_DETECTION, SimulatedCluster

HERE = Path(__file__).parent
_shared: list[SimulatedCluster] = []
"""The folder's cluster once started (at most one)."""


@pytest.fixture
def sim_cluster() -> SimulatedCluster:
    if not _shared:
        if ray.is_initialized():  # an instance another folder left: this one needs its own
            ray.shutdown()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                # The dashboard serves Ray's state API (leftover actors, placement groups),
                # on the port its own bind picks (0; Ray refuses to start when its default
                # 8265 is taken, and a port probed free here could be taken before Ray
                # binds it); clients find it through the cluster.
                "include_dashboard": True,
                "dashboard_host": "127.0.0.1",
                "dashboard_port": 0,
                "object_store_memory": 80 * 2**20,
                "_system_config": FAST_FAILURE_DETECTION,
            },
        )
        ray.init(address=cluster.address, log_to_driver=False)
        _shared.append(SimulatedCluster(cluster))
    return _shared[0]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the folder's last test (whatever runs next), stop its cluster."""
    if _shared and (nextitem is None or HERE not in Path(nextitem.path).parents):
        harness = _shared.pop()
        ray.shutdown()
        harness.cluster.shutdown()
