"""Pipeline parallelism on DeepSpeed's PipelineEngine, alone or × data parallel (2D).

The same layout as `pipeline.py` (the torch engine), so a run means the same either
way: `p = strategy.stages` pipeline ranks times `d = strategy.data_parallel` replicas,
global rank = pp_rank × d + dp_rank (DeepSpeed's `PipeDataParallelTopology` numbers
them so too); the model is cut along its pipeline layers where `split_stages` cuts it,
one stage per rank; the stage files hold the full model's state-dict keys.

The `PipelineModule` is built from the split: each stage is one layer, a `StageModule`
(the rank's own; another rank's is a placeholder DeepSpeed never builds), followed by
one `TiedLayerSpec` per parameter that the stage shares with other stages (a GPT's
tied embedding and LM head). That spec's module, `TiedWeight`, holds the stage's own
copy of the parameter and passes activations through, so DeepSpeed sums the copies'
gradients between the stages holding them (`ReduceTiedGrads`) and every copy takes
the same update, as the model's one tensor does. Activation checkpointing comes with
the model's layers (`build_model`), not from DeepSpeed.

One `train_batch` runs DeepSpeed's own 1F1B-style schedule over the replica's
`strategy.microbatches` micro-batches (the task's loss, scaled by 1/m, on the last
stage), sums the tied gradients, averages every gradient over the replicas, clips by
the global norm and steps trainstack's optimizer and LR schedule (trainstack/optim.py),
handed to `deepspeed.initialize` as under ZeRO (the set-up both share is in
`deepspeed_engine.py`). Pipelines train in fp32 (the spec refuses bf16 for them), so
DeepSpeed wraps the optimizer only for ZeRO-1.

Clipping needs one flag. Without ZeRO, DeepSpeed clips with `runtime.utils.clip_grad_norm_`,
which sums squares over the pipeline (its "model parallel" group) but on stages > 0
counts only parameters flagged `model_parallel` (Megatron's convention for tensors that
differ between model-parallel ranks); unflagged, the norm would be stage 0's alone.
So every parameter is flagged except the tied copies DeepSpeed marks
`ds_pipe_replicated` (all but the first stage's): the norm is the whole model's, each
tied parameter counted once. ZeRO-1 computes its norm by its own rule (all parameters,
skipping `ds_pipe_replicated`), which the flag leaves as it is.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.module import PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.runtime.utils import clip_grad_norm_
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
from torch import nn

from trainstack.checkpoint import Checkpoint, rank_file, stage_file
from trainstack.config import JobConfig, config_from_dict
from trainstack.data.sharding import Batch
from trainstack.optim import build_optimizer, scaled_lr
from trainstack.strategies.base import (
    StepOutput,
    WorkerContext,
    fast_forward_schedule,
    ring_allreduce_bytes,
    storage_bytes,
    tensors_in,
)
from trainstack.strategies.deepspeed_engine import (
    UNSAVED_OPTIMIZER_KEYS,
    build_engine,
    config_from_spec,
    init_deepspeed_comm,
    master_partitions,
    weights_only_value,
)
from trainstack.strategies.pipeline_probe import (
    BoundaryMeter,
    SavedActivationMeter,
    first_replica_figures,
    simulated_bubble,
    single_stage_orders,
)
from trainstack.strategies.pipeline_split import (
    StageModule,
    StageSplit,
    TiedParameter,
    check_pipeline_model,
    last_stage_mean,
    model_layers,
    recv_activation,
    send_activation,
    split_stages,
    tied_parameters,
)
from trainstack.tasks import EvalSums, build_task, eval_mode, evaluate

_END_OF_BATCH = (ds_schedule.ReduceTiedGrads, ds_schedule.ReduceGrads, ds_schedule.OptimizerStep)
"""The instructions that end a batch: gradient reductions and the optimizer step."""


def pipeline_deepspeed_config(cfg: JobConfig) -> dict[str, Any]:
    """DeepSpeed's config for a pipeline job: derived from the spec (ZeRO stage 0 unless
    `deepspeed.zero_optimization` says 1), then `cfg.deepspeed` deep-merged."""
    return config_from_spec(cfg, {"zero_optimization": {"stage": 0}})


# ---- the split as DeepSpeed layers ----------------------------------------------------


class TiedWeight(nn.Module):
    """DeepSpeed's tied module for one tied parameter: it holds the stage's own copy
    (`weight`, whose gradient DeepSpeed sums over the stages holding one) and passes
    activations through unchanged."""

    def __init__(self, weight: nn.Parameter | None) -> None:
        super().__init__()
        assert weight is not None, "built only on the rank holding the stage"
        self.weight = weight

    def forward(self, x: Any) -> Any:
        return x


def deepspeed_layers(
    stage: StageModule, *, stage_index: int, split: StageSplit, ties: list[TiedParameter]
) -> tuple[list[Any], list[int]]:
    """`PipelineModule` layers for `split`, and the index where each stage begins (plus
    the end). Stage s is one layer (this rank's `stage`, or a placeholder another rank
    builds) followed by a `TiedLayerSpec` for each tied parameter it holds; tie keys are
    the ties' positions in `ties`, the same on every rank."""
    layers: list[Any] = []
    parts = [0]
    for s in range(split.num_stages):
        layers.append(stage if s == stage_index else nn.Identity())  # not built here
        for key, tie in enumerate(ties):
            if s not in tie.stages:
                continue
            copy = None
            if s == stage_index:
                layer, name = tie.uses[tie.stages.index(s)]
                copy = stage.parameter(layer=layer, name=name)
            layers.append(TiedLayerSpec(f"tie_{key:05d}", TiedWeight, copy))
        parts.append(len(layers))
    return layers, parts


