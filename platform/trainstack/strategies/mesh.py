"""The device mesh of a sharded layout, built from the job's grid (`trainstack.dims`:
`[pp, dp_replicate, dp_shard, tp]`, tp innermost, where rank coordinates are computed).
FSDP shards over `dp_shard` and, with r > 1 (HSDP), replicates over `dp_replicate`;
tensor parallelism splits layers over `tp`; a pipeline's stages lie along `pp`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from trainstack.dims import ParallelDims


@dataclass(frozen=True, kw_only=True)
class Meshes:
    """The sub-meshes a sharded layout uses, all slices of one `[r, s, t]` mesh."""

    tp: DeviceMesh
    fsdp: DeviceMesh
    """1D `[s]`, or 2D `[r, s]` for HSDP."""
    data_parallel_group: dist.ProcessGroup | None
    """The r × s ranks holding the same tensor-parallel shard (None without a process group)."""


def build_mesh(dims: ParallelDims, *, device_type: str) -> DeviceMesh:
    """The grid as one DeviceMesh over every rank (a collective: every rank builds the
    same sub-groups), named `pp`, `dp_replicate`, `dp_shard`, `tp`; without `pp` when
    there is one pipeline rank."""
    named = [("pp", dims.pp), ("dp_replicate", dims.dp_replicate)]
    named += [("dp_shard", dims.dp_shard), ("tp", dims.tp)]
    kept = [(name, size) for name, size in named if name != "pp" or size > 1]
    return init_device_mesh(
        device_type,
        tuple(size for _, size in kept),
        mesh_dim_names=tuple(name for name, _ in kept),
    )


def build_meshes(dims: ParallelDims, *, device_type: str) -> Meshes:
    """The sub-meshes an fsdp layout uses (a collective: every rank runs it). Under
    context parallelism FSDP shards over the data- and context-parallel ranks alike (cp
    sits just inside dp_shard, so together they are one dimension of the same ranks),
    and its group adds up their sums."""
    if dims.cp > 1:
        dims = ParallelDims(
            dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard * dims.cp, tp=dims.tp
        )
    mesh = build_mesh(dims, device_type=device_type)
    if dims.dp_replicate > 1:
        fsdp = mesh["dp_replicate", "dp_shard"]
        data_parallel_group = flattened_group(mesh, ("dp_replicate", "dp_shard"))
    else:
        fsdp = mesh["dp_shard"]
        data_parallel_group = fsdp.get_group()
    return Meshes(tp=mesh["tp"], fsdp=fsdp, data_parallel_group=data_parallel_group)


def flattened_group(mesh: DeviceMesh, names: tuple[str, ...]) -> dist.ProcessGroup:
    """The process group over this rank's slice of `mesh` along the dimensions `names`,
    flattened (the ranks that share every other coordinate), from the mesh's own grid of
    ranks: what torch's private `DeviceMesh._flatten` gives. A collective: every rank
    creates every such group, in the same order."""
    assert mesh.mesh_dim_names is not None, "build_mesh names every dimension"
    dims = [mesh.mesh_dim_names.index(name) for name in names]
    others = [d for d in range(mesh.ndim) if d not in dims]
    size = math.prod(mesh.size(d) for d in dims)
    slices = mesh.mesh.permute(*others, *dims).reshape(-1, size)
    group, _ = dist.new_subgroups_by_enumeration(slices.tolist())
    assert group is not None, "every rank of the mesh is in one slice"
    return group


def finish_pending_sums(params: Iterable[nn.Parameter]) -> None:
    """Make each gradient left as a pending sum over a mesh dimension (`Partial`: a
    head-sharded norm's under tensor parallelism alone) whole, once per step: else the
    clipping norm and every optimizer op that reads it would all-reduce it again."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(
                placements=[Replicate() if p.is_partial() else p for p in grad.placements]
            )


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
