"""Checks of `model.lora` (low-rank adapters over frozen weights) and of `task.kind: dpo`,
whose reference is the model with its adapters off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainstack.config.checks.allowed import DPO_LOSSES, MAX_WIDTH
from trainstack.config.checks.common import cap, check_choice, require
from trainstack.errors import ConfigError
from trainstack.kinds import kind_of, kinds_that

if TYPE_CHECKING:
    from trainstack.config.sections import JobConfig


def validate_lora(cfg: JobConfig) -> None:
    lora, s = cfg.model.lora, cfg.strategy
    require("model.lora.rank", lora.rank >= 0, lora.rank, ">= 0 (0: no adapters)")
    cap("model.lora.rank", lora.rank, MAX_WIDTH)
    if not lora.rank:
        return
    require("model.lora.alpha", lora.alpha > 0, lora.alpha, "> 0")
    require("model.lora.dropout", 0 <= lora.dropout < 1, lora.dropout, "[0, 1)")
    for i, name in enumerate(lora.target_modules):
        require(f"model.lora.target_modules[{i}]", bool(name.strip()), name, "a module name")
    if not kind_of(cfg).lora:
        raise ConfigError(
            f"model.lora with strategy.kind={s.kind}: adapters over frozen weights train "
            f"under strategy.kind {kinds_that(lambda k: k.lora, last=' or ')}"
        )
    if s.tensor_parallel > 1 and lora.rank % s.tensor_parallel:
        raise ConfigError(
            f"model.lora.rank={lora.rank} with strategy.tensor_parallel={s.tensor_parallel}: "
            "each rank holds a share of the adapters' rank; allowed: a rank the "
            "tensor-parallel degree divides"
        )
    where = {
        "strategy.tensor_parallel (under a pipeline)": s.tensor_parallel > 1
        and s.kind == "pipeline",
        "strategy.expert_parallel": s.expert_parallel > 1,
        "compression.kind": cfg.compression.kind != "none",
        "strategy.engine=deepspeed": s.kind == "pipeline" and s.engine == "deepspeed",
    }
    for key, on in where.items():
        if on:
            raise ConfigError(
                f"model.lora with {key} set: adapters do not combine with it yet; allowed: "
                f"ddp, zero, fsdp (tensor_parallel too) or pipeline (engine torch) without "
                "it, or model.lora.rank=0"
            )


def validate_dpo(cfg: JobConfig) -> None:
    d = cfg.dpo
    require("dpo.beta", d.beta > 0, d.beta, "> 0")
    check_choice("dpo.loss", d.loss, DPO_LOSSES)
    if cfg.task.kind != "dpo":
        return
    if cfg.task.loss:
        raise ConfigError(f"task.loss={cfg.task.loss} with task.kind=dpo: the loss is dpo.loss's")
    _check_dpo_layout(cfg)


def _check_dpo_layout(cfg: JobConfig) -> None:
    """DPO runs the reference beside the policy in one forward call per micro-batch, on
    whole logits: under ddp, fsdp (with LoRA, tensor parallel too: the head gathers the
    logits) and, with LoRA (the reference the adapters off), zero; without LoRA its
    frozen copy is placed as ddp and fsdp place the policy (`PlacesReference`)."""
    s = cfg.strategy
    kinds = ("ddp", "fsdp") if cfg.frozen_reference else ("ddp", "fsdp", "zero")
    named = f"{', '.join(kinds[:-1])} or {kinds[-1]}"
    if s.kind not in kinds:
        lora = "without model.lora " if cfg.frozen_reference else ""
        also = "; or set model.lora (then zero too)" if cfg.frozen_reference else ""
        raise ConfigError(
            f"task.kind=dpo {lora}under strategy.kind={s.kind}: allowed: strategy.kind "
            f"{named}{also}"
        )
    where = {
        "strategy.tensor_parallel": s.tensor_parallel > 1 and cfg.frozen_reference,
        "strategy.expert_parallel": s.expert_parallel > 1,
    }
    for key, on in where.items():
        if on:
            raise ConfigError(
                f"task.kind=dpo with {key} set: DPO's reference and its whole-logit "
                f"log-probabilities do not combine with it yet; allowed: {named} "
                "without it"
            )
