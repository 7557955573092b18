"""Wiring a `compression:` spec into a DDP model, and the state a checkpoint keeps.

`register_compression` is what the DDP strategy calls once, after wrapping the model;
the `CompressionState` it returns reports each step's bytes and saves/restores what
makes a resumed run continue exactly (step counter, residuals, warm starts). That
state differs per rank, so every rank saves its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainstack.compression.auto import (
    ASSUMED_LATENCY_S,
    CANDIDATES,
    AdaptiveRatio,
    LinkFit,
    time_all_reduces,
)
from trainstack.compression.base import CommStats, Compressor
from trainstack.compression.hooks import BucketHook, CodecHook
from trainstack.compression.local import LocalGradient
from trainstack.compression.lowrank import LowRank, PowerSGDHook
from trainstack.compression.quantize import QSGD, Cast, Sign
from trainstack.compression.sparsify import RandK, TopK
from trainstack.config import CompressionConfig, JobConfig, OptimConfig
from trainstack.kinds import kind_of
from trainstack.run_events import RunEvent


def build_compressor(cfg: CompressionConfig, *, seed: int, rank: int) -> Compressor:
    """The codec for `cfg.kind` (not `none`); `rank` is the sender's process rank."""
    match cfg.kind:
        case "fp16":
            return Cast(torch.float16)
        case "bf16":
            return Cast(torch.bfloat16)
        case "topk" | "auto":
            return TopK(cfg.ratio)
        case "randk":
            return RandK(cfg.ratio, seed=seed, unbiased=not cfg.error_feedback)
        case "qsgd":
            return QSGD(cfg.bits, seed=seed, rank=rank)
        case "sign":
            return Sign()
        case "powersgd":
            return LowRank(cfg.rank, seed=seed)
    raise ValueError(f"compression.kind={cfg.kind!r} has no codec")


