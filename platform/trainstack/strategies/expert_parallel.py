"""Expert parallelism: each MoE layer's experts split over P ranks, beside data parallelism.

The layers split are trainstack's `MoE` and the stacked experts of a Hugging Face MoE
family (`StackedExperts`: Mixtral's, Qwen-MoE's `...Experts` modules).

`strategy.expert_parallel: P` cuts the W data-parallel ranks into W / P expert groups of
P consecutive ranks: rank r holds experts [(r mod P) · E/P, (r mod P + 1) · E/P) of
every MoE layer (`models/moe.py` sends tokens to them by all-to-all inside its group).
The ranks holding the same experts (one per group, r mod P alike) are that slice's
replicas.

Gradients: the dense parameters' are averaged over all W ranks by DDP (the expert
parameters are hidden from it). An expert parameter's gradient on its rank already sums
what every token of its group sent it; summed over its replicas and divided by W, it is
the gradient of the mean loss over all ranks, as the dense parameters' are. The norm a
step clips by adds each expert slice once (summed over the expert group).

Checkpoints hold whole tensors: each rank's slice is gathered (all ranks take part)
into the full `[E, ...]` parameter and Adam moments, and a rank loading one takes its
slice, so a run resumes under any expert-parallel size, or none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack.config import ConfigError, JobConfig
from trainstack.models.moe import (
    ExpertGroup,
    StackedExperts,
    expert_slices,
    moe_layers,
    stacked_experts_modules,
)


class ExpertParallel:
    """The expert and replica groups of this rank, and what crosses them."""

    def __init__(self, *, size: int, rank: int, world_size: int) -> None:
        assert world_size % size == 0
        self.world_size = world_size
        groups = [list(range(g, g + size)) for g in range(0, world_size, size)]
        replicas = [list(range(i, world_size, size)) for i in range(size)]
        # Every rank creates every group, in the same order (a collective).
        expert_groups = [dist.new_group(ranks) for ranks in groups]
        replica_groups = [dist.new_group(ranks) for ranks in replicas]
        self.experts = ExpertGroup(group=expert_groups[rank // size], rank=rank % size, size=size)
        self.replicas = replica_groups[rank % size] if world_size > size else None

    def shard(self, model: nn.Module) -> list[str]:
        """Keep this rank's experts in every MoE layer of `model`; return the expert
        parameters' names (for DDP to leave alone)."""
        layers, stacked = moe_layers(model), stacked_experts_modules(model)
        if not layers and not stacked:
            raise RuntimeError(
                f"strategy.expert_parallel={self.experts.size}: the model has no experts to "
                "split (a trainstack.models.moe.MoE layer, or a Hugging Face MoE family's)"
            )
        for layer in layers:
            layer.hold_experts(self.experts)
        for module in stacked:
            StackedExperts(module, self.experts)
        return list(expert_slices(model))

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum each expert gradient over its replicas and divide by the world size."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.replicas is not None:
                dist.all_reduce(p.grad, group=self.replicas)
            p.grad.div_(self.world_size)

    def clip_grad_norm(
        self, dense: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float
    ) -> torch.Tensor:
        """`clip_grad_norm_` over the whole model: the expert slices of the group add once."""
        squares = [p.grad.detach().double().square().sum() for p in dense if p.grad is not None]
        dense_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64, device=dense_sq.device)
        for p in experts:
            if p.grad is not None:
                expert_sq = expert_sq + p.grad.detach().double().square().sum()
        dist.all_reduce(expert_sq, group=self.experts.group)
        total = (dense_sq + expert_sq).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in [*dense, *experts]:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad))
        return total

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.experts.size)]
        dist.all_gather(parts, local.contiguous(), group=self.experts.group)
        return torch.cat(parts)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` with every expert tensor whole (a collective)."""
        state = model.state_dict()
        for key in expert_slices(model):
            state[key] = self._gather(state[key].detach())
        return state

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """`optimizer.state_dict()` with every expert parameter's moments whole."""
        saved = optimizer.state_dict()
        return self._map_moments(model, optimizer, saved, lambda moment, _: self._gather(moment))

    def local_state_dict(
        self, model: nn.Module, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """This rank's slice of each whole expert tensor in `state`."""
        local = dict(state)
        for key, (held, _) in expert_slices(model).items():
            local[key] = state[key][held.start : held.stop]
        return local

    def local_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: Any
    ) -> Any:
        """This rank's slice of each expert parameter's whole moments in `saved`."""
        return self._map_moments(
            model, optimizer, saved, lambda moment, held: moment[held.start : held.stop]
        )

    def _map_moments(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        saved: Any,
        change: Callable[[torch.Tensor, range], torch.Tensor],
    ) -> Any:
        """`saved` (an optimizer state dict) with `change(moment, held experts)` applied
        to each expert parameter's per-expert moments; its per-parameter dicts are new
        (an `optimizer.state_dict()`'s are the live state's)."""
        params = dict(model.named_parameters())
        order = [p for group in optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        for key, (held, _) in expert_slices(model).items():
            state = saved["state"].get(index[id(params[key])])
            if state is not None:
                saved["state"][index[id(params[key])]] = {
                    name: change(value, held) if _sliced(value) else value
                    for name, value in state.items()
                }
        return saved

    def steps_in_lockstep(self, count: int, *, device: torch.device) -> int:
        """The most of `count` over the expert group: every rank must run as many forwards
        (each one's all-to-alls are collectives)."""
        most = torch.tensor(count, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.experts.group)
        return int(most)


def _sliced(value: object) -> bool:
    """An optimizer state entry with one slice per expert (a moment; not Adam's step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def check_expert_split(cfg: JobConfig, model: nn.Module) -> None:
    """Pre-flight for `strategy.expert_parallel` > 1: the model has experts to split, and
    the expert-parallel size divides each layer's count."""
    size = cfg.strategy.expert_parallel
    if size == 1:
        return
    counts = [layer.num_experts for layer in moe_layers(model)]
    counts += [int(vars(m)["num_experts"]) for m in stacked_experts_modules(model)]
    if not counts:
        raise ConfigError(
            f"strategy.expert_parallel={size}: {type(model).__name__} has no experts to split "
            "(a trainstack.models.moe.MoE layer, or a Hugging Face MoE family's); set "
            "expert_parallel to 1"
        )
    uneven = sorted({c for c in counts if c % size})
    if uneven:
        raise ConfigError(
            f"strategy.expert_parallel={size} must divide every MoE layer's experts; "
            f"{type(model).__name__} has layers of {uneven[0]}; allowed: a divisor of it"
        )
