"""Checks of `model.moe` (mixture-of-experts blocks) and `strategy.expert_parallel`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainstack.config.checks.allowed import MAX_WIDTH, MAX_WORKERS, MOE_BALANCE
from trainstack.config.checks.common import cap, check_choice, require
from trainstack.errors import ConfigError
from trainstack.kinds import MODEL_KINDS, kind_of, kinds_that, model_kind_of

if TYPE_CHECKING:
    from trainstack.config.sections import JobConfig


def validate_moe(cfg: JobConfig) -> None:
    m, ep = cfg.model.moe, cfg.strategy.expert_parallel
    require("strategy.expert_parallel", ep >= 1, ep, ">= 1 (1: every rank holds every expert)")
    cap("strategy.expert_parallel", ep, MAX_WORKERS)
    if m.experts == 0:
        if ep > 1 and model_kind_of(cfg).moe_in_spec:
            raise ConfigError(
                f"strategy.expert_parallel={ep} needs MoE layers to split; set model.moe.experts "
                "(>= 2, a multiple of expert_parallel) or expert_parallel to 1"
            )
    else:
        _validate_layers(cfg)
    if ep > 1:
        _validate_expert_parallel(cfg)


def _validate_layers(cfg: JobConfig) -> None:
    m, model = cfg.model.moe, cfg.model
    if not model_kind_of(cfg).moe_in_spec:
        raise ConfigError(
            f"model.moe.experts={m.experts} is for model.kind "
            f"{kinds_that(lambda k: k.moe_in_spec, table=MODEL_KINDS)}; model.kind={model.kind} "
            "puts trainstack.models.moe.MoE in its own module instead (docs/moe.md)"
        )
    require("model.moe.experts", m.experts >= 2, m.experts, ">= 2 (0: no MoE layers)")
    cap("model.moe.experts", m.experts, MAX_WIDTH)
    require("model.moe.top_k", 1 <= m.top_k <= m.experts, m.top_k, f"1 to {m.experts}")
    require("model.moe.every", 1 <= m.every <= model.n_layer, m.every, f"1 to {model.n_layer}")
    require("model.moe.expert_hidden", m.expert_hidden >= 0, m.expert_hidden, ">= 0")
    cap("model.moe.expert_hidden", m.expert_hidden, MAX_WIDTH)
    require("model.moe.capacity_factor", m.capacity_factor >= 0, m.capacity_factor, ">= 0")
    check_choice("model.moe.balance", m.balance, MOE_BALANCE)
    require("model.moe.aux_weight", m.aux_weight >= 0, m.aux_weight, ">= 0")
    require("model.moe.bias_rate", m.bias_rate >= 0, m.bias_rate, ">= 0")
    moe = kind_of(cfg).moe
    if moe == "no":
        raise ConfigError(
            f"model.moe with strategy.kind={cfg.strategy.kind}: the aux loss and the expert "
            "dispatch do not cross pipeline stages yet; allowed: strategy.kind "
            f"{kinds_that(lambda k: k.moe != 'no' and k.runs_on != 'plan', last=' or ')}"
        )
    if moe == "without bias" and m.balance == "bias":
        raise ConfigError(
            f"model.moe.balance=bias with strategy.kind={cfg.strategy.kind}: the routing bias "
            "moves with each synchronous step; allowed here: aux_loss or none"
        )
    if cfg.strategy.tensor_parallel > 1:
        raise ConfigError(
            f"model.moe with strategy.tensor_parallel={cfg.strategy.tensor_parallel}: MoE "
            "blocks have no tensor-parallel plan yet; allowed: tensor_parallel 1"
        )
    if model.activation_checkpointing:
        raise ConfigError(
            "model.moe with model.activation_checkpointing=true: recomputing a block would "
            "route its tokens twice; allowed: activation_checkpointing false"
        )


def _validate_expert_parallel(cfg: JobConfig) -> None:
    ep, m, workers = cfg.strategy.expert_parallel, cfg.model.moe, cfg.scaling.num_workers
    if not kind_of(cfg).expert_parallel:
        raise ConfigError(
            f"strategy.expert_parallel={ep} with strategy.kind={cfg.strategy.kind}: experts "
            f"are split only under strategy.kind {kinds_that(lambda k: k.expert_parallel)}; "
            "other kinds keep every expert on every rank (set expert_parallel to 1)"
        )
    if workers % ep:
        raise ConfigError(
            f"strategy.expert_parallel={ep} must divide scaling.num_workers={workers}; "
            "allowed: a divisor of the worker count"
        )
    if cfg.scaling.elastic:
        raise ConfigError(
            f"strategy.expert_parallel={ep} with an elastic scaling.num_workers: the experts' "
            "split is fixed for the run; give num_workers a number"
        )
    if m.experts and m.experts % ep:
        raise ConfigError(
            f"strategy.expert_parallel={ep} must divide model.moe.experts={m.experts} (each "
            "rank holds an equal share); allowed: a divisor of the experts"
        )