class CompressionState:
    """A DDP model's compression: this rank's per-step bytes and its resumable state."""

    def __init__(
        self,
        *,
        kind: str,
        hook: BucketHook | None,
        fixed_stats: CommStats,
        device: torch.device | None = None,
    ) -> None:
        self.kind = kind
        self.hook = hook
        self._fixed_stats = fixed_stats
        self.device = device or torch.device("cpu")
        """Where the gradients live (the link is timed there)."""
        self._codec_mark = 0.0

    @property
    def stats(self) -> CommStats:
        """Bytes this rank sent in the last optimizer step, and the dense equivalent."""
        return self.hook.stats if self.hook is not None else self._fixed_stats

    @property
    def total(self) -> CommStats:
        """Bytes of every step so far, warm-up included (0 without a hook)."""
        return self.hook.total if self.hook is not None else CommStats()

    @property
    def step(self) -> int:
        """Optimizer steps compressed so far (0 without a hook)."""
        return self.hook.step if self.hook is not None else 0

    def after_step(self, *, step_s: float, loss: torch.Tensor) -> tuple[RunEvent, ...]:
        """Under `kind: auto`, feed the controller this step's figures (averaged over
        ranks: a collective) and, when it asks, time the link; the run events of any
        change of ratio. Nothing otherwise."""
        hook = self.hook
        if not isinstance(hook, CodecHook) or hook.adaptive is None:
            return ()
        codec_s, self._codec_mark = hook.codec_seconds - self._codec_mark, hook.codec_seconds
        figures = torch.tensor([step_s, codec_s, float(loss)], dtype=torch.float64)
        dist.all_reduce(figures, group=hook.process_group)
        step_s, codec_s, mean_loss = (figures / hook.world_size).tolist()
        decision = hook.adaptive.observe_step(
            hook.step, step_s=step_s, codec_s=codec_s, loss=mean_loss
        )
        if hook.adaptive.wants_probe(hook.step):
            dense = hook.adaptive.comm_bytes(1.0)[0]
            sizes = [dense, dense // 10, dense // 100]
            timings = time_all_reduces(sizes, group=hook.process_group, device=self.device)
            hook.adaptive.observe_link(timings)
        return (decision.event(),) if decision is not None else ()

    def state_dict(self) -> dict[str, Any]:
        hook_state = self.hook.state_dict() if self.hook is not None else {}
        return {"kind": self.kind, "hook": hook_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self.kind:
            raise ValueError(
                f"compression state is for kind={state['kind']}; this run uses {self.kind}"
            )
        if self.hook is not None:
            self.hook.load_state_dict(state["hook"])


def local_gradient(
    cfg: CompressionConfig, optim: OptimConfig, *, model: nn.Module
) -> LocalGradient:
    """The per-rank transform `cfg` asks for: the optimizer's moments under momentum
    correction, clipping each rank's gradient to optim.grad_clip under it or
    `local_clip` (the average of gradients so bounded is bounded the same)."""
    clip = optim.grad_clip if cfg.local_clip or moments_apply(cfg) else 0.0
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not moments_apply(cfg):
        return LocalGradient(moments="none", clip=clip, total_numel=total)
    if optim.kind == "adamw":
        return LocalGradient(
            moments="adamw",
            momentum=optim.betas[0],
            beta2=optim.betas[1],
            clip=clip,
            total_numel=total,
        )
    return LocalGradient(moments="sgd", momentum=optim.momentum, clip=clip, total_numel=total)


def moments_on_ranks(cfg: JobConfig, *, world_size: int) -> bool:
    """Whether each rank applies the optimizer's moments before compressing."""
    return kind_of(cfg).dense_hooks and world_size > 1 and moments_apply(cfg.compression)


def moments_apply(cfg: CompressionConfig) -> bool:
    """Momentum correction is asked for and the kind is lossy (casts send gradients)."""
    return cfg.momentum_correction and cfg.kind not in ("none", "fp16", "bf16")


def optimizer_config(cfg: JobConfig, *, world_size: int) -> OptimConfig:
    """The optimizer's settings under `cfg.compression`: with the moments on the ranks,
    plain SGD that applies the averaged update with the learning rate and weight decay
    (decoupled, as AdamW's: SGD adds wd * w to an update that is not a gradient)."""
    if not moments_on_ranks(cfg, world_size=world_size):
        return cfg.optim
    return dataclasses.replace(cfg.optim, kind="sgd", momentum=0.0)


@dataclass(frozen=True, kw_only=True)
class Across:
    """Compress over another group than DDP's: a node-aware all-reduce's leaders."""

    group: Any | None
    """The process group (None on a rank outside it)."""
    size: int
    """Its ranks."""
    take: Callable[[BucketHook], None]
    """Receives the hook, which it calls on each bucket (DDP does not)."""


def register_compression(
    ddp_model: nn.Module,
    cfg: CompressionConfig,
    *,
    world_size: int,
    seed: int,
    optim: OptimConfig | None = None,
    across: Across | None = None,
) -> CompressionState:
    """Register the hook for `cfg.kind` on `ddp_model`; return its state.

    With one worker nothing is sent and no hook is needed (stats: 0 bytes). With
    `kind: none` DDP's own all-reduce runs and the stats are its fp32 gradient bytes.
    With `across` (a node-aware all-reduce's leaders) the hook is built over that group
    and handed to its owner instead of DDP; a rank outside it compresses nothing.
    """
    if world_size == 1:
        return CompressionState(kind=cfg.kind, hook=None, fixed_stats=CommStats())
    assert isinstance(ddp_model, DistributedDataParallel), "wrap the model in DDP first"
    model, group = ddp_model.module, ddp_model.process_group
    if cfg.kind == "none":
        dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        stats = CommStats(bytes_sent=dense, dense_bytes=dense)
        return CompressionState(kind=cfg.kind, hook=None, fixed_stats=stats)
    if across is not None:
        if across.group is None:
            return CompressionState(kind=cfg.kind, hook=None, fixed_stats=CommStats())
        group, world_size = across.group, across.size
    local = local_gradient(cfg, optim or OptimConfig(), model=model)
    hook: BucketHook
    if cfg.kind == "powersgd":
        hook = PowerSGDHook(
            model,
            process_group=group,
            approx_rank=cfg.rank,
            seed=seed,
            error_feedback=cfg.error_feedback,
            min_numel=cfg.min_numel,
            warmup_steps=cfg.warmup_steps,
            local=local,
        )
    else:
        hook = CodecHook(
            model,
            process_group=group,
            compressor=build_compressor(cfg, seed=seed, rank=dist.get_rank(group)),
            error_feedback=cfg.error_feedback,
            min_numel=cfg.min_numel,
            warmup_steps=cfg.warmup_steps,
            local=local,
            adaptive=adaptive_ratio(cfg, model, world_size=world_size)
            if cfg.kind == "auto"
            else None,
        )
    if across is not None:
        across.take(hook)
    else:
        ddp_model.register_comm_hook(state=None, hook=hook.communicate)
    device = next(model.parameters()).device
    return CompressionState(kind=cfg.kind, hook=hook, fixed_stats=CommStats(), device=device)


def adaptive_ratio(cfg: CompressionConfig, model: nn.Module, *, world_size: int) -> AdaptiveRatio:
    """`kind: auto`'s controller: dense and top-k ratios down to `cfg.ratio`, with the
    bytes the hook sends at each (tensors under `min_numel` always dense)."""
    shapes = [p.shape for p in model.parameters() if p.requires_grad]

    def comm_bytes(ratio: float) -> tuple[int, int]:
        reduced = gathered = 0
        for shape in shapes:
            if ratio >= 1.0 or shape.numel() < cfg.min_numel:
                reduced += 4 * shape.numel()
            else:
                gathered += TopK(ratio).payload_bytes(shape)
        return reduced, gathered

    candidates = tuple(r for r in CANDIDATES if r >= cfg.ratio)
    assumed = None
    if cfg.auto_link_gbit:
        assumed = LinkFit(latency_s=ASSUMED_LATENCY_S, bytes_per_s=cfg.auto_link_gbit * 1e9 / 8)
    return AdaptiveRatio(
        candidates=candidates, comm_bytes=comm_bytes, world_size=world_size, assumed_link=assumed
    )
