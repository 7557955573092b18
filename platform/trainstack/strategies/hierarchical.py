"""Node-aware all-reduce for DDP: each gradient bucket reduced in two levels.

Inside each node the ranks sum the bucket (over the fast link: NVLink, shared memory);
one rank per node, its leader (the node's lowest rank), all-reduces the node's sum with
the other nodes' leaders (the slow link); each leader broadcasts the total back to its
node. Only leaders send across nodes: per bucket of B bytes and n nodes, a leader sends
2(n − 1)/n · B over the inter-node link (a ring all-reduce among n), where a flat ring
over all W ranks puts n of its W links across nodes and has every rank send
2(W − 1)/W · B. The hook counts the bytes its leader sends across nodes.

With a `compression:` section the leaders' level is compressed and nothing else: each
leader scales its node's sum by n / W and hands the bucket to the compression hook
over the leaders' group (`compress_across`), whose mean over the n leaders is then
the mean over all W ranks; the leader broadcasts that to its node. Error feedback and
momentum correction live on the leaders, per node (a node's moments see its ranks'
mean gradient when nodes hold equal numbers of ranks). The bytes counted across nodes
are the hook's, as ring collectives put them on the wire.

`strategy.allreduce`: `flat` (DDP's own all-reduce), `hierarchical`, or `auto`. Auto
considers two levels only when the group spans more than one node and some node holds
more than one of its ranks (otherwise one level is all there is), and then measures:
it times all-reduces within each node and across the leaders, fits each level's link
with the α-β model the adaptive compression controller uses (`LinkFit`), and takes two
levels when they model faster for a step's gradient bytes than a flat ring, which the
inter-node link paces (`choose_levels`). Ranks find their nodes from each other
(`WorkerContext.node`: Ray's node id on a worker group; the gloo harness can simulate
nodes).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are the
# real GradBucket and Future types.
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainstack.compression.auto import LinkFit, time_all_reduces
from trainstack.compression.hooks import BucketHook
from trainstack.compression.state import Across
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


def two_levels_possible(choice: str, nodes: list[str]) -> bool:
    """Whether `strategy.allreduce` (`flat`, `hierarchical` or `auto`) may reduce in two
    levels on ranks placed on `nodes`: never on one node, where there is one level only
    (DDP's own all-reduce, or a compression hook, runs); auto also needs a node that
    holds several ranks, and then measures before it decides."""
    count = len(set(nodes))
    if choice == "auto":
        return 1 < count < len(nodes)
    return choice == "hierarchical" and count > 1


PROBE_BYTES = (64 * 2**10, 512 * 2**10, 2 * 2**20)
"""Sizes of the all-reduces auto times on each level."""


@dataclass(frozen=True, kw_only=True)
class LevelChoice:
    """What auto measured and chose."""

    intra: LinkFit
    inter: LinkFit
    flat_s: float
    two_levels_s: float

    @property
    def hierarchical(self) -> bool:
        return self.two_levels_s < self.flat_s

    def figures(self) -> dict[str, Any]:
        """For the summary: the choice, the modelled seconds and both links."""
        return {
            "chosen": "hierarchical" if self.hierarchical else "flat",
            "flat_s": self.flat_s,
            "two_levels_s": self.two_levels_s,
            "intra": {"latency_s": self.intra.latency_s, "bytes_per_s": self.intra.bytes_per_s},
            "inter": {"latency_s": self.inter.latency_s, "bytes_per_s": self.inter.bytes_per_s},
        }

    def describe(self) -> str:
        chosen = "two levels" if self.hierarchical else "flat"
        return (
            f"all-reduce auto: {chosen} (modelled {1e3 * self.flat_s:.3g} ms flat, "
            f"{1e3 * self.two_levels_s:.3g} ms in two levels per step; within a node "
            f"{self.intra.describe()}, across nodes {self.inter.describe()})"
        )


def choose_levels(
    intra: LinkFit, inter: LinkFit, *, grad_bytes: int, ranks_per_node: tuple[int, ...]
) -> LevelChoice:
    """Flat against two levels for `grad_bytes` a step, under the α-β model. A flat ring
    over W ranks moves in lockstep, so its slowest link, the inter-node one, paces all
    2(W − 1) hops; two levels are a ring all-reduce within the largest node, one across
    the n leaders and a broadcast back within the node (modelled as half an
    all-reduce)."""
    world, nodes, widest = sum(ranks_per_node), len(ranks_per_node), max(ranks_per_node)
    flat = inter.seconds(reduced=grad_bytes, gathered=0, world_size=world)
    inside = intra.seconds(reduced=grad_bytes, gathered=0, world_size=widest)
    across = inter.seconds(reduced=grad_bytes, gathered=0, world_size=nodes)
    return LevelChoice(intra=intra, inter=inter, flat_s=flat, two_levels_s=1.5 * inside + across)


def measure_levels(groups: NodeGroups, *, grad_bytes: int, device: torch.device) -> LevelChoice:
    """Time each level's all-reduces and choose (a collective: every rank gets the same
    figures and the same choice)."""
    figures = torch.zeros(4, dtype=torch.float64)
    for level, group in enumerate((groups.intra, groups.leaders)):
        size = dist.get_world_size(group) if group is not None else 1
        if size > 1:
            timings = time_all_reduces(list(PROBE_BYTES), group=group, device=device)
            link = LinkFit.from_timings(timings, world_size=size)
            figures[2 * level : 2 * level + 2] = torch.tensor(
                [link.latency_s, 1 / link.bytes_per_s]
            )
    figures = figures.to(device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest node's link, on every rank
    a_in, s_in, a_x, s_x = figures.tolist()
    return choose_levels(
        LinkFit(latency_s=a_in, bytes_per_s=1 / s_in),
        LinkFit(latency_s=a_x, bytes_per_s=1 / s_x),
        grad_bytes=grad_bytes,
        ranks_per_node=groups.ranks_per_node,
    )


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

    def __init__(self, groups: NodeGroups, *, world_size: int, compressed: bool) -> None:
        self.groups, self.world_size = groups, world_size
        assert groups.nodes > 1, "one node has one level: two_levels_possible"
        self.compressed = compressed
        """Whether the leaders' level is compressed (the same on every rank)."""
        self.across: BucketHook | None = None
        """The compression hook over the leaders' group (leaders of a compressed run)."""
        self.cross_node_bytes = 0
        """Bytes this rank has sent across nodes (leaders only)."""

    def leaders_level(self) -> Across | None:
        """Where a compression hook goes: the leaders' level (None: uncompressed)."""
        if not self.compressed:
            return None
        return Across(group=self.groups.leaders, size=self.groups.nodes, take=self._take)

    def _take(self, hook: BucketHook) -> None:
        self.across = hook

    def communicate(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        grads = bucket.buffer()
        g = self.groups
        dist.all_reduce(grads, group=g.intra)
        if self.across is not None:  # leaves the mean over every rank in `grads`
            grads.mul_(g.nodes / self.world_size)
            self.across.communicate(None, bucket).wait()
            if bucket.is_last():
                self.cross_node_bytes += self.across.stats.wire_bytes(g.nodes)
        elif g.leaders is not None:
            dist.all_reduce(grads, group=g.leaders)
            self.cross_node_bytes += ring_allreduce_bytes(
                grads.numel(), element_size=grads.element_size(), world_size=g.nodes
            )
        dist.broadcast(grads, src=g.leader, group=g.intra)
        if not self.compressed:
            grads.div_(self.world_size)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(grads)
        return done

    def describe(self) -> str:
        per_node = ", ".join(str(n) for n in self.groups.ranks_per_node)
        across = " (compressed)" if self.compressed else ""
        return (
            f"all-reduce: hierarchical over {self.groups.nodes} nodes ({per_node} ranks): "
            f"within each node, then one rank per node across nodes{across}"
        )
