"""The device mesh of a sharded layout: `[dp_replicate, dp_shard, tp]`, tp innermost.

Global rank = (replica × s + shard) × t + tp_rank, so the t ranks of a tensor-parallel
group are neighbours (one machine's GPUs on a real cluster) and see the same samples
(`JobConfig.data_parallel_rank`). FSDP shards over `dp_shard` and, with r > 1 (HSDP),
replicates over `dp_replicate`; tensor parallelism splits layers over `tp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from trainstack.config import JobConfig


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    dp_replicate: int
    """r: replica groups (HSDP); parameters are replicated across them."""
    dp_shard: int
    """s: ranks one replica's parameters, gradients and optimizer state are sharded over."""
    tp: int
    """t: tensor-parallel degree."""

    @classmethod
    def of(cls, cfg: JobConfig) -> MeshLayout:
        s = cfg.strategy
        r, t = s.data_parallel_replicate, s.tensor_parallel
        return cls(dp_replicate=r, dp_shard=cfg.scaling.num_workers // (r * t), tp=t)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def data_parallel(self) -> int:
        """Model replicas seeing their own samples: r × s."""
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True, kw_only=True)
class Meshes:
    """The sub-meshes a sharded layout uses, all slices of one `[r, s, t]` mesh."""

    tp: DeviceMesh
    fsdp: DeviceMesh
    """1D `[s]`, or 2D `[r, s]` for HSDP."""
    data_parallel_group: dist.ProcessGroup | None
    """The r × s ranks holding the same tensor-parallel shard (None without a process group)."""


def build_meshes(layout: MeshLayout, *, device_type: str) -> Meshes:
    """The mesh over every rank (a collective: every rank builds the same sub-groups)."""
    mesh = init_device_mesh(
        device_type,
        (layout.dp_replicate, layout.dp_shard, layout.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
    )
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    fsdp = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    return Meshes(tp=mesh["tp"], fsdp=fsdp, data_parallel_group=dp.get_group())


def squared_norm(grads: list[torch.Tensor]) -> float:
    """The squared norm of whole gradients, of which this rank holds DTensor shards (and
    plain tensors it holds whole). Gradients sharded alike are summed locally first and
    reduced over the mesh dimensions they are sharded on: one all-reduce per group and
    dimension, where a DTensor norm would take one per gradient. A collective over each
    such group: every rank in it must hold gradients of the same layout."""
    groups: dict[tuple[DeviceMesh, tuple[int, ...]], torch.Tensor] = {}
    plain = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        if not isinstance(grad, DTensor):
            plain += grad.detach().double().pow(2).sum().cpu()
            continue
        if any(p.is_partial() for p in grad.placements):  # pending sums: finish them first
            grad = grad.redistribute(
                placements=[Replicate() if p.is_partial() else p for p in grad.placements]
            )
        dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
        local = grad.to_local().detach().double().pow(2).sum()
        key = (grad.device_mesh, dims)
        groups[key] = groups[key] + local if key in groups else local
    total = float(plain)
    for (mesh, dims), squares in groups.items():
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total += float(squares)
    return total
