"""Tensors of a strategy whose parameters are DTensors (tensor parallel, FSDP), saved and
loaded in the portable forms trainstack's checkpoints hold: whole weights, and each
rank's own part of its optimizer state."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainstack.models.lora import check_adapters_loaded


def place_like_parameters(params: list[nn.Parameter]) -> None:
    """Give each tensor-parallel gradient its parameter's placement (DTensor may leave an
    embedding's as a whole replicated tensor), so that this rank's part of a gradient is
    the part of the parameter it holds."""
    for p in params:
        param: Any = p  # a DTensor parameter
        grad = p.grad
        if not (isinstance(param, DTensor) and isinstance(grad, DTensor)):
            continue
        if grad.placements != param.placements:
            p.grad = grad.redistribute(param.device_mesh, param.placements)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with whole tensors (a DTensor gathered over its mesh: a collective)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def load_whole(module: nn.Module, state: dict[str, Any], *, lora: bool = False) -> None:
    """Load whole tensors into `module`, whose tensor-parallel parameters keep this rank's
    part of each (cut locally, without communication). `lora`: `state` holds the adapters
    alone, over the frozen weights `module` was built with."""
    mine = module.state_dict()
    loaded = module.load_state_dict(
        {
            name: distribute_tensor(
                value, mine[name].device_mesh, mine[name].placements, src_data_rank=None
            )
            if isinstance(mine.get(name), DTensor)
            else value
            for name, value in state.items()
        },
        strict=not lora,
    )
    if lora:
        check_adapters_loaded(loaded)


def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with this rank's parts of DTensor states (saveable and
    loadable with weights_only)."""
    return {
        **state,
        "state": {
            index: {
                k: local_part(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()
            }
            for index, entry in state["state"].items()
        },
    }


def optimizer_state_as_shards(
    state: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """`_local_state`'s output as DTensors again, placed like the parameters they belong to."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    restored = {}
    for index, entry in state["state"].items():
        param = params[index]
        restored[index] = {
            k: DTensor.from_local(
                v, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
            if isinstance(param, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
            else v
            for k, v in entry.items()
        }
    return {**state, "state": restored}
