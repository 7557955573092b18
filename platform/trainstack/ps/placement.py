"""Where a `ps` job's actors go, so that losing a node costs as little as it can.

Workers reserve `scaling.cpus_per_worker` CPUs and `scaling.resources_per_worker`, so
they train only on the nodes that advertise those resources. Shards reserve
`strategy.ps_cpus` CPUs each (auto: 0 when Ray runs on one machine, 1 on a multi-node
cluster) and prefer nodes the workers cannot use (lacking one of their custom
resources) that have CPUs: they are dealt round-robin over those nodes, as many per
node as its CPUs hold. A preference only: a shard whose node is full, or gone when
Ray restarts the shard, goes wherever Ray finds room, and with no such node (or no
`resources_per_worker` to tell the nodes apart) Ray places every shard. The clock
board stays on the driver's node (`on_this_node`): it lives and dies with the driver.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainstack.config import JobConfig

OWN_RESOURCES = "DEFAULT"
"""The actors reserve their own resources, outside any placement group the driver runs
in (a Tune trial's would otherwise capture them); so does any explicit strategy."""


def shard_cpus(cfg: JobConfig) -> float:
    """CPUs each shard reserves: `strategy.ps_cpus`, or for -1 (auto) 0 on one machine
    (the shards fit beside the workers, as a local capacity check assumes) and 1 when
    the cluster has more than one node."""
    if cfg.strategy.ps_cpus >= 0:
        return cfg.strategy.ps_cpus
    return 1.0 if len([n for n in ray.nodes() if n["Alive"]]) > 1 else 0.0


def shard_strategies(cfg: JobConfig, *, cpus: float) -> list[Any]:
    """A scheduling strategy per shard: a soft preference for a node that does not train,
    while such nodes have room for `cpus` more, then Ray's own choice."""
    count, training = cfg.strategy.num_shards, cfg.scaling.resources_per_worker
    rooms: list[tuple[str, int]] = []
    for node in ray.nodes():
        has = node["Resources"]
        if not node["Alive"] or all(has.get(k, 0.0) >= v for k, v in training.items()):
            continue  # gone, or a node the workers may train on
        node_cpus = has.get("CPU", 0.0)
        room = int(node_cpus / cpus + 1e-9) if cpus else (count if node_cpus else 0)
        rooms.append((node["NodeID"], room))
    most = max((room for _, room in rooms), default=0)
    slots = [node for k in range(min(most, count)) for node, room in rooms if k < room]
    preferred: list[Any] = [
        # Spill: a node that is full (or gone) sends the shard elsewhere instead of
        # keeping it waiting for room there.
        NodeAffinitySchedulingStrategy(node, soft=True, _spill_on_unavailable=True)
        for node in slots[:count]
    ]
    return preferred + [OWN_RESOURCES] * (count - len(preferred))