class SplitPipelineModule(PipelineModule):
    """A `PipelineModule` cut at given layer indices rather than by DeepSpeed's own
    partitioning methods, so that both engines cut a model alike."""

    def __init__(self, layers: list[Any], *, parts: list[int], **kwargs: Any) -> None:
        self._given_parts = parts  # read by _partition_layers, which __init__ calls
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        self.parts = list(self._given_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


class InstructionProbe:
    """Times a PipelineEngine's instructions and meters what they hold.

    `seconds["compute"]`: its forward and backward passes; `seconds["end_of_batch"]`: the
    gradient reductions (tied parameters, replicas) and the optimizer step. Forward's
    saved activations go to `meter`, and the gradient bytes held after each backward to
    `peak_grad_bytes`. The engine runs each instruction by looking it up in
    `_INSTRUCTION_MAP`, which a wrapped copy set on the engine instance shadows.
    """

    def __init__(self, engine: Any, *, held_grad_bytes: Callable[[], int]) -> None:
        params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
        self.meter = SavedActivationMeter(exclude=params)
        self.held_grad_bytes = held_grad_bytes
        self.seconds = {"compute": 0.0, "end_of_batch": 0.0}
        self.peak_grad_bytes = 0
        instructions = dict(engine._INSTRUCTION_MAP)
        forward = instructions[ds_schedule.ForwardPass]
        backward = instructions[ds_schedule.BackwardPass]

        def probed_forward(engine_self: Any, **kwargs: Any) -> None:
            with self._timed("compute"), self.meter.recording():
                forward(engine_self, **kwargs)

        def probed_backward(engine_self: Any, **kwargs: Any) -> None:
            with self._timed("compute"):
                backward(engine_self, **kwargs)
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.held_grad_bytes())

        instructions[ds_schedule.ForwardPass] = probed_forward
        instructions[ds_schedule.BackwardPass] = probed_backward
        for kind in _END_OF_BATCH:
            instructions[kind] = self._end_of_batch(instructions[kind])
        engine._INSTRUCTION_MAP = instructions

    def _end_of_batch(self, run: Callable[..., None]) -> Callable[..., None]:
        def probed(engine_self: Any, **kwargs: Any) -> None:
            with self._timed("end_of_batch"):
                run(engine_self, **kwargs)

        return probed

    @contextlib.contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[kind] += time.perf_counter() - start

    def restart_clocks(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


# ---- the strategy ---------------------------------------------------------------------


class DeepSpeedPipelineStrategy:
    name = "pipeline"

    def __init__(self, cfg: JobConfig, ctx: WorkerContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.task = build_task(cfg)
        self.dims = cfg.dims
        self.at = self.dims.coords(ctx.rank)
        """This rank's pipeline rank, replica and tensor-parallel rank."""
        self.pp_size, self.dp_size = self.dims.pp, self.dims.dp
        self.pp_rank, self.dp_rank = self.at.pp, self.at.dp
        self.holds_first, self.holds_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.zero_stage = _zero_stage(cfg)
        self.sharded_optimizer = self.zero_stage == 1
        """ZeRO-1 wraps the optimizer, which keeps fp32 master weights and optimizer state
        partitioned over the replicas."""
        self.engine: Any = None
        """deepspeed.runtime.pipe.engine.PipelineEngine, built by `setup`."""
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.stage: StageModule | None = None
        self.boundary: BoundaryMeter | None = None
        self.split: StageSplit | None = None
        self.ties: list[TiedParameter] = []
        self.probe: InstructionProbe | None = None
        self._batch_s = 0.0
        """Seconds in `train_batch` after the first step (which also sends shapes)."""
        self._warmed_up = False

    # ---- setup --------------------------------------------------------------------------

    def setup(self, model: nn.Module) -> None:
        check_pipeline_model(self.cfg, model)
        init_deepspeed_comm(self.ctx)  # PipelineModule needs it before deepspeed.initialize
        layers = model_layers(model)
        self.split = split_stages(layers, self.pp_size)
        self.ties = tied_parameters(model, layers, self.split)
        self.stage = StageModule(model, layers, self.split.layers[self.pp_rank])
        self.boundary = BoundaryMeter(self.stage)
        specs, parts = deepspeed_layers(
            self.stage, stage_index=self.pp_rank, split=self.split, ties=self.ties
        )
        # No grad: the module broadcasts the tied weights in place while it is built, which
        # outside no_grad leaves a "backprop through c10d::broadcast_" warning on their grads.
        # Its prints (seed settings, topology) repeat what layout_notes says.
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            module = SplitPipelineModule(
                specs,
                parts=parts,
                topology=PipeDataParallelTopology(num_pp=self.pp_size, num_dp=self.dp_size),
                loss_fn=self.task.pipeline_loss,
            )
        grid = module.mpu()
        assert (grid.get_stage_id(), grid.get_data_parallel_id()) == (self.pp_rank, self.dp_rank)
        _flag_for_clipping(module)
        lr = scaled_lr(self.cfg.optim, data_parallel_size=self.dp_size)
        optimizer = build_optimizer(module, self.cfg.optim, lr=lr)
        self.engine, self.scheduler = build_engine(
            module, optimizer, cfg=self.cfg, config=pipeline_deepspeed_config(self.cfg)
        )
        self._keep_clip_norm()
        self.probe = InstructionProbe(self.engine, held_grad_bytes=self._held_grad_bytes)

    def _keep_clip_norm(self) -> None:
        """Keep the norm `engine.clip_fp32_gradients` (no ZeRO, fp32) computes and drops."""
        engine = self.engine

        def clip_and_keep() -> None:
            norm = clip_grad_norm_(
                parameters=engine.module.parameters(),
                max_norm=engine.gradient_clipping(),
                mpu=engine.mpu,
            )
            engine._global_grad_norm = float(norm)

        engine.clip_fp32_gradients = clip_and_keep

    def unwrapped_model(self) -> nn.Module:
        """This rank's stage in DeepSpeed's `PipelineModule` (`checkpoint_files` uses the
        stage's own state dict, under the model's names)."""
        assert self.engine is not None, "setup() first"
        module: nn.Module = self.engine.module
        return module

    def _stage(self) -> StageModule:
        assert self.stage is not None, "setup() first"
        return self.stage

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.unwrapped_model().parameters() if p.requires_grad]

    # ---- training -----------------------------------------------------------------------

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        """One `train_batch`: the first stage reads the inputs, the last the targets.
        The grad norm is NaN with clipping off under ZeRO stage 0 (none is computed)."""
        engine, probe = self.engine, self.probe
        assert engine is not None and probe is not None, "setup() first"
        assert self.scheduler is not None
        assert len(micro_batches) == engine.micro_batches, (len(micro_batches), "per step")
        lr = float(self.scheduler.get_last_lr()[0])
        start = time.perf_counter()
        engine.train_batch(data_iter=iter(micro_batches))
        if self._warmed_up:
            self._batch_s += time.perf_counter() - start
        else:
            probe.restart_clocks()
            self._warmed_up = True
        grad_norm = engine.get_global_grad_norm()
        return StepOutput(
            loss=engine.dp_group_loss.detach().clone(),  # the last stage's, on every rank
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            lr=lr,
        )

    def _held_grad_bytes(self) -> int:
        grads = [p.grad for p in self._params() if p.grad is not None]
        if self.sharded_optimizer:
            masters = master_partitions(self.engine.optimizer)
            grads += [m.grad for m in masters if m.grad is not None]
        return storage_bytes(grads)

    # ---- evaluation and reductions ------------------------------------------------------

    def evaluate(self, batches: list[Batch]) -> EvalSums:
        """Each batch goes through the replica's stages in order, activations passed point
        to point, shapes first (DeepSpeed's `eval_batch` wants the same micro-batch count
        and shape on every replica, which held-out shares need not have); the last stage's
        ranks add up the task's sums, and every rank gets the total."""
        stage = self._stage()
        restore = eval_mode([self.unwrapped_model()])

        def forward(x: torch.Tensor) -> Any | None:
            act: Any = x
            if not self.holds_first:
                src = self.dims.rank(pp=self.pp_rank - 1, dp=self.dp_rank, tp=self.at.tp)
                act = recv_activation(src=src, device=self.ctx.device)
            act = stage(act)
            if self.holds_last:
                return act
            send_activation(
                act, dst=self.dims.rank(pp=self.pp_rank + 1, dp=self.dp_rank, tp=self.at.tp)
            )
            return None

        sums = evaluate(self.task, forward, batches, device=self.ctx.device)
        restore()
        dist.all_reduce(sums)
        return EvalSums.of(sums)

    def global_mean(self, value: torch.Tensor) -> float:
        return last_stage_mean(value, holds_last=self.holds_last, replicas=self.dp_size)

    def comm_bytes_per_step(self) -> int:
        """Modelled: activations out and their gradients back across this rank's stage
        boundaries (their sizes as measured in the last training forward), the gradient
        all-reduce over replicas (ZeRO-1: a reduce-scatter and the updated parameters'
        all-gather, the same bytes), and the tied parameters' all-reduces."""
        assert self.boundary is not None, "setup() first"
        activations = 0
        if not self.holds_last:
            activations += self.boundary.output_bytes
        if not self.holds_first:
            activations += self.boundary.input_grad_bytes
        numel = sum(p.numel() for p in self._params())
        replicas = ring_allreduce_bytes(numel, element_size=4, world_size=self.dp_size)
        tied = sum(
            ring_allreduce_bytes(tie.numel, element_size=4, world_size=len(tie.stages))
            for tie in self.ties
            if self.pp_rank in tie.stages
        )
        return self.cfg.strategy.microbatches * activations + replicas + tied

    def layout_notes(self) -> list[str]:
        s = self.cfg.strategy
        assert self.split is not None, "setup() first"
        return [
            f"pipeline (deepspeed PipelineEngine, ZeRO stage {self.zero_stage}): "
            f"{self.pp_size} ranks × {self.dp_size} replicas, {s.microbatches} micro-batches "
            "per step",
            self.split.describe(),
        ]

    def run_metrics(self) -> dict[str, Any]:
        """Split, per-stage parameters, bubble and activation memory (a collective).

        A rank's bubble is the share of its pipeline time (`train_batch` less the batch's
        gradient reductions and optimizer step, as the torch engine times its schedule
        alone) spent outside forward and backward passes: waiting and communicating.
        """
        assert self.split is not None and self.probe is not None, "setup() first"
        mine = {
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "params": sum(p.numel() for p in self._params()),
            "busy_s": self.probe.seconds["compute"],
            "step_s": self._batch_s - self.probe.seconds["end_of_batch"],
            "activation_peak_bytes": self.probe.meter.peak_bytes,
        }
        replica0, bubbles = first_replica_figures(mine, world_size=self.ctx.world_size)
        return {
            "pipeline": {
                "engine": "deepspeed",
                "schedule": self.cfg.strategy.schedule,
                "stages": self.pp_size,
                "split": self.split.describe(),
                "params_per_stage": [r["params"] for r in replica0],
                "bubble_fraction": sum(bubbles) / len(bubbles),
                "bubble_fraction_per_rank": bubbles,
                # DeepSpeed's TrainSchedule keeps 1F1B's order: its bubble with equal stages.
                "ideal_bubble_fraction": simulated_bubble(
                    single_stage_orders(
                        "1f1b", pp_size=self.pp_size, microbatches=self.cfg.strategy.microbatches
                    ),
                    num_stages=self.pp_size,
                ),
                "activation_peak_bytes_per_stage": [r["activation_peak_bytes"] for r in replica0],
            }
        }

    # ---- state --------------------------------------------------------------------------

    def checkpoint_files(self) -> dict[str, Any]:
        """Replica 0's ranks write their stage's weights under the model's names and their
        optimizer state, or every rank its optimizer shard if the state is sharded; rank 0
        the LR schedule. A collective if sharded (gathering the weights)."""
        assert self.scheduler is not None, "setup() first"
        weights = self._fp32_weights()
        files: dict[str, Any] = {}
        if self.sharded_optimizer:
            shard = self.engine.optimizer.state_dict()
            files[rank_file("optimizer", self.ctx.rank)] = {
                key: weights_only_value(value)
                for key, value in shard.items()
                if key not in UNSAVED_OPTIMIZER_KEYS
            }
        elif self.dp_rank == 0:
            files[rank_file("optimizer", self.pp_rank)] = self.engine.optimizer.state_dict()
        if self.dp_rank == 0:
            files[stage_file(self.pp_rank)] = weights
        if self.ctx.rank == 0:
            files["scheduler.pt"] = self.scheduler.state_dict()
        return files

    def _fp32_weights(self) -> dict[str, torch.Tensor]:
        """This stage's state dict under the model's names, parameters from ZeRO-1's fp32
        master copy where it keeps one. A collective there."""
        master = {id(p): safe_get_full_fp32_param(p) for p in self._params()}
        return {
            name: _fp32_copy(master.get(id(value)), value)
            for name, value in self._stage().state_dict(keep_vars=True).items()
        }

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        engine = self.engine
        assert engine is not None and self.scheduler is not None, "setup() first"
        reason = self._why_not_exact(checkpoint)
        if reason is None:
            self._load_weights(checkpoint.load(stage_file(self.pp_rank)))
            self._load_optimizer(checkpoint)
            self.scheduler.load_state_dict(checkpoint.load("scheduler.pt"))
            notes = []
        else:
            self._load_weights(checkpoint.full_weights())
            fast_forward_schedule(self.scheduler, step=checkpoint.step)
            notes = [f"optimizer state re-initialised ({reason})"]
        engine.global_steps = checkpoint.step
        engine.global_samples = checkpoint.samples_seen
        return notes

    def _why_not_exact(self, checkpoint: Checkpoint) -> str | None:
        """Why the checkpoint's stage files and optimizer state do not fit this layout."""
        source = checkpoint.manifest.get("strategy")
        if source != self.name:
            return f"the checkpoint is from {source}"
        saved = config_from_dict(checkpoint.manifest["spec"])
        if saved.strategy.engine != "deepspeed":
            return f"the checkpoint is from the {saved.strategy.engine} engine"
        if saved.strategy.stages != self.pp_size:
            return f"the checkpoint has {saved.strategy.stages} stages, this run {self.pp_size}"
        if _zero_stage(saved) != self.zero_stage:
            return (
                f"the checkpoint has ZeRO stage {_zero_stage(saved)}, this run ZeRO stage "
                f"{self.zero_stage}"
            )
        if self.sharded_optimizer and saved.strategy.data_parallel != self.dp_size:
            return (
                f"the checkpoint's optimizer shards are for {saved.strategy.data_parallel} "
                f"replicas, this run has {self.dp_size}"
            )
        return None

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Weights under the model's names into this stage, and into ZeRO-1's fp32 master
        copy if it keeps one."""
        stage = self._stage()
        held = stage.state_dict(keep_vars=True)
        stage.load_state_dict({name: weights[name] for name in held})
        for name, value in held.items():
            if hasattr(value, "_hp_mapping"):
                safe_set_full_fp32_param(value, weights[name].to(self.ctx.device))

    def _load_optimizer(self, checkpoint: Checkpoint) -> None:
        optimizer = self.engine.optimizer
        if not self.sharded_optimizer:
            optimizer.load_state_dict(checkpoint.load(rank_file("optimizer", self.pp_rank)))
            return
        shard = checkpoint.load(rank_file("optimizer", self.ctx.rank))
        shard["loss_scaler"] = optimizer.loss_scaler
        shards: list[dict[str, Any] | None] = [None] * self.dp_size
        shards[self.dp_rank] = shard  # ZeRO reads its own data-parallel rank's entry
        optimizer.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=True)

    def model_state_bytes(self) -> dict[str, int]:
        optimizer = self.engine.optimizer
        if self.sharded_optimizer:
            state = [*master_partitions(optimizer), *tensors_in(optimizer.optimizer.state)]
        else:
            state = tensors_in(optimizer.state)
        return {
            "params": storage_bytes(p.data for p in self._params()),
            "grads": self.probe.peak_grad_bytes if self.probe else 0,
            "optimizer": storage_bytes(state),
        }


def _flag_for_clipping(module: PipelineModule) -> None:
    """Flag the parameters DeepSpeed's fp32 clipping must count on every stage (see the
    module docstring): all but the tied copies DeepSpeed marks `ds_pipe_replicated`."""
    for p in module.parameters():
        p.model_parallel = not getattr(p, "ds_pipe_replicated", False)


def _zero_stage(cfg: JobConfig) -> int:
    """The ZeRO stage the spec's raw `deepspeed:` section asks for (0 or 1, validated)."""
    return int(cfg.deepspeed.get("zero_optimization", {}).get("stage", 0))


def _fp32_copy(master: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    source = master.reshape(value.shape) if master is not None else value
    return source.detach().float().cpu().clone()
