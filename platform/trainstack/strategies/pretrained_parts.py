"""Pretrained weights read rank by rank, for strategies that shard or cut the model.

Such a strategy (`LoadsPretrainedParts`: fsdp, the torch pipelines; ZeRO partitions
its own way, `zero_pretrained.py`, and uses `place` and `materialise`) gets a pretrained
model whose parameters are on the meta device (`models/on_meta.py`) and its buffers
real. In `setup` it places the buffers (`place`), shards or cuts the model as always
(FSDP2, tensor parallelism and pipeline stages take meta parameters), and only then
gives each parameter storage (`materialise`): a DTensor gets its local shard, a stage
its own layers. `read_pretrained` then fills every tensor of a module from the
folder's safetensors, each rank reading only its part (`checkpoint/pretrained.py`).
So no rank ever holds the whole model: it holds what it trains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from trainstack.checkpoint.pretrained import read_parts, saved_shapes
from trainstack.models.on_meta import has_meta_parameters, saved_names
from trainstack.strategies.dtensor_state import local_part

M = TypeVar("M", bound=nn.Module)


def place(model: M, device: torch.device) -> M:
    """`model.to(device)`; a model with meta parameters moves its buffers alone (its
    parameters get storage after sharding, `materialise`)."""
    if not has_meta_parameters(model):
        return model.to(device)
    for name, buffer in list(model.named_buffers()):
        _set_buffer(model, name, buffer.to(device))
    return model


def materialise(module: nn.Module, device: torch.device) -> None:
    """Give `module`'s meta parameters uninitialised storage on `device`, this rank's
    part of each (a DTensor keeps its placements: its local shard); buffers stay as they
    are. Nothing to do for a module without meta parameters."""
    if not has_meta_parameters(module):
        return
    buffers = dict(module.named_buffers(remove_duplicate=False))
    # Swapped in place, each Parameter stays the object every module and tie holds
    # (assigned anew, a tied head would part from its embedding); FSDP2 re-registers
    # its shards itself (FSDPModule._apply).
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    for name, buffer in buffers.items():
        _set_buffer(module, name, buffer.to(device))


def read_pretrained(
    modules: Sequence[nn.Module],
    folder: str,
    *,
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Fill every tensor of the `modules`' state dicts (this rank's model, or its
    pipeline stages) from the save_pretrained `folder`, under the first of its names the
    folder saves (a tied LM head is saved as the embedding); `aliases` gives a key's
    other names where a module does not know them (a stage holding only the head of a
    tied pair). Tensors saved under one name on this rank (copies of a tie in two of its
    stages) read it once. A collective when distributed; `build_hf_model(on_meta=True)`
    checked that the folder fits."""
    path = Path(folder).expanduser()
    saved = saved_shapes(path)
    assert saved is not None, "build_hf_model loads such a folder whole"
    tensors: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in modules:
        state = module.state_dict(keep_vars=True)
        for key, found in saved_names(module, saved, aliases=aliases):
            assert found is not None, (key, "build_hf_model checked every tensor is saved")
            if found in tensors:
                copies.append((state[key], tensors[found]))
            else:
                tensors[found] = state[key]
    read_parts(path, tensors)
    with torch.no_grad():
        for copy, source in copies:
            local_part(copy).copy_(local_part(source))


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, value)
