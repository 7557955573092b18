"""Pipeline parallelism on torch.distributed.pipelining, alone, × data parallel, and ×
tensor parallel.

Layout: `p = strategy.stages` pipeline ranks times `d = strategy.data_parallel`
replicas times `t = strategy.tensor_parallel` tensor-parallel ranks; global rank =
(pp_rank × d + dp_rank) × t + tp_rank, on one `[pp, dp, tp]` mesh. Each replica is a
pipeline over the ranks sharing its dp_rank; ranks sharing a pp_rank hold the same
stages and average their gradients. With t > 1 every stage's layers are tensor
parallel (tensor_parallel.py): each tp rank runs its own pipeline over its shards and
passes its share of the sequence to the same tp rank of the next stage; the gradient
steps below run on each rank's shards (a tied weight's shards are summed over the
stages, the norm adds the tp ranks' shares). With `shard_replicas` each stage is one
FSDP2 unit over the d replicas (torchtitan's pipeline → TP → FSDP order): its
parameters, gradients and optimizer state split d ways, gathered for the stage's
compute, gradients reduce-scattered once after the schedule's last micro-batch (torch's
schedules drive FSDP modules themselves), in place of step 2 below. With
`data_parallel_replicate` r > 1 as well, the replicas form r groups of d / r (HSDP):
state is split d / r ways within a group and replicated across groups, the mesh
`[pp, dp_replicate, dp_shard, tp]`.

The model is cut along its pipeline layers into p × v stages (pipeline_split.py) and
placed by the schedule's style; torch's `PipelineStage` infers the activations' shapes
from the first micro-batch. What a stage passes on is what its last layer returns: hidden
states, or with packed chat rows (`data.pack`, a Hugging Face model) the hidden states
and the rows' position ids, a tuple torch sends tensor by tensor (the position ids, an
integer tensor, take no gradient back). One step: the replica's batch goes
through the schedule as `strategy.microbatches` micro-batches, the task's loss on the
last stage; then gradients are made whole and the optimizer steps on every rank:

1. A parameter that the layers of several stages use (a GPT's tied embedding and LM
   head) has a copy on each; their gradients are summed over the stages holding them
   (what the model's backward computes for its one tensor), so the copies take the
   same update and stay equal. Ties whose stages sit on the same set of ranks share
   one all-reduce per step.
2. Gradients are averaged over the replicas with one flat all-reduce per rank: an
   explicit reduction after the schedule, because DDP or FSDP wrapped around stage
   modules is wrong or fails under several schedules. The schedule leaves the
   micro-batches' gradients summed; they are divided into their mean here too.
3. The global gradient norm (each tied parameter counted once) is summed over the
   pipeline, clipped as `clip_grad_norm_` does, and every rank steps its optimizer.

A `model.pretrained` comes with its parameters on the meta device: each rank gives
storage to its own stages only (its shards of them) and reads their tensors from the
folder, a tied copy under the name the folder saves it by (`load_pretrained`).

Activation checkpointing needs nothing here: `build_model` makes the model's blocks
recompute themselves, and the stages' deep copies keep that.

Schedules: `gpipe`, `1f1b`, `interleaved` (Interleaved1F1B), `zb_interleaved`
(InterleavedZeroBubble), `zbv` (ZBVZeroBubble) and `dualpipev` (DualPipeV).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import schedules
from torch.distributed.tensor import DTensor

from trainstack.checkpoint import Checkpoint, rank_file, stage_file
from trainstack.compat import torch as torch_compat
from trainstack.config import JobConfig, config_from_dict
from trainstack.data.sharding import Batch
from trainstack.models import block_classes
from trainstack.models.lora import kept_weights
from trainstack.optim import build_optimizer, build_scheduler, scaled_lr
from trainstack.strategies.base import (
    StepOutput,
    WorkerContext,
    apply_compile,
    autocast,
    fast_forward_schedule,
    ring_allreduce_bytes,
    storage_bytes,
    tensors_in,
    to_device,
    weight_dtype,
)
from trainstack.strategies.dtensor_state import (
    load_whole,
    local_optimizer_state,
    local_part,
    optimizer_state_as_shards,
    place_like_parameters,
    whole,
)
from trainstack.strategies.mesh import (
    build_mesh,
    finish_pending_sums,
    flattened_group,
    squared_norm,
)
from trainstack.strategies.named_optimizer_state import optimizer_order, restore_optimizer_by_name
from trainstack.strategies.pipeline_probe import (
    BoundaryMeter,
    ProbedStage,
    SavedActivationMeter,
    first_replica_figures,
    simulated_bubble,
    single_stage_orders,
)
from trainstack.strategies.pipeline_split import (
    ModelNames,
    StageModule,
    TiedParameter,
    check_pipeline_model,
    last_stage_mean,
    model_layers,
    recv_activation,
    send_activation,
    split_stages,
    stage_ranks,
    tied_parameters,
)
from trainstack.strategies.pretrained_parts import materialise, place, read_pretrained
from trainstack.strategies.tensor_parallel import apply_tensor_parallel_to_layers
from trainstack.tasks import EvalSums, build_task, eval_mode, evaluate

Schedule = schedules.PipelineScheduleSingle | schedules.PipelineScheduleMulti

SCHEDULES: dict[str, tuple[Callable[..., Schedule] | None, str]] = {
    "gpipe": (schedules.ScheduleGPipe, "loop"),
    "1f1b": (schedules.Schedule1F1B, "loop"),
    "interleaved": (schedules.ScheduleInterleaved1F1B, "loop"),
    "zb_interleaved": (schedules.ScheduleInterleavedZeroBubble, "loop"),
    "zbv": (schedules.ScheduleZBVZeroBubble, "v"),
    "dualpipev": (getattr(schedules, "ScheduleDualPipeV", None), "v"),  # torch 2.9+
}
"""Schedule name -> (torch schedule class, None where this torch has none: pre-flight
refuses it, `pipeline_split.check_schedule_runs_here`; stage placement style)."""

_SINGLE_STAGE = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True)
class LocalTie:
    """A tied parameter as this rank holds it."""

    tie: TiedParameter
    copies: tuple[nn.Parameter, ...]
    """This rank's copies, one per stage of it held here."""
    ranks: tuple[int, ...]
    """The pipeline ranks holding a copy; one rank: no communication."""


