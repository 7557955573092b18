"""DTensors whose local part is several blocks of the whole tensor, written and read by
torch.distributed.checkpoint block by block.

DCP places a DTensor's local part in the whole tensor as one block (an offset and a
size per dimension). A `_StridedShard` that no later `Shard` of its dimension completes
gives a rank several: tensor parallelism's packed experts (`ExpertsParallel` in
strategies/tensor_parallel.py) leave rank r of t, in `gate_up_proj` [E, 2·I, H], rows
[r·I/t, (r+1)·I/t) of the gate half and the same rows of the up half, one local tensor
[E, 2·I/t, H]. Told it is one block, DCP would write both halves' rows as the first and
refuse the plan (overlapping chunks), or read the wrong rows into it. `as_blocks` puts
such a DTensor in a state dict as `LocalBlocks`, its local part that tells DCP where
each of its blocks lies; DCP then writes the blocks from, and reads them into, views of
the DTensor's own local tensor: nothing gathered, nothing copied. A checkpoint so
written holds the whole tensor as any other does (its metadata lists the blocks).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, MutableMapping, MutableSequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from trainstack.compat.torch import strided_split_factor

Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""(offsets in the whole tensor, sizes, offsets in the local part)."""


def held_indices(tensor: DTensor) -> list[torch.Tensor]:
    """For each dimension of `tensor`, the indices of the whole tensor this rank's local
    part holds along it, in the local part's order: each `Shard` and strided shard
    applied left to right over the mesh, as DTensor does (`shard_positions`,
    `strided_shard_positions`)."""
    coordinate = tensor.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank holds part of the tensor"
    indices = [torch.arange(n) for n in tensor.shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        chunks, rank = tensor.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        split_factor = strided_split_factor(placement)
        if split_factor is None and not isinstance(placement, Shard):
            continue
        dim = cast(Shard, placement).dim
        held = indices[dim]
        if split_factor is not None:
            positions = strided_shard_positions(len(held), chunks, rank, split_factor=split_factor)
        else:
            positions = shard_positions(len(held), chunks, rank)
        indices[dim] = held[torch.tensor(positions, dtype=torch.long)]
    return indices


def chunk_span(size: int, chunks: int, index: int) -> tuple[int, int]:
    """Piece `index` of `size` elements cut into `chunks` as `torch.chunk` cuts them
    (pieces of ceil(size / chunks), the last ones short or empty): (start, length)."""
    step = -(-size // chunks)
    start = min(step * index, size)
    return start, min(step * (index + 1), size) - start


def shard_positions(size: int, chunks: int, rank: int) -> list[int]:
    """The positions along a dimension of `size` that `Shard` over `chunks` ranks leaves
    rank `rank`."""
    start, length = chunk_span(size, chunks, rank)
    return list(range(start, start + length))


def strided_shard_positions(size: int, chunks: int, rank: int, *, split_factor: int) -> list[int]:
    """The positions along a dimension of `size` that a strided shard over `chunks` ranks
    leaves rank `rank`: the dimension cut into `split_factor` pieces, each cut over the
    ranks, the rank's part of every piece in turn (DTensor's layout since torch 2.10;
    torch 2.5 to 2.9 cut it into split_factor x chunks pieces, which is the same
    wherever that product divides `size`, as every strided shard trainstack makes does).
    torch's `_StridedShard.local_shard_size_and_offset` gives the same positions where
    it can (tests/unit/test_torch_compat.py); computed here, no torch version needs it."""
    positions: list[int] = []
    for piece in range(split_factor):
        first, length = chunk_span(size, split_factor, piece)
        start, count = chunk_span(length, chunks, rank)
        positions += range(first + start, first + start + count)
    return positions


def local_blocks(tensor: DTensor) -> list[Block]:
    """The blocks of the whole tensor this rank's local part is made of (one where DCP's
    own description holds)."""
    runs = [_runs(index) for index in held_indices(tensor)]
    return [
        (
            tuple(run[0] for run in combination),
            tuple(run[1] for run in combination),
            tuple(run[2] for run in combination),
        )
        for combination in itertools.product(*runs)
    ]


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Consecutive stretches of `index`: (first value, length, position in `index`)."""
    values = index.tolist()
    runs: list[tuple[int, int, int]] = []
    for position, value in enumerate(values):
        if runs and value == runs[-1][0] + runs[-1][1]:
            first, length, at = runs[-1]
            runs[-1] = (first, length + 1, at)
        else:
            runs.append((value, 1, position))
    return runs or [(0, 0, 0)]


class LocalBlocks(torch.Tensor):
    """A DTensor's local part as DCP's checkpointable protocol sees it: the whole
    tensor's size, one write or read item per block, each served as a view of the local
    tensor."""

    blocks: list[Block]
    whole: torch.Size

    @staticmethod
    def of(tensor: DTensor, blocks: list[Block]) -> LocalBlocks:
        local = cast(LocalBlocks, tensor.to_local().detach().as_subclass(LocalBlocks))
        local.blocks = blocks
        local.whole = tensor.shape
        return local

    def size(self, dim: int | None = None) -> Any:
        """The whole tensor's size, which DCP checks against the saved one's."""
        return self.whole if dim is None else self.whole[dim]

    def _block(self, at: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        view = self.as_subclass(torch.Tensor)
        for dim, (start, size) in enumerate(zip(at, sizes, strict=True)):
            view = view.narrow(dim, start, size)
        return view

    def __create_write_items__(self, fqn: str, _: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        properties = TensorProperties.create_from_tensor(self.as_subclass(torch.Tensor))
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                    ),
                    properties=properties,
                    size=self.whole,
                ),
            )
            for offsets, sizes, _ in self.blocks
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for offsets, sizes, _ in self.blocks
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, sizes, at in self.blocks:
            if tuple(index.offset) == offsets:
                return self._block(at, sizes)
        raise KeyError(f"{index.fqn}: no block of this rank begins at {tuple(index.offset)}")


def _several_blocks(value: Any) -> list[Block] | None:
    if not isinstance(value, DTensor) or all(
        strided_split_factor(p) is None for p in value.placements
    ):
        return None
    blocks = local_blocks(value)
    return blocks if len(blocks) > 1 else None


@contextmanager
def as_blocks(state: Any) -> Iterator[None]:
    """Inside, each DTensor of the nested `state` (dicts and lists, changed in place)
    whose local part is several blocks is a `LocalBlocks` of it; afterwards the
    DTensor again (filled in place where DCP read into it)."""
    swapped: list[tuple[Any, Any, DTensor]] = []
    for container, key, value in _entries(state):
        if blocks := _several_blocks(value):
            container[key] = LocalBlocks.of(value, blocks)
            swapped.append((container, key, value))
    try:
        yield
    finally:
        for container, key, value in swapped:
            container[key] = value


def _entries(state: Any) -> Iterator[tuple[Any, Any, Any]]:
    """(container, key, value) for every leaf of nested dicts and lists."""
    if isinstance(state, MutableMapping):
        items: Any = list(state.items())
    elif isinstance(state, MutableSequence):
        items = list(enumerate(state))
    else:
        return
    for key, value in items:
        if isinstance(value, (MutableMapping, MutableSequence)):
            yield from _entries(value)
        else:
            yield state, key, value
