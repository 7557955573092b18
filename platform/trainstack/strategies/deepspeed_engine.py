"""What the two DeepSpeed strategies share: ZeRO (`zero.py`) and the pipeline on
DeepSpeed's PipelineEngine (`pipeline_deepspeed.py`).

Both run DeepSpeed on the process group trainstack made (`init_deepspeed_comm`), build
DeepSpeed's config from the spec with its raw `deepspeed:` section merged last
(`config_from_spec`), hand trainstack's optimizer and LR schedule (trainstack/optim.py)
to `deepspeed.initialize` (`build_engine`), and save and measure ZeRO's optimizer
state alike (`master_partitions`, `weights_only_value`, `UNSAVED_OPTIMIZER_KEYS`).

DeepSpeed is imported inside the functions: importing it is slow and prints a notice.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack.config import JobConfig
from trainstack.optim import build_scheduler
from trainstack.strategies.base import WorkerContext

# DeepSpeed optimizer-state keys holding objects `torch.load(weights_only=True)` refuses:
# the loss scaler (a static scale of 1 under fp32 and bf16, so the live one is put back
# on load) and the parameter-slice map that only universal checkpoints read.
UNSAVED_OPTIMIZER_KEYS = ("loss_scaler", "param_slice_mappings")
ZERO_FRAGMENTS = "param_fragments"
"""Key, in a ZeRO 1/2 rank's optimizer file, of `{name: [start, numel]}` per group: where
in the rank's flat partition each parameter's fragment lies (DeepSpeed's
`param_slice_mappings`, in types `weights_only` loads)."""


def config_from_spec(cfg: JobConfig, specific: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's config for `cfg`: the keys every DeepSpeed job derives from the spec,
    then the strategy's `specific` ones, then `cfg.deepspeed` deep-merged last."""
    derived = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip,
        **specific,
        "log_level": "warning",  # trainstack reports progress itself
    }
    return deep_merge(derived, cfg.deepspeed)


def init_deepspeed_comm(ctx: WorkerContext) -> None:
    """Start `deepspeed.comm` on trainstack's process group (a one-rank group is made for
    a single worker: DeepSpeed needs torch.distributed even then)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if ctx.device.type == "cpu":
        # DeepSpeed's torch backend JIT-compiles its shared-memory all-reduce (about a
        # minute) whenever it wraps a process group on CPU, though only inference
        # uses it; marking it unavailable keeps training on the gloo group we made.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # DeepSpeed takes its device from LOCAL_RANK and refuses to start without it.
    index = ctx.device.index
    os.environ["LOCAL_RANK"] = str(ctx.local_rank if index is None else index)
    backend = get_accelerator().communication_backend_name()
    deepspeed.comm.init_distributed(dist_backend=backend, dist_init_required=False)


def build_engine(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, cfg: JobConfig, config: dict[str, Any]
) -> tuple[Any, torch.optim.lr_scheduler.LambdaLR]:
    """DeepSpeed's engine around `model`, stepping trainstack's `optimizer` and the spec's
    LR schedule (both DeepSpeed's to run from here on); the engine and the schedule."""
    import deepspeed

    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=cfg.train.steps)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=config,
        dist_init_required=False,
    )
    return engine, scheduler


def master_partitions(zero_optimizer: Any) -> list[torch.Tensor]:
    """The fp32 partitions the optimizer updates (stage 1/2 and stage 3 name them apart)."""
    found = getattr(zero_optimizer, "single_partition_of_fp32_groups", None)
    if found is None:
        found = zero_optimizer.fp32_partitioned_groups_flat
    return list(found)


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def weights_only_value(value: Any) -> Any:
    """`value` in types `torch.load(weights_only=True)` accepts: enums become their
    values, other mappings dicts, named tuples lists; anything else is refused."""
    if isinstance(value, enum.Enum):
        return weights_only_value(value.value)
    if isinstance(value, torch.Tensor | str | int | float | bool | None):
        return value
    if isinstance(value, Mapping):
        return {key: weights_only_value(item) for key, item in value.items()}
    if type(value) is tuple:
        return tuple(weights_only_value(item) for item in value)
    if isinstance(value, list | tuple):
        return [weights_only_value(item) for item in value]
    raise TypeError(f"cannot checkpoint a {type(value).__name__} with weights_only=True")
