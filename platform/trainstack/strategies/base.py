"""The Strategy interface: what the training loop may ask of a parallelism strategy.

A strategy turns (model, optimizer spec, worker context) into something that takes
training steps, evaluates and reduces over its group, measures the bytes it sends and
holds, and saves and loads its state. The loop never calls DDP, DeepSpeed or pipeline
APIs itself: only the strategy does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from trainstack.checkpoint import Checkpoint
from trainstack.config import JobConfig
from trainstack.data.sharding import Batch
from trainstack.run_events import RunEvent
from trainstack.tasks import EvalSums


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """Where this worker sits in the group; the same on Ray Train and plain torch.distributed."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    node: str = ""
    """The machine this rank runs on (Ray's node id); ranks with the same one share it."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """What one optimizer step produced on this rank."""

    loss: torch.Tensor
    """This rank's mean loss over its micro-batches (a 0-dim tensor, not synced)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step."""
    bytes_on_wire: int | None = None
    """Bytes this rank passed to collectives this step (None: the strategy does not measure)."""
    compression_ratio: float | None = None
    """Dense fp32 gradient bytes / bytes_on_wire."""
    events: tuple[RunEvent, ...] = ()
    """Run events of this step, the same on every rank (e.g. adaptive compression's
    `CompressionChange`)."""


class Strategy(Protocol):
    """One parallelism technique: set up, step, evaluate, reduce, measure, save and load."""

    name: str

    def setup(self, model: nn.Module) -> None:
        """Place and wrap the model; build optimizer and LR schedule."""

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        """Forward/backward every micro-batch (accumulating), then one optimizer step."""

    def evaluate(self, batches: list[Batch]) -> EvalSums:
        """Held-out sums over this rank's `batches`, added over the group (a collective:
        every rank gets the same)."""

    def global_mean(self, value: torch.Tensor) -> float:
        """Mean of a per-rank scalar over the data-parallel group (a collective)."""

    def comm_bytes_per_step(self) -> int:
        """Bytes this rank sends per optimizer step (modelled from the algorithm)."""

    def unwrapped_model(self) -> nn.Module:
        """The bare model, for saving portable weights."""

    def checkpoint_files(self) -> dict[str, Any]:
        """Files this rank adds to a checkpoint: name -> torch-saveable object.

        Together the ranks must write the full weights, as `model.pt` or as stage files
        (`checkpoint.stage_file`), so that any strategy and world size can load them.
        """

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        """Restore from a verified checkpoint; return notes on what could not be restored."""

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of `params`, `grads` and `optimizer` state, measured from the
        tensors it holds (`grads`: the most held after any backward pass so far)."""


@runtime_checkable
class ReportsLayout(Protocol):
    """An optional ability: a strategy that places the model in parts says how, and
    reports figures of that layout (e.g. a pipeline's bubble) in the run's summary."""

    def layout_notes(self) -> list[str]:
        """Lines for the console at start: how the model was cut and placed."""

    def run_metrics(self) -> dict[str, Any]:
        """Figures for the summary, the same on every rank (a collective)."""


@runtime_checkable
class LoadsPretrainedParts(Protocol):
    """An optional ability: a strategy that shards or cuts the model takes a pretrained
    one with its parameters on the meta device (`build_model(pretrained_on_meta=True)`),
    gives each rank storage for its own part in `setup`, then reads that part alone
    from the folder (fsdp and the torch pipelines: strategies/pretrained_parts.py; ZeRO:
    strategies/zero_pretrained.py, where stages 1-2 hold and read the whole model)."""

    def load_pretrained(self, folder: str) -> None:
        """After `setup`: fill this rank's part of the model from the save_pretrained
        `folder` (a collective)."""


@runtime_checkable
class PlacesReference(Protocol):
    """An optional ability: a strategy that can hold DPO's frozen reference model (a copy
    of the policy as it started, `task.kind: dpo` without `model.lora`) placed as it
    places the policy: on the same devices, in the same dtype, sharded the same way."""

    def place_reference(self, reference: nn.Module) -> nn.Module:
        """After `setup`: `reference` placed (no optimizer, no gradients)."""


def ring_allreduce_bytes(numel: int, *, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` elements: 2(N-1)/N of the buffer."""
    if world_size == 1:
        return 0
    return 2 * (world_size - 1) * numel * element_size // world_size


def weight_dtype(cfg: JobConfig) -> torch.dtype:
    """The dtype of the model's weights: float64 under `train.precision: fp64`, else
    float32 (bf16 is autocast over fp32 weights)."""
    return torch.float64 if cfg.train.precision == "fp64" else torch.float32


def to_device(
    batch: Batch, device: torch.device, *, pin_memory: bool, dtype: torch.dtype | None = None
) -> Batch:
    """A batch's inputs and targets on `device`, floating-point inputs in `dtype` when
    given (the weights' dtype, `weight_dtype`). On a GPU with `train.pin_memory` they go through
    page-locked host memory and are copied without blocking the host, which moves on to
    queue the forward while the copy runs."""
    x, y = batch
    if dtype is not None and x.is_floating_point() and x.dtype != dtype:
        x = x.to(dtype)
    if device.type == "cuda" and pin_memory:
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
            device, non_blocking=True
        )
    return x.to(device), y.to(device)


def autocast(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast over fp32 weights with `train.precision: bf16`, else nothing."""
    if cfg.train.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_compile(cfg: JobConfig, root: nn.Module, *, classes: set[str] | None = None) -> None:
    """With `train.compile`, torch.compile the repeated blocks under `root` in place;
    `classes` names them where `root` holds only some (a pipeline stage's), else they
    are found in `root`."""
    if not cfg.train.compile:
        return
    from trainstack.models import block_classes, compile_blocks

    if classes is None:
        classes = block_classes(root, class_names=cfg.model.checkpoint_modules)
    compile_blocks(root, classes=classes)


def fast_forward_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, *, step: int) -> None:
    """Put `scheduler` (and its optimizer's lr) where it is after `step` optimizer steps,
    for a resume that could not load the schedule's saved state."""
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor in a nest of mappings, lists and tuples (e.g. an optimizer's state)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensors_in(item)]
    return []


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storage behind `tensors`, each storage counted once (views share one)."""
    storages = {
        (t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors
    }
    return sum(storages.values())
