"""A DTensor whose local part is several blocks of the whole tensor (checkpoint/blocks.py)
on 4 gloo processes, a 2 × 2 mesh: the blocks `local_blocks` names hold exactly the
whole tensor's values there, for tensor parallelism's packed experts (`_StridedShard(1,
split_factor=2)` over tp, alone, beside FSDP's `Shard(0)` or a replica), while FSDP × TP's
own strided layout (a `_StridedShard` a later `Shard` of its dimension completes) stays
one block, DCP's own case; and DCP saves such tensors and reads them back into another
layout (and another into them) equal to the whole tensor."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from trainstack.checkpoint.blocks import as_blocks, held_indices, local_blocks
from trainstack.compat.torch import strided_shard
from trainstack.runtime.gloo_processes import rendezvous

PACKED = strided_shard(1, split_factor=2)
LAYOUTS: dict[str, tuple[Any, ...]] = {
    "tp": (Replicate(), PACKED),
    "fsdp x tp": (Shard(0), PACKED),
    "fsdp x tp, uneven experts": (Shard(0), PACKED),
    "fsdp's own strided": (strided_shard(0, split_factor=2), Shard(0)),
    "hidden": (Replicate(), Shard(2)),
}
BLOCKS = {"tp": 2, "fsdp x tp": 2, "fsdp x tp, uneven experts": 2, "fsdp's own strided": 1}


def whole(experts: int = 4) -> torch.Tensor:
    """[E, 2·I, H] with I = 4, H = 6: every value its own index."""
    return torch.arange(experts * 8 * 6, dtype=torch.float64).reshape(experts, 8, 6)


def _worker(rank: int, init_method: str, folder: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for name, placements in LAYOUTS.items():
            full = whole(3 if "uneven" in name else 4)
            tensor = distribute_tensor(full, mesh, placements)
            local = tensor.to_local()
            indices = held_indices(tensor)
            assert torch.equal(full[torch.meshgrid(*indices, indexing="ij")], local), name
            blocks = local_blocks(tensor)
            assert len(blocks) == BLOCKS.get(name, 1), (name, blocks)
            for offsets, sizes, at in blocks:
                theirs, ours = full, local
                for dim, (start, size, here) in enumerate(zip(offsets, sizes, at, strict=True)):
                    theirs = theirs.narrow(dim, start, size)
                    ours = ours.narrow(dim, here, size)
                assert torch.equal(theirs, ours), (name, offsets)
        _round_trip(mesh, Path(folder))
    finally:
        dist.destroy_process_group()


def _round_trip(mesh: Any, folder: Path) -> None:
    """Saved as packed blocks beside FSDP's shards, read back into tensor parallelism
    alone and into a plain split of the hidden size; saved plainly, read into blocks."""
    import torch.distributed.checkpoint as dcp

    full = whole()

    def state(placements: tuple[Any, ...], values: torch.Tensor) -> dict[str, Any]:
        # an optimizer-like nest: a tensor in a dict in a list, beside a plain number
        return {"w": distribute_tensor(values, mesh, placements), "o": [{"m": 0.0}]}

    for saved_as, read_as in (("fsdp x tp", "tp"), ("fsdp x tp", "hidden"), ("hidden", "tp")):
        path = folder / f"{saved_as}-{read_as}"
        saved = state(LAYOUTS[saved_as], full)
        saved["o"][0]["m"] = 1.5
        with as_blocks(saved):
            dcp.save(saved, checkpoint_id=path)
        assert isinstance(saved["w"], DTensor)  # put back after
        read = state(LAYOUTS[read_as], torch.zeros_like(full))
        with as_blocks(read):
            dcp.load(read, checkpoint_id=path)
        assert isinstance(read["w"], DTensor)
        # each rank's part is its share of the whole (torch 2.11 cannot gather a strided
        # shard no Shard completes: `full_tensor` refuses its placements)
        mine = full[torch.meshgrid(*held_indices(read["w"]), indexing="ij")]
        assert torch.equal(read["w"].to_local(), mine), (saved_as, read_as)
        assert read["o"][0]["m"] == 1.5


def test_packed_blocks_hold_their_values_and_survive_dcp_between_layouts(tmp_path: Path) -> None:
    multiprocessing.set_forkserver_preload(["trainstack.runtime.gloo_processes"])
    args = (rendezvous(tmp_path / "rendezvous"), str(tmp_path))
    mp.start_processes(_worker, args=args, nprocs=4, start_method="forkserver")