class PipelineStrategy:
    name = "pipeline"

    def __init__(self, cfg: JobConfig, ctx: WorkerContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.task = build_task(cfg)
        s = cfg.strategy
        self.dims = cfg.dims
        self.at = self.dims.coords(ctx.rank)
        """This rank's pipeline rank, replica and tensor-parallel rank."""
        self.pp_size, self.dp_size = self.dims.pp, self.dims.dp
        self.pp_rank, self.dp_rank = self.at.pp, self.at.dp
        self.tp_mesh: DeviceMesh | None = None
        self.dp_mesh: DeviceMesh | None = None
        self.sharded = cfg.strategy.shard_replicas and self.dp_size > 1
        """Each stage FSDP-sharded over the replicas (else replicated, gradients averaged)."""
        self.num_stages = s.stages * cfg.pipeline_virtual_stages
        self.style = SCHEDULES[s.schedule][1]
        self.owners = stage_ranks(
            pp_size=self.pp_size, num_stages=self.num_stages, style=self.style
        )
        self.stage_ids = [i for i, r in enumerate(self.owners) if r == self.pp_rank]
        self.modules: dict[int, StageModule] = {}
        self.boundaries: dict[int, BoundaryMeter] = {}
        self.stages: list[ProbedStage] = []
        self.ties: list[LocalTie] = []
        self.tie_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._aliases: dict[str, tuple[str, ...]] = {}
        """The model's state-dict key -> every key of the same tensor (a tie has two)."""
        self._optimizer_order: list[str] = []
        """The whole model's parameter names in the order a DDP optimizer indexes them."""
        self._uncounted: set[int] = set()
        """ids of this rank's tied copies that the grad norm skips (counted elsewhere)."""
        self.schedule: Schedule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.split_description = ""
        self.lora = bool(cfg.model.lora.rank)
        """Adapters over frozen weights: checkpoints hold the adapters alone."""
        self._peak_grad_bytes = 0
        self._steps_run = 0
        self._step_s = 0.0
        self._busy_at_first_step = 0.0

    # ---- layout -------------------------------------------------------------------------

    def _build_groups(self, ties: list[TiedParameter]) -> None:
        """Every rank creates every group, in the same order (torch.distributed's rule):
        the `[pp, dp, tp]` mesh (its pipelines, replicas and tensor-parallel groups), and
        per tensor-parallel rank one group per set of pipeline ranks some tie spans."""
        d, t, r = self.dp_size, self.dims.tp, self.dims.dp_replicate
        mesh = build_mesh(self.dims, device_type=self.ctx.device.type)
        self.pp_group = mesh.get_group("pp")
        self.tp_mesh = mesh["tp"]
        # FSDP shards over dp_shard and replicates over dp_replicate (HSDP when r > 1);
        # replica averages and maxima run over both, flattened.
        self.dp_mesh = mesh["dp_replicate", "dp_shard"] if r > 1 else mesh["dp_shard"]
        self.dp_group = (
            flattened_group(mesh, ("dp_replicate", "dp_shard"))
            if r > 1
            else self.dp_mesh.get_group()
        )
        at = self.dims.rank
        for ranks in dict.fromkeys(self._tie_ranks(tie) for tie in ties):
            if len(ranks) == 1:
                continue
            for j in range(d):
                for k in range(t):
                    group = dist.new_group([at(pp=p, dp=j, tp=k) for p in ranks])
                    mine = (j, k) == (self.dp_rank, self.at.tp)
                    if mine and self.pp_rank in ranks:
                        self.tie_groups[ranks] = group

    def _tie_ranks(self, tie: TiedParameter) -> tuple[int, ...]:
        return tuple(sorted({self.owners[s] for s in tie.stages}))

    @property
    def holds_first(self) -> bool:
        return 0 in self.modules

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.modules

    # ---- setup --------------------------------------------------------------------------

    def setup(self, model: nn.Module) -> None:
        check_pipeline_model(self.cfg, model)
        self._optimizer_order = optimizer_order(model, self.cfg.optim)
        blocks = block_classes(model, class_names=self.cfg.model.checkpoint_modules)
        layers = model_layers(model)
        self._aliases = {
            key: tuple(keys) for keys in ModelNames.of(model).tensors.values() for key in keys
        }
        split = split_stages(layers, self.num_stages)
        self.split_description = split.describe()
        ties = tied_parameters(model, layers, split)
        self._build_groups(ties)
        for s in self.stage_ids:  # meta parameters (`load_pretrained`): storage once split
            self.modules[s] = place(StageModule(model, layers, split.layers[s]), self.ctx.device)
            if self.dims.tp > 1:
                assert self.tp_mesh is not None
                apply_tensor_parallel_to_layers(list(self.modules[s].layers.values()), self.tp_mesh)
            apply_compile(self.cfg, self.modules[s], classes=blocks)
            if self.sharded:
                fully_shard(self.modules[s], mesh=self.dp_mesh, reshard_after_forward=False)
            materialise(self.modules[s], self.ctx.device)
            self.boundaries[s] = BoundaryMeter(self.modules[s])
        self._hold_ties(ties)
        params = {
            local_part(p).untyped_storage().data_ptr() for p in self.unwrapped_model().parameters()
        }
        self.stages = [
            ProbedStage(
                module,
                s,
                self.num_stages,
                self.ctx.device,
                group=self.pp_group,
                meter=SavedActivationMeter(exclude=params),
            )
            for s, module in self.modules.items()
        ]
        schedule_class = SCHEDULES[self.cfg.strategy.schedule][0]
        assert schedule_class is not None, "pre-flight refuses a schedule torch lacks"
        first = self.stages[0] if self.cfg.strategy.schedule in _SINGLE_STAGE else self.stages
        self.schedule = schedule_class(
            first,
            n_microbatches=self.cfg.strategy.microbatches,
            loss_fn=self.task.pipeline_loss,
            scale_grads=False,  # train_step averages them, once whole
        )
        lr = scaled_lr(self.cfg.optim, data_parallel_size=self.dp_size)
        self.optimizer = build_optimizer(self.unwrapped_model(), self.cfg.optim, lr=lr)
        self.scheduler = build_scheduler(
            self.optimizer, self.cfg.optim, total_steps=self.cfg.train.steps
        )

    def _hold_ties(self, ties: list[TiedParameter]) -> None:
        """This rank's copies of each tied parameter; all but the first stage's copy are
        left out of the grad norm."""
        for tie in ties:
            copies = [
                self.modules[s].parameter(layer=layer, name=name)
                for s, (layer, name) in zip(tie.stages, tie.uses, strict=True)
                if s in self.modules
            ]
            if not copies or not copies[0].requires_grad:  # none here, or frozen (LoRA)
                continue
            self.ties.append(LocalTie(tie=tie, copies=tuple(copies), ranks=self._tie_ranks(tie)))
            counted = tie.stages[0] in self.modules
            self._uncounted.update(id(c) for c in copies[1 if counted else 0 :])

    def load_pretrained(self, folder: str) -> None:
        """Each rank reads its stages' tensors (its shards of them), a tied one under
        whichever of its names the folder saves (`LoadsPretrainedParts`)."""
        stages = [self.modules[s] for s in self.stage_ids]
        read_pretrained(stages, folder, aliases=self._aliases)

    def unwrapped_model(self) -> nn.Module:
        """This rank's stages (the full model's names; merge stage files for the whole)."""
        return nn.ModuleList(self.modules[s] for s in self.stage_ids)

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.unwrapped_model().parameters() if p.requires_grad]

    # ---- training -----------------------------------------------------------------------

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        assert self.schedule is not None and self.optimizer is not None, "setup() first"
        assert self.scheduler is not None
        x, y = to_device(
            (torch.cat([b[0] for b in micro_batches]), torch.cat([b[1] for b in micro_batches])),
            self.ctx.device,
            pin_memory=self.cfg.train.pin_memory,
            dtype=self.task.input_dtype,
        )
        args = (x,) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        with autocast(self.cfg, self.ctx.device):
            self.schedule.step(*args, target=y if self.holds_last else None, losses=losses)
        self._record_step_time(time.perf_counter() - start)
        place_like_parameters(self._params())
        grads = [local_part(p.grad) for p in self._params() if p.grad is not None]
        self._peak_grad_bytes = max(self._peak_grad_bytes, storage_bytes(grads))
        self._sum_tied_gradients()
        self._average_over_replicas()
        finish_pending_sums(self._params())
        self._average_over_microbatches()
        grad_norm = self._clip_gradients()
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        return StepOutput(loss=loss, grad_norm=grad_norm, lr=lr)

    def _record_step_time(self, seconds: float) -> None:
        """Step time after the first step (which also infers shapes and warms up)."""
        self._steps_run += 1
        if self._steps_run == 1:
            self._busy_at_first_step = sum(stage.busy_s for stage in self.stages)
        else:
            self._step_s += seconds

    def _sum_tied_gradients(self) -> None:
        """Each tied parameter's gradient summed over its copies: first on this rank, then
        over the ranks holding it, one flat all-reduce per set of ranks."""
        pending: dict[tuple[int, ...], list[tuple[LocalTie, torch.Tensor]]] = {}
        for local in self.ties:
            total = sum((_grad_of(c) for c in local.copies[1:]), _grad_of(local.copies[0]))
            if len(local.ranks) == 1:
                _set_grads(local.copies, total)
            else:
                pending.setdefault(local.ranks, []).append((local, total))
        for ranks, items in pending.items():
            flat = torch.cat([total.reshape(-1) for _, total in items])
            dist.all_reduce(flat, group=self.tie_groups[ranks])
            offset = 0
            for local, total in items:
                _set_grads(local.copies, flat[offset : offset + total.numel()].view_as(total))
                offset += total.numel()

    def _average_over_replicas(self) -> None:
        if self.dp_size == 1 or self.sharded:  # FSDP reduce-scattered them already
            return
        grads = [local_part(p.grad) for p in self._params() if p.grad is not None]
        if not grads:  # a stage of frozen weights alone (LoRA), on every replica alike
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _average_over_microbatches(self) -> None:
        """The schedule sums the micro-batches' gradients; their mean, taken on each
        rank's part once no gradient is a pending sum (torch 2.10's schedule divided a
        pending sum in place, which its DTensor refuses)."""
        for p in self._params():
            if p.grad is not None:
                local_part(p.grad).div_(self.cfg.strategy.microbatches)

    def _clip_gradients(self) -> float:
        """Clip by the norm of the whole model's gradient, as `clip_grad_norm_` would: a
        tie counts once, a sharded gradient (tensor parallel, FSDP) adds every shard."""
        counted = [
            p.grad for p in self._params() if p.grad is not None and id(p) not in self._uncounted
        ]
        if any(isinstance(g, DTensor) for g in counted):
            squares = torch.tensor(
                squared_norm(counted), dtype=torch.float64, device=self.ctx.device
            )
        else:
            squares = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
            for grad in counted:
                squares += grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()
        if self.cfg.optim.grad_clip:
            coef = torch.clamp(self.cfg.optim.grad_clip / (norm + 1e-6), max=1.0)
            for p in self._params():
                if p.grad is not None:
                    local_part(p.grad).mul_(coef)
        return float(norm)

    # ---- evaluation and reductions ------------------------------------------------------

    def evaluate(self, batches: list[Batch]) -> EvalSums:
        """Each batch goes through the stages in order, activations passed point to point
        (shapes first: held-out batches may differ from training's); the last stage's
        ranks add up the task's sums, and every rank gets the total."""
        restore = eval_mode(self.modules.values())
        with autocast(self.cfg, self.ctx.device):
            sums = evaluate(self.task, self._eval_forward, batches, device=self.ctx.device)
            self._match_replicas_forwards(len(batches))
        restore()
        if self.at.tp != 0:  # its tp group holds the same sums: count them once
            sums.zero_()
        dist.all_reduce(sums)
        return EvalSums.of(sums)

    def _match_replicas_forwards(self, done: int) -> None:
        """Sharded stages gather their parameters from every replica in each forward, so
        every replica runs as many as the one with the most held-out batches (shares
        differ by a sample): the others run throw-away forwards on a blank batch."""
        if not self.sharded:
            return
        most = torch.tensor(done, device=self.ctx.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
        blank = torch.zeros((1, self.cfg.model.block_size), dtype=torch.long)
        with torch.no_grad():
            for _ in range(int(most) - done):
                self._eval_forward(blank.to(self.ctx.device))
        for module in self.modules.values():  # forwards alone leave them gathered
            assert isinstance(module, FSDPModule)
            module.reshard()

    def _eval_forward(self, x: torch.Tensor) -> Any | None:
        """The model's outputs on the rank holding the last stage; None on the others."""
        act: Any = x
        for s in self.stage_ids:
            if s > 0 and self.owners[s - 1] != self.pp_rank:
                src = self.dims.rank(pp=self.owners[s - 1], dp=self.dp_rank, tp=self.at.tp)
                act = recv_activation(src=src, device=self.ctx.device)
            act = self.modules[s](act)
            if s < self.num_stages - 1 and self.owners[s + 1] != self.pp_rank:
                send_activation(
                    act, dst=self.dims.rank(pp=self.owners[s + 1], dp=self.dp_rank, tp=self.at.tp)
                )
        return act if self.holds_last else None

    def global_mean(self, value: torch.Tensor) -> float:
        counted = self.holds_last and self.at.tp == 0  # one rank per tp group
        return last_stage_mean(value, holds_last=counted, replicas=self.dp_size)

    def comm_bytes_per_step(self) -> int:
        """Modelled: activations out and their gradients back across every stage boundary
        between ranks (their sizes as measured in the last training forward), the
        gradient all-reduce over replicas, and the tied parameters' all-reduces."""
        activations = 0
        for s in self.stage_ids:
            if s < self.num_stages - 1 and self.owners[s + 1] != self.pp_rank:
                activations += self.boundaries[s].output_bytes
            if s > 0 and self.owners[s - 1] != self.pp_rank:
                activations += self.boundaries[s].input_grad_bytes
        numel = sum(local_part(p).numel() for p in self._params())
        element = weight_dtype(self.cfg).itemsize  # gradients travel in the weights' dtype
        replicas = ring_allreduce_bytes(numel, element_size=element, world_size=self.dp_size)
        tied = sum(
            ring_allreduce_bytes(local.tie.numel, element_size=element, world_size=len(local.ranks))
            for local in self.ties
        )
        return self.cfg.strategy.microbatches * activations + replicas + tied

    def layout_notes(self) -> list[str]:
        s = self.cfg.strategy
        tp = f" × tensor parallel {self.dims.tp}" if self.dims.tp > 1 else ""
        return [
            f"pipeline ({s.engine}, {s.schedule}): {self.pp_size} ranks × {self.dp_size} "
            f"replicas{tp}, {self.num_stages} stages, {s.microbatches} micro-batches per step",
            self.split_description,
        ]

    def run_metrics(self) -> dict[str, Any]:
        """Bubble and activation memory of every rank and stage (a collective)."""
        busy = sum(stage.busy_s for stage in self.stages) - self._busy_at_first_step
        mine = {
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "tp_rank": self.at.tp,
            "busy_s": busy,
            "step_s": self._step_s,
            "activation_peak_bytes": {s.stage_index: s.meter.peak_bytes for s in self.stages},
        }
        replica0, bubbles = first_replica_figures(mine, world_size=self.ctx.world_size)
        peaks: dict[int, int] = {}
        for r in replica0:
            peaks.update(r["activation_peak_bytes"])
        return {
            "pipeline": {
                "engine": "torch",
                "schedule": self.cfg.strategy.schedule,
                "stages": self.num_stages,
                "split": self.split_description,
                "bubble_fraction": sum(bubbles) / len(bubbles),
                "ideal_bubble_fraction": self.ideal_bubble_fraction(),
                "bubble_fraction_per_rank": bubbles,
                "activation_peak_bytes_per_stage": [peaks[s] for s in sorted(peaks)],
            }
        }

    def ideal_bubble_fraction(self) -> float:
        """The schedule's bubble with equal stages, free communication and a backward
        costing two forwards (pipeline_probe.simulated_bubble)."""
        s = self.cfg.strategy
        if s.schedule in _SINGLE_STAGE:
            orders = single_stage_orders(
                s.schedule, pp_size=self.pp_size, microbatches=s.microbatches
            )
        else:
            plan = torch_compat.schedule_compute_actions(self.schedule)
            if plan is None:
                return math.nan
            orders = plan
        return simulated_bubble(orders, num_stages=self.num_stages)

    # ---- state --------------------------------------------------------------------------

    def checkpoint_files(self) -> dict[str, Any]:
        """Replica 0's ranks write their stages' whole weights (tp rank 0, once its tp
        group has gathered them) and their optimizer state (each tp rank its shards);
        rank 0 the LR schedule. Replicas are identical, so the others write nothing."""
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        if self.dp_rank != 0 and not self.sharded:
            return {}
        stages = {  # with model.lora the adapters alone (`kept_weights`)
            s: kept_weights(self.cfg.model, whole(self.modules[s].state_dict()))
            for s in self.stage_ids
        }
        files: dict[str, Any] = {}
        if self.at.tp == 0 and self.dp_rank == 0:
            files = {stage_file(s): state for s, state in stages.items()}
        files[self._optimizer_file()] = local_optimizer_state(self.optimizer.state_dict())
        if self.ctx.rank == 0:
            files["scheduler.pt"] = self.scheduler.state_dict()
        return files

    def _optimizer_file(self) -> str:
        """Replicas hold the same optimizer state, shards (`shard_replicas`) their own."""
        if self.sharded:
            return rank_file("optimizer", self.ctx.rank)
        return rank_file("optimizer", self.pp_rank * self.dims.tp + self.at.tp)

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        reason = self._why_not_exact(checkpoint)
        if reason is None:
            for s in self.stage_ids:
                load_whole(self.modules[s], checkpoint.load(stage_file(s)), lora=self.lora)
            state = checkpoint.load(self._optimizer_file())
            self.optimizer.load_state_dict(optimizer_state_as_shards(state, self.optimizer))
            self.scheduler.load_state_dict(checkpoint.load("scheduler.pt"))
            return []
        full = checkpoint.full_weights()  # with model.lora the adapters alone
        for module in self.modules.values():
            mine = [name for name in module.state_dict() if name in full or not self.lora]
            load_whole(module, {name: full[name] for name in mine}, lora=self.lora)
        if checkpoint.manifest.get("strategy") == self.name:  # its ranks' files do not fit
            fast_forward_schedule(self.scheduler, step=checkpoint.step)
            return [f"optimizer state re-initialised ({reason})"]
        params = []  # this rank's parameters, each with every model name of its tensor
        for module in self.modules.values():
            own = dict(module.named_parameters())
            for key, names in module.model_names.items():
                if key in own:
                    aliases = (n for name in names for n in self._aliases.get(name, (name,)))
                    params.append((own[key], tuple(dict.fromkeys(aliases))))
        return restore_optimizer_by_name(
            checkpoint, self.optimizer, self.scheduler, params, order=self._optimizer_order
        )

    def _why_not_exact(self, checkpoint: Checkpoint) -> str | None:
        """Why the checkpoint's stage files and optimizer state do not fit this layout."""
        source = checkpoint.manifest.get("strategy")
        if source != self.name:
            return f"the checkpoint is from {source}"
        saved = config_from_dict(checkpoint.manifest["spec"])
        saved_sharded = saved.strategy.shard_replicas and saved.strategy.data_parallel > 1
        saved_replicas = (saved.strategy.data_parallel, saved.strategy.data_parallel_replicate)
        replicas = (self.dp_size, self.cfg.strategy.data_parallel_replicate)
        if (saved_sharded, saved_replicas) != (self.sharded, replicas) and (
            saved_sharded or self.sharded
        ):
            return "the checkpoint's optimizer state is sharded over other replicas"
        if saved.strategy.tensor_parallel != self.dims.tp:
            return (
                f"the checkpoint's stages are split {saved.strategy.tensor_parallel}-way "
                f"tensor parallel, this run's {self.dims.tp}-way"
            )
        layout = (saved.strategy.stages, saved.pipeline_virtual_stages)
        mine = (self.pp_size, self.cfg.pipeline_virtual_stages)
        if layout != mine or SCHEDULES[saved.strategy.schedule][1] != self.style:
            return (
                f"the checkpoint has {layout[0]} pipeline ranks × {layout[1]} stages placed "
                f"{SCHEDULES[saved.strategy.schedule][1]}-style, this run {mine[0]} × {mine[1]} "
                f"{self.style}-style"
            )
        if saved.strategy.engine != self.cfg.strategy.engine:
            return f"the checkpoint is from the {saved.strategy.engine} engine"
        return None

    def model_state_bytes(self) -> dict[str, int]:
        assert self.optimizer is not None, "setup() first"
        held = self.unwrapped_model().parameters()  # frozen ones (LoRA's base) too
        return {
            "params": storage_bytes(local_part(p.data) for p in held),
            "grads": self._peak_grad_bytes,
            "optimizer": storage_bytes(local_part(t) for t in tensors_in(self.optimizer.state)),
        }


def _grad_of(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of `param`'s gradient (zeros if it has none)."""
    return local_part(param.grad) if param.grad is not None else torch.zeros_like(local_part(param))


def _set_grads(copies: tuple[nn.Parameter, ...], total: torch.Tensor) -> None:
    """Give every copy the gradient `total` (this rank's part of it)."""
    for c in copies:
        if c.grad is None:
            grad = total.clone()
            if isinstance(c, DTensor):
                c.grad = DTensor.from_local(
                    grad, c.device_mesh, c.placements, shape=c.shape, stride=c.stride()
                )
            else:
                c.grad = grad
        else:
            local_part(c.grad).copy_(total)
