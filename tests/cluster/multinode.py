"""A multi-node Ray cluster on one machine, for node failures and elastic resizes.

`ray.cluster_utils.Cluster` starts real raylets: a head that takes no training (0 CPUs;
the driver, the Train controller and trainstack's small actors live there) and worker
"nodes" of 1 CPU each that advertise the `WORKER_NODE` resource, so a job that asks for
it lands only on them. Health checks every 200 ms and Ray Train's 0.25 s poll make a
killed node's loss seen within about a second. One cluster for tests/cluster; each test
brings the worker nodes it needs (`SimulatedCluster.workers`) and leaves no run behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.util import state

WORKER_NODE = "trainstack_worker_node"
"""The custom resource only worker nodes advertise (one unit per CPU)."""

FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@dataclass
class SimulatedCluster:
    cluster: Cluster
    nodes: list[Any] = field(default_factory=list)
    """Live worker nodes this harness added, oldest first."""
    service_nodes: list[Any] = field(default_factory=list)
    """Live nodes without `WORKER_NODE` (no training lands there), oldest first."""

    def add_worker(self, cpus: int = 1) -> Any:
        node = self.cluster.add_node(
            num_cpus=cpus, resources={WORKER_NODE: cpus}, object_store_memory=80 * 2**20
        )
        self.nodes.append(node)
        return node

    def add_service_node(self, cpus: int = 1) -> Any:
        """A node with CPUs but no `WORKER_NODE`: room for what must not train (shards)."""
        node = self.cluster.add_node(num_cpus=cpus, object_store_memory=80 * 2**20)
        self.service_nodes.append(node)
        return node

    def kill(self, node: Any) -> None:
        """Remove `node` the hard way, as a lost machine: its processes are SIGKILLed."""
        (self.nodes if node in self.nodes else self.service_nodes).remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def running_training(self) -> Any:
        """The oldest live worker node that hosts one of Ray Train's workers now: losing
        it fails the group for certain (a node that only joined may host none yet)."""
        hosts = {
            actor.node_id
            for actor in state.list_actors(filters=[("state", "=", "ALIVE")])
            if actor.class_name == "RayTrainWorker"
        }
        for node in self.nodes:
            if node.node_id in hosts:
                return node
        raise AssertionError(f"no worker node of this harness hosts a Ray Train worker: {hosts}")

    def workers(self, count: int) -> list[Any]:
        """Make exactly `count` worker nodes live (adding or removing) and wait for Ray to
        see them."""
        while len(self.nodes) < count:
            self.add_worker()
        while len(self.nodes) > count:
            self.kill(self.nodes[-1])
        self.wait_for_capacity(count)
        return list(self.nodes)

    def wait_for_capacity(self, count: int) -> None:
        """Wait until Ray counts `count` live worker nodes (the test's timeout guards),
        then have the autoscaling coordinator see them too."""
        while ray.cluster_resources().get(WORKER_NODE, 0) != count:
            time.sleep(0.1)
        self.refresh_reservations()

    def refresh_reservations(self) -> None:
        """Ray Train's elastic policy sizes a group by what Ray's autoscaling coordinator
        reserves for it, and the coordinator looks at the cluster's nodes every 20 s.
        Ask it to look now, as its next tick would: a node that joined or died is seen
        at once instead of up to 20 s later."""
        try:
            coordinator = ray.get_actor(
                "AutoscalingCoordinator", namespace="AutoscalingCoordinator"
            )
        except ValueError:  # no elastic run has asked for one yet: nothing to refresh
            return
        ray.get(coordinator.get_reserved_resources.remote("trainstack-tests", recompute=True))
