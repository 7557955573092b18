"""Node-aware all-reduce for DDP: each gradient bucket reduced in two levels.

Inside each node the ranks sum the bucket (over the fast link: NVLink, shared memory);
one rank per node, its leader (the node's lowest rank), all-reduces the node's sum with
the other nodes' leaders (the slow link); each leader broadcasts the total back to its
node. Only leaders send across nodes: per bucket of B bytes and n nodes, a leader sends
2(n − 1)/n · B over the inter-node link (a ring all-reduce among n), where a flat ring
over all W ranks puts n of its W links across nodes and has every rank send
2(W − 1)/W · B. The hook counts the bytes its leader sends across nodes.

`strategy.allreduce`: `flat` (DDP's own all-reduce), `hierarchical`, or `auto`:
hierarchical when the group spans more than one node and some node holds more than one
of its ranks (otherwise one level is all there is). Ranks find their nodes from each
other (`WorkerContext.node`: Ray's node id on a worker group; the gloo harness can
simulate nodes).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are the
# real GradBucket and Future types.
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainstack.strategies.base import ring_allreduce_bytes


@dataclass(frozen=True, kw_only=True)
class NodeGroups:
    """This rank's node group, and the leaders' group across nodes."""

    intra: Any
    """The process group of the ranks on this rank's node."""
    leaders: Any | None
    """The process group of every node's leader; None on ranks that do not lead."""
    leader: int
    """The global rank of this node's leader (its lowest rank)."""
    nodes: int
    ranks_per_node: tuple[int, ...]
    """How many ranks each node holds, nodes in the order of their lowest rank."""


def nodes_of_ranks(node: str) -> list[str]:
    """Every rank's node, gathered from all ranks (a collective)."""
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    return [str(n) for n in nodes]


def uses_hierarchy(choice: str, nodes: list[str]) -> bool:
    """Whether `strategy.allreduce` (`flat`, `hierarchical` or `auto`) reduces in two
    levels on ranks placed on `nodes`."""
    if choice == "auto":
        return 1 < len(set(nodes)) < len(nodes)
    return choice == "hierarchical"


def node_groups(nodes: list[str], rank: int) -> NodeGroups:
    """The groups of `rank`, for ranks placed on `nodes` (every rank creates every group,
    in the same order: a collective)."""
    members: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    intra = {node: dist.new_group(ranks) for node, ranks in members.items()}
    leader_ranks = [ranks[0] for ranks in members.values()]
    leaders = dist.new_group(leader_ranks)
    mine = nodes[rank]
    return NodeGroups(
        intra=intra[mine],
        leaders=leaders if rank in leader_ranks else None,
        leader=members[mine][0],
        nodes=len(members),
        ranks_per_node=tuple(len(ranks) for ranks in members.values()),
    )


class HierarchicalAllReduce:
    """The two-level all-reduce, averaged over the world (`communicate`: DDP's hook)."""

    def __init__(self, groups: NodeGroups, *, world_size: int) -> None:
        self.groups, self.world_size = groups, world_size
        self.cross_node_bytes = 0
        """Bytes this rank has sent across nodes (leaders only)."""

    def communicate(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        grads = bucket.buffer()
        g = self.groups
        dist.all_reduce(grads, group=g.intra)
        if g.leaders is not None and g.nodes > 1:
            dist.all_reduce(grads, group=g.leaders)
            self.cross_node_bytes += ring_allreduce_bytes(
                grads.numel(), element_size=grads.element_size(), world_size=g.nodes
            )
        dist.broadcast(grads, src=g.leader, group=g.intra)
        grads.div_(self.world_size)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(grads)
        return done

    def describe(self) -> str:
        per_node = ", ".join(str(n) for n in self.groups.ranks_per_node)
        return (
            f"all-reduce: hierarchical over {self.groups.nodes} nodes ({per_node} ranks): "
            "within each node, then one rank per node across nodes"
        )
