"""Where every rank of a job sits: one grid `[pp, dp_replicate, dp_shard, cp, tp]`, tp
innermost, the only place rank coordinates are computed.

    global rank = (((pp × r + replicate) × s + shard) × c + cp) × t + tp

p pipeline ranks, r replica groups (HSDP: parameters replicated across them), s ranks
one replica's state is sharded over, t tensor-parallel ranks. A model replica (a
data-parallel rank, which sees its own samples) is `replicate × s + shard`, one of
r × s; the t ranks of a tensor-parallel group are neighbours (one machine's GPUs on a
real cluster) and, like the p stages of one pipeline, see the same samples. The c ranks
of a context-parallel group (fsdp's `strategy.context_parallel`) see the same samples
too, each its share of every row's tokens.

Each strategy kind says how its ranks fill the grid (`StrategyKind.ranks` in
`trainstack.kinds`): DDP and the parameter server replicate (`[1, n, 1, 1]`), ZeRO
shards (`[1, 1, n, 1]`), FSDP lays a mesh (`[1, r, n / (r c t), c, t]`), a pipeline adds its
stages (`[p, r, d / r, t]`). Pure arithmetic: the spec, the planner and every layout ask
it; `strategies.mesh.build_mesh` turns it into a torch DeviceMesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainstack.kinds import kind_of

if TYPE_CHECKING:
    from trainstack.config import JobConfig


@dataclass(frozen=True, kw_only=True)
class RankCoords:
    """One rank's place in the grid."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    dp: int
    """Its model replica (data-parallel rank): `dp_replicate × s + dp_shard`."""
    cp: int = 0
    """Its place in its context-parallel group."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    pp: int = 1
    """p: pipeline ranks (a pipeline's stages, each holding one or more model stages)."""
    dp_replicate: int = 1
    """r: replica groups; parameters are replicated across them."""
    dp_shard: int = 1
    """s: ranks one replica group's parameters, gradients or optimizer state are sharded over."""
    cp: int = 1
    """c: context-parallel degree (ranks that split every row's tokens)."""
    tp: int = 1
    """t: tensor-parallel degree."""

    @classmethod
    def of(cls, cfg: JobConfig) -> ParallelDims:
        """The grid the spec's strategy lays its `scaling.num_workers` ranks on."""
        s, n = cfg.strategy, cfg.scaling.num_workers
        ranks = kind_of(cfg).ranks
        if ranks == "replicas":
            return cls(dp_replicate=n)
        if ranks == "shards":
            return cls(dp_shard=n)
        r, t = s.data_parallel_replicate, s.tensor_parallel
        if ranks == "pipeline":
            return cls(pp=s.stages, dp_replicate=r, dp_shard=s.data_parallel // r, tp=t)
        c = s.context_parallel
        return cls(dp_replicate=r, dp_shard=n // (r * c * t), cp=c, tp=t)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Model replicas, each seeing its own samples: r × s."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        replicate, shard = divmod(dp, self.dp_shard)
        return RankCoords(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, dp=dp, cp=cp)

    def rank(self, *, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at pipeline rank `pp`, replica `dp`, context-parallel rank `cp`
        and tensor-parallel rank `tp`."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp
