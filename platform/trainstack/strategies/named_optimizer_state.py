"""Optimizer state carried from one layout's checkpoint to another's, by parameter name.

A checkpoint holds its optimizer state in one of three forms:

- a sharded layout's DCP folder (fsdp, tensor parallel): keyed by the model's parameter
  names, each tensor in whatever shards wrote it;
- DDP's `optimizer.pt`: whole tensors indexed by position in the optimizer's groups;
- ZeRO 1/2's per-rank files: each group's state flattened and cut into one partition
  per rank, with the fragment of every named parameter each rank holds.

A strategy resuming another layout's checkpoint gives the parameters it holds with
every model name of each (a tied one has several). Each gets the state saved for it,
placed as the parameter is: this rank's part of a tensor-parallel or FSDP-sharded
one. Whole tensors are cut locally (no communication); DCP reshards as it reads (a
collective: every rank calls it). The learning-rate schedule is this run's own (its
`lr_scaling` may differ from the saving layout's), set to the checkpoint's step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainstack.checkpoint import SHARDED_FOLDER, Checkpoint, rank_file, sharded
from trainstack.config import OptimConfig
from trainstack.optim import build_optimizer
from trainstack.strategies.base import fast_forward_schedule
from trainstack.strategies.deepspeed_engine import ZERO_FRAGMENTS

NamedParameters = list[tuple[nn.Parameter, tuple[str, ...]]]
"""Parameters a rank holds, each with every state-dict key the model has for it."""


def named_parameters(model: nn.Module) -> NamedParameters:
    """`model`'s parameters, each with all its state-dict keys (a tie's several)."""
    keys: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(tensor), []).append(key)
    return [(p, tuple(keys.get(id(p), [name]))) for name, p in model.named_parameters()]


def optimizer_order(model: nn.Module, optim: OptimConfig) -> list[str]:
    """The names of `model`'s parameters in the order its optimizer indexes them (DDP's
    `optimizer.pt` keys them by this position)."""
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, optim, lr=0.0)  # holds no state until a step
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def restore_optimizer_by_name(
    checkpoint: Checkpoint,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    params: NamedParameters,
    *,
    order: list[str],
) -> list[str]:
    """Give each of `params` its optimizer state from another layout's `checkpoint`
    (`order`: the model's parameter names in optimizer order, for DDP's file), and the
    schedule the checkpoint's step. Returns notes for state that could not come across."""
    fast_forward_schedule(scheduler, step=checkpoint.step)
    if sharded.has_sharded(checkpoint, SHARDED_FOLDER):
        states, missing = sharded.optimizer_state_by_parameter(checkpoint, SHARDED_FOLDER, params)
    else:
        shapes = {name: tuple(param.shape) for param, names in params for name in names}
        whole, why_not = _whole_state(checkpoint, order=order, shapes=shapes)
        if why_not:
            return [f"optimizer state re-initialised ({why_not})"]
        states, missing = _placed(whole, params)
    for param, state in states.items():
        optimizer.state[param] = state
    return [f"optimizer state re-initialised for {', '.join(missing)}"] if missing else []


def _whole_state(
    checkpoint: Checkpoint, *, order: list[str], shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Whole optimizer state by parameter name from DDP's or ZeRO 1/2's files (`shapes`:
    each name's whole shape, for ZeRO's flat fragments), or why the checkpoint has none
    to give."""
    source = checkpoint.manifest.get("strategy")
    if source == "ddp" and checkpoint.has("optimizer.pt"):
        saved = checkpoint.load("optimizer.pt")["state"]
        return {order[index]: state for index, state in saved.items()}, None
    stage = checkpoint.manifest["spec"]["strategy"].get("stage")
    if source == "zero" and stage in (1, 2):
        whole = zero_state_by_name(checkpoint, shapes=shapes)
        if whole is None:
            return {}, "the ZeRO checkpoint does not say where each parameter's state lies"
        return whole, None
    if source == "zero":
        return {}, "ZeRO-3's optimizer partitions are not converted"
    return {}, f"the checkpoint is from {source}"


def zero_state_by_name(
    checkpoint: Checkpoint, *, shapes: dict[str, tuple[int, ...]]
) -> dict[str, dict[str, Any]] | None:
    """ZeRO 1/2's optimizer state made whole: each parameter's fragments taken from every
    rank's flat partitions in rank order, given its whole shape from `shapes`. None when
    a rank's file does not record where the fragments lie."""
    ranks = checkpoint.manifest["world"]["world_size"]
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    steps: dict[str, Any] = {}
    for rank in range(ranks):
        file = rank_file("optimizer", rank)
        shard = checkpoint.load(file) if checkpoint.has(file) else {}
        if ZERO_FRAGMENTS not in shard:
            return None
        groups = _group_states(shard["base_optimizer_state"])
        for group, fragments in zip(groups, shard[ZERO_FRAGMENTS], strict=True):
            for name, (start, numel) in fragments.items():
                held = pieces.setdefault(name, {})
                for key, value in group.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1:
                        held.setdefault(key, []).append(value[start : start + numel])
                    else:
                        steps.setdefault(name, {})[key] = value
    return {
        name: {
            **steps.get(name, {}),
            **{key: torch.cat(parts).reshape(shapes[name]) for key, parts in held.items()},
        }
        for name, held in pieces.items()
    }


def _group_states(base: Any) -> list[dict[str, Any]]:
    """Each group's flat optimizer state: ZeRO saves the inner optimizer's state dict (one
    flat parameter per group), or with `elastic_checkpoint` a list of them."""
    if isinstance(base, list):
        return base
    return [base["state"][index] for index in sorted(base["state"])]


def _placed(
    whole: dict[str, dict[str, Any]], params: NamedParameters
) -> tuple[dict[nn.Parameter, dict[str, Any]], list[str]]:
    """Each parameter's whole state, cut to the part this rank holds of it."""
    states: dict[nn.Parameter, dict[str, Any]] = {}
    missing = []
    for param, names in params:
        name = next((n for n in names if n in whole), None)
        if name is None:
            missing.append(names[0])
            continue
        states[param] = {key: _like(param, value) for key, value in whole[name].items()}
    return states, missing


def _like(param: nn.Parameter, value: Any) -> Any:
    """A whole tensor of the parameter's shape, as the parameter holds it; others as they
    are (a step count)."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
        return value.clone() if isinstance(value, torch.Tensor) else value
    from torch.distributed.tensor import DTensor, distribute_tensor  # 0.5 s: sharded layouts'

    value = value.to(param.device)
    if isinstance(param, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value.clone()
