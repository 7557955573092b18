"""Data parallelism with torch DistributedDataParallel (gloo on CPU, NCCL on GPU).

Gradient accumulation skips the all-reduce (`no_sync`) on every micro-batch but the
last, so one optimizer step costs one all-reduce of the gradients. With a
`compression:` section, a communication hook sends the compressed gradients instead
and counts the bytes it really sent. With `strategy.expert_parallel` > 1, MoE layers'
experts are split over expert groups of ranks (`strategies/expert_parallel.py`) and
kept out of DDP's buckets.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainstack.checkpoint import Checkpoint, rank_file
from trainstack.compat import torch as torch_compat
from trainstack.compression import CompressionState, register_compression
from trainstack.compression.state import moments_on_ranks, optimizer_config
from trainstack.config import JobConfig
from trainstack.data.sharding import Batch
from trainstack.models.lora import kept_weights, load_weights
from trainstack.optim import build_optimizer, build_scheduler, scaled_lr
from trainstack.strategies.base import (
    StepOutput,
    WorkerContext,
    apply_compile,
    autocast,
    ring_allreduce_bytes,
    storage_bytes,
    tensors_in,
    to_device,
    weight_dtype,
)
from trainstack.strategies.expert_parallel import ExpertParallel
from trainstack.strategies.hierarchical import (
    HierarchicalAllReduce,
    LevelChoice,
    measure_levels,
    node_groups,
    nodes_of_ranks,
    two_levels_possible,
)
from trainstack.strategies.named_optimizer_state import (
    named_parameters,
    optimizer_order,
    restore_optimizer_by_name,
)
from trainstack.tasks import EvalSums, build_task, eval_mode, evaluate, held_parameters


class DDPStrategy:
    name = "ddp"

    def __init__(self, cfg: JobConfig, ctx: WorkerContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.model: nn.Module = nn.Identity()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._peak_grad_bytes = 0
        self.compression: CompressionState | None = None
        self.task = build_task(cfg)
        self.experts: ExpertParallel | None = None
        self.hierarchy: HierarchicalAllReduce | None = None
        self.levels: LevelChoice | None = None
        """What `allreduce: auto` measured and chose (None: it did not need to)."""
        self._steps = 0  # this run's steps on this rank (resumed: since the resume)
        self._expert_params: list[nn.Parameter] = []
        self._dense_params: list[nn.Parameter] = []

    def setup(self, model: nn.Module) -> None:
        model.to(self.ctx.device)
        apply_compile(self.cfg, model)
        experts = self._split_experts(model) if self.cfg.strategy.expert_parallel > 1 else []
        if self.ctx.is_distributed:
            device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
            with torch_compat.hidden_from_ddp(model, experts):
                model = DistributedDataParallel(
                    model,
                    device_ids=device_ids,
                    bucket_cap_mb=self.cfg.strategy.bucket_cap_mb,
                    gradient_as_bucket_view=self.cfg.strategy.gradient_as_bucket_view,
                )
        if isinstance(model, DistributedDataParallel) and self.cfg.strategy.allreduce != "flat":
            self._choose_levels(model)
            if self.hierarchy is not None:
                model.register_comm_hook(None, self.hierarchy.communicate)
        self.compression = register_compression(
            model,
            self.cfg.compression,
            world_size=self.ctx.world_size,
            seed=self.cfg.train.seed,
            optim=self.cfg.optim,
            across=self.hierarchy.leaders_level() if self.hierarchy is not None else None,
        )
        self.model = model
        lr = scaled_lr(self.cfg.optim, data_parallel_size=self.ctx.world_size)
        optim = optimizer_config(self.cfg, world_size=self.ctx.world_size)
        self.optimizer = build_optimizer(self.unwrapped_model(), optim, lr=lr)
        self.scheduler = build_scheduler(
            self.optimizer, self.cfg.optim, total_steps=self.cfg.train.steps
        )

    def _choose_levels(self, model: nn.Module) -> None:
        """`strategy.allreduce` hierarchical, or auto where two levels are possible and
        model faster on the measured links: set `hierarchy` (collectives on every rank)."""
        choice = self.cfg.strategy.allreduce
        nodes = nodes_of_ranks(self.ctx.node)
        if not two_levels_possible(choice, nodes):
            return
        groups = node_groups(nodes, self.ctx.rank)
        if choice == "auto":
            grads = [p for p in model.parameters() if p.requires_grad]
            grad_bytes = sum(p.numel() * p.element_size() for p in grads)
            self.levels = measure_levels(groups, grad_bytes=grad_bytes, device=self.ctx.device)
            if not self.levels.hierarchical:
                return
        self.hierarchy = HierarchicalAllReduce(
            groups,
            world_size=self.ctx.world_size,
            compressed=self.cfg.compression.kind != "none",
        )

    def _split_experts(self, model: nn.Module) -> list[str]:
        """Keep this rank's experts; their names, which DDP is to leave alone (their
        gradients are reduced apart)."""
        self.experts = ExpertParallel(
            size=self.cfg.strategy.expert_parallel,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
        )
        names = self.experts.shard(model)
        params = dict(model.named_parameters())
        self._expert_params = [params[name] for name in names]
        experts = set(names)
        self._dense_params = [p for name, p in params.items() if name not in experts]
        return names

    def place_reference(self, reference: nn.Module) -> nn.Module:
        """DPO's frozen reference on this rank's device, whole, as the policy is
        (`PlacesReference`); no gradients, so nothing for DDP to reduce."""
        return reference.to(self.ctx.device)

    def unwrapped_model(self) -> nn.Module:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.module
        return self.model

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        started = time.perf_counter()
        accum = len(micro_batches)
        total = torch.zeros((), device=self.ctx.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = to_device(
                (x, y),
                self.ctx.device,
                pin_memory=self.cfg.train.pin_memory,
                dtype=self.task.input_dtype,
            )
            last = i == accum - 1
            skip_sync = isinstance(self.model, DistributedDataParallel) and not last
            with self.model.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
                with autocast(self.cfg, self.ctx.device):
                    loss = self.task.loss(self.task.outputs(self.model, x, y), y, inputs=x)
                (loss / accum).backward()
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self._peak_grad_bytes = max(self._peak_grad_bytes, storage_bytes(grads))
            total += loss.detach()
        max_norm = self.cfg.optim.grad_clip or float("inf")
        if moments_on_ranks(self.cfg, world_size=self.ctx.world_size):
            max_norm = float("inf")  # the hook sent updates, from gradients clipped on each rank
        if self.experts is not None:
            self.experts.reduce_gradients(self._expert_params)
            grad_norm = self.experts.clip_grad_norm(
                self._dense_params, self._expert_params, max_norm
            )
        else:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        assert self.compression is not None
        stats = self.compression.stats  # what the hook sent in this step's backward
        loss = total / accum
        events = self.compression.after_step(step_s=time.perf_counter() - started, loss=loss)
        return StepOutput(
            loss=loss,
            grad_norm=float(grad_norm),
            lr=lr,
            bytes_on_wire=stats.bytes_sent,
            compression_ratio=stats.ratio,
            events=events,
        )

    def evaluate(self, batches: list[Batch]) -> EvalSums:
        model = self.unwrapped_model()
        restore = eval_mode([model])

        def forward(x: torch.Tensor) -> Any:
            with autocast(self.cfg, self.ctx.device):
                outputs = self.task.eval_outputs(model, x)
            return outputs if len(x) else None  # an empty lockstep batch adds nothing

        if self.experts is not None:  # as many forwards on every rank of an expert group
            most = self.experts.steps_in_lockstep(len(batches), device=self.ctx.device)
            if batches:
                empty = (batches[0][0][:0], batches[0][1][:0])
                batches = [*batches, *[empty] * (most - len(batches))]
            elif most:
                raise RuntimeError("expert parallelism: a rank with no held-out share")
        sums = evaluate(self.task, forward, batches, device=self.ctx.device)
        restore()
        if self.ctx.is_distributed:
            dist.all_reduce(sums)
        return EvalSums.of(sums)

    def global_mean(self, value: torch.Tensor) -> float:
        value = value.detach().to(self.ctx.device, torch.float64).clone()
        if self.ctx.is_distributed:
            dist.all_reduce(value)
        return float(value) / self.ctx.world_size

    def comm_bytes_per_step(self) -> int:
        if self.cfg.compression.kind != "none":
            assert self.compression is not None, "setup() first"
            return self.compression.stats.wire_bytes(self.ctx.world_size)
        params = [p for p in self.unwrapped_model().parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        element = weight_dtype(self.cfg).itemsize  # gradients travel in the weights' dtype
        return ring_allreduce_bytes(numel, element_size=element, world_size=self.ctx.world_size)

    def layout_notes(self) -> list[str]:
        """How gradients travel, when compressed or reduced node by node."""
        c = self.cfg.compression
        chosen = [self.levels.describe()] if self.levels is not None else []
        if self.hierarchy is not None and c.kind == "none":
            return [*chosen, self.hierarchy.describe()]
        if c.kind == "none" or not self.ctx.is_distributed:
            return chosen
        parts = [f"compression: {c.kind}"]
        if self.hierarchy is not None:
            parts = [self.hierarchy.describe(), f"compression across nodes: {c.kind}"]
        if moments_on_ranks(self.cfg, world_size=self.ctx.world_size):
            parts.append(f"{self.cfg.optim.kind} moments on each rank (momentum correction)")
        if c.warmup_steps:
            parts.append(f"warm-up {c.warmup_steps} steps")
        return [*chosen, ", ".join(parts)]

    def run_metrics(self) -> dict[str, Any]:
        """Bytes over the whole run (warm-up included) and the run's compression ratio;
        under `kind: auto`, the link its controller modelled (`compression_link`)."""
        metrics: dict[str, Any] = {}
        if self.levels is not None:
            metrics["allreduce_auto"] = self.levels.figures()
        if self.hierarchy is not None:
            sent = self.hierarchy.cross_node_bytes / max(1, self._steps)
            metrics["cross_node_bytes_per_step"] = sent  # rank 0 leads its node
        if self.compression is None or self.cfg.compression.kind == "none":
            return metrics
        total, hook = self.compression.total, self.compression.hook
        metrics.update(
            bytes_on_wire_run=total.bytes_sent,
            compression_ratio_run=total.ratio,
            codec_s_per_step=hook.codec_seconds_per_step if hook is not None else 0.0,
        )
        adaptive = getattr(hook, "adaptive", None)
        if adaptive is not None:
            metrics["compression_link"] = adaptive.link_figures()
        return metrics

    def checkpoint_files(self) -> dict[str, Any]:
        """Replicas are identical, so rank 0 writes the model and optimizer; compression
        residuals differ per rank, so every rank writes its own."""
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        assert self.compression is not None, "setup() first"
        files: dict[str, Any] = {}
        model = self.unwrapped_model()
        if self.experts is not None:  # whole experts, gathered from each group (collectives)
            weights = self.experts.full_state_dict(model)
            optimizer = self.experts.full_optimizer_state(model, self.optimizer)
        else:
            weights, optimizer = model.state_dict(), self.optimizer.state_dict()
        if self.ctx.rank == 0:
            files["model.pt"] = kept_weights(self.cfg.model, weights)
            files["optimizer.pt"] = optimizer
            files["scheduler.pt"] = self.scheduler.state_dict()
        if self.cfg.compression.kind != "none":
            files[rank_file("compression", self.ctx.rank)] = self.compression.state_dict()
        return files

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        model = self.unwrapped_model()
        weights = checkpoint.full_weights()
        if self.experts is not None:
            weights = self.experts.local_state_dict(model, weights)
        load_weights(model, weights, cfg=self.cfg.model)
        notes = self._load_compression(checkpoint)
        if checkpoint.manifest.get("strategy") != self.name:  # another layout's, by name
            return notes + restore_optimizer_by_name(
                checkpoint,
                self.optimizer,
                self.scheduler,
                named_parameters(model),
                order=optimizer_order(model, self.cfg.optim),
            )
        saved = checkpoint.load("optimizer.pt")
        if self.experts is not None:
            saved = self.experts.local_optimizer_state(model, self.optimizer, saved)
        self.optimizer.load_state_dict(saved)
        self.scheduler.load_state_dict(checkpoint.load("scheduler.pt"))
        return notes

    def _load_compression(self, checkpoint: Checkpoint) -> list[str]:
        assert self.compression is not None, "setup() first"
        if self.cfg.compression.kind == "none":
            return []
        name = rank_file("compression", self.ctx.rank)
        saved_world = checkpoint.manifest["world"]["world_size"]
        if saved_world != self.ctx.world_size or not checkpoint.has(name):
            return ["compression residuals re-initialised (none saved for this rank and layout)"]
        state = checkpoint.load(name)
        if state["kind"] != self.cfg.compression.kind:
            return [f"compression state re-initialised (the checkpoint used {state['kind']})"]
        self.compression.load_state_dict(state)
        return []

    def model_state_bytes(self) -> dict[str, int]:
        """Replicated on every rank: parameters, gradients (the most held after any
        backward pass) and the optimizer's state (AdamW: exp_avg, exp_avg_sq, step)."""
        assert self.optimizer is not None, "setup() first"
        params = [p.data for p in held_parameters(self.unwrapped_model())]  # DPO's reference
        return {
            "params": storage_bytes(params),
            "grads": self._peak_grad_bytes,
            "optimizer": storage_bytes(tensors_in(self.optimizer.state)),
        }
