"""Optimizer and learning-rate schedule built from the spec's `optim` section."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainstack.config import OptimConfig


def scaled_lr(cfg: OptimConfig, *, data_parallel_size: int) -> float:
    """Peak lr after `lr_scaling` with the number of data-parallel replicas."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * data_parallel_size
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(data_parallel_size)
    return cfg.lr


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, lr: float, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """AdamW or SGD over the parameters that train; weight decay applies to matrices only
    (not biases, norms). On a GPU
    (`optim.fused`) one fused kernel updates every parameter; else torch's default.
    `device`: where the parameters will train, where they are not yet (on the meta
    device); else where they are."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # Without an empty group (LoRA's adapters are all matrices): DeepSpeed drops one,
    # and a schedule built over the groups would then count one too many.
    groups = [group for group in groups if group["params"]] or groups[:1]
    if device is not None:
        on_gpu = bool(params) and device.type == "cuda"
    else:
        on_gpu = bool(params) and all(p.device.type == "cuda" for p in params)
    fused = True if cfg.fused and on_gpu else None  # None: torch picks foreach
    if cfg.kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, fused=fused)
    assert cfg.kind == "sgd", cfg.kind
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, fused=fused)


def lr_multiplier(step: int, cfg: OptimConfig, *, total_steps: int) -> float:
    """Multiplier of the peak lr at `step`: linear warm-up, then the chosen decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg, total_steps=total_steps)
    )
