"""Validation of the job spec: `validate` runs every family's checks (`model_data`,
`strategy`, `run`, and the mesh layouts in `config.layout`); `allowed` holds the allowed
values and limits, `common` the one-line refusals they share.

Every check raises `ConfigError` with one line: the dotted key, the value, what is
allowed and, where it helps, a hint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainstack.config.checks.allowed import MAX_RESTARTS, PROGRESS_MODES, TRACKING_BACKENDS
from trainstack.config.checks.common import cap, check_choice, require
from trainstack.config.checks.lora import validate_dpo, validate_lora
from trainstack.config.checks.model_data import (
    validate_data,
    validate_fused_loss,
    validate_model,
    validate_pack,
    validate_task,
)
from trainstack.config.checks.moe import validate_moe
from trainstack.config.checks.run import (
    validate_checkpoint,
    validate_cross_section,
    validate_faults,
    validate_log,
    validate_name,
    validate_optim,
    validate_scaling,
    validate_train,
)
from trainstack.config.checks.strategy import (
    validate_compression,
    validate_parameter_server,
    validate_pipeline,
    validate_strategy,
)
from trainstack.config.layout import validate_mesh

if TYPE_CHECKING:
    from trainstack.config.sections import JobConfig


def validate(cfg: JobConfig) -> None:
    """Raise ConfigError for out-of-range values and inconsistent combinations."""
    validate_name(cfg.name)
    validate_model(cfg.model)
    validate_task(cfg)
    validate_data(cfg.data)
    validate_train(cfg.train)
    validate_optim(cfg.optim)
    validate_strategy(cfg)
    validate_mesh(cfg)
    validate_pipeline(cfg)
    validate_parameter_server(cfg)
    validate_moe(cfg)
    validate_lora(cfg)
    validate_dpo(cfg)
    validate_fused_loss(cfg)
    validate_pack(cfg)
    validate_compression(cfg)
    validate_scaling(cfg.scaling)
    validate_checkpoint(cfg.checkpoint)
    validate_faults(cfg)
    max_failures = cfg.failure.max_failures
    require("failure.max_failures", max_failures >= -1, max_failures, ">= -1 (-1: unlimited)")
    cap("failure.max_failures", max_failures, MAX_RESTARTS, why=" (-1: unlimited)")
    poll = cfg.failure.health_check_s
    require("failure.health_check_s", 0.05 <= poll <= 60, poll, "0.05 to 60 (seconds)")
    check_choice("tracking.backend", cfg.tracking.backend, TRACKING_BACKENDS)
    validate_log(cfg)
    check_choice("log.progress", cfg.log.progress, PROGRESS_MODES)
    validate_cross_section(cfg)
