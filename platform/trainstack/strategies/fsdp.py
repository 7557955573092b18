"""FSDP2 with tensor parallelism on one device mesh (`strategy.kind: fsdp`).

Applied in torchtitan's order: tensor parallelism over `tp` (tensor_parallel.py), then
activation checkpointing (`build_model` already made the blocks recompute), then
`fully_shard` on every repeated block and on the root, over `dp_shard` (or the 2D
`[dp_replicate, dp_shard]` mesh: HSDP). FSDP2 all-gathers a block's parameters before
its forward (again before its backward when `reshard_after_forward`) and
reduce-scatters its gradients; HSDP adds an all-reduce of the shards over the replicas.

One step: micro-batches accumulate with gradient sync off until the last; the global
gradient norm is taken over the DTensor gradients wherever their shards lie; the
optimizer steps on each rank's shards. Checkpoints hold the model and optimizer as
sharded DCP state (`checkpoint/sharded.py`), which any mesh (and, through full weights,
any other strategy) loads. A `model.pretrained` comes with its parameters on the meta
device: each rank gives storage to its own shards only and reads them from the folder
(`load_pretrained`, strategies/pretrained_parts.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainstack.checkpoint import SHARDED_FOLDER, Checkpoint, sharded
from trainstack.config import JobConfig
from trainstack.data.sharding import Batch
from trainstack.kinds import model_kind_of
from trainstack.models import repeated_blocks
from trainstack.models.hf import HFCausalLM
from trainstack.models.lora import kept_weights
from trainstack.optim import build_optimizer, build_scheduler, scaled_lr
from trainstack.strategies.base import (
    StepOutput,
    WorkerContext,
    apply_compile,
    autocast,
    storage_bytes,
    tensors_in,
    to_device,
    weight_dtype,
)
from trainstack.strategies.comm_count import CollectiveBytes
from trainstack.strategies.context_parallel import (
    ContextParallel,
    context_parallel_groups,
    use_ring_attention,
)
from trainstack.strategies.dtensor_state import local_part
from trainstack.strategies.mesh import Meshes, build_meshes, finish_pending_sums, squared_norm
from trainstack.strategies.named_optimizer_state import (
    named_parameters,
    optimizer_order,
    restore_optimizer_by_name,
)
from trainstack.strategies.pretrained_parts import materialise, place, read_pretrained
from trainstack.strategies.tensor_parallel import apply_tensor_parallel
from trainstack.tasks import EvalSums, build_task, eval_mode, evaluate, held_parameters


class FSDPStrategy:
    name = "fsdp"

    def __init__(self, cfg: JobConfig, ctx: WorkerContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.layout = cfg.dims
        self.meshes: Meshes | None = None
        self.model: nn.Module = nn.Identity()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.task = build_task(cfg)
        self._peak_grad_bytes = 0
        self._tp_local_numel = 0
        self._counted_bytes: int | None = None
        """Bytes this rank sent in its first step, counted from its collectives."""
        self.context: ContextParallel | None = None
        """`strategy.context_parallel` > 1: this rank's share of every row's tokens."""

    # ---- set-up ------------------------------------------------------------------

    def setup(self, model: nn.Module) -> None:
        """Tensor parallel, compile and FSDP as above; a model with meta parameters (a
        pretrained one, `load_pretrained` fills it) gets storage for this rank's shards
        only, once sharded."""
        place(model, self.ctx.device)
        if self.ctx.is_distributed:
            self.meshes = build_meshes(self.layout, device_type=self.ctx.device.type)
            if self.layout.tp > 1:
                apply_tensor_parallel(
                    model, self.meshes.tp, loss_parallel=self._vocabulary_sharded()
                )
            self._tp_local_numel = sum(local_part(p).numel() for p in model.parameters())
            if self.layout.cp > 1:
                hf = isinstance(model, HFCausalLM)
                if hf:
                    use_ring_attention(model.hf)
                self.context = ContextParallel(
                    context_parallel_groups(self.layout),
                    seq_len=self.cfg.model.block_size,
                    positions_in_inputs=hf,
                )
            apply_compile(self.cfg, model)  # torchtitan's order: TP, (AC,) compile, FSDP
            if self._sharded_ranks() > 1:
                self._shard(model, self.meshes)
        else:
            self._tp_local_numel = sum(p.numel() for p in model.parameters())
            apply_compile(self.cfg, model)
        sharded = self.ctx.is_distributed and self._sharded_ranks() > 1
        offloaded = sharded and self.cfg.strategy.offload_param == "cpu"
        materialise(model, torch.device("cpu") if offloaded else self.ctx.device)
        self.model = model
        lr = scaled_lr(self.cfg.optim, data_parallel_size=self.layout.dp)
        self.optimizer = build_optimizer(model, self.cfg.optim, lr=lr)
        self.scheduler = build_scheduler(
            self.optimizer, self.cfg.optim, total_steps=self.cfg.train.steps
        )

    def _sharded_ranks(self) -> int:
        """The ranks FSDP shards over: every data-parallel one, and under context
        parallelism every context-parallel one too (their gradients are averaged alike)."""
        return self.layout.dp * self.layout.cp

    def _shard(self, model: nn.Module, meshes: Meshes) -> None:
        """fully_shard each repeated block, then the root (what the blocks leave)."""
        s = self.cfg.strategy
        bf16 = self.cfg.train.precision == "bf16"
        options: dict[str, Any] = {
            "mesh": meshes.fsdp,
            "reshard_after_forward": s.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                # bf16 compute reduces in fp32; otherwise in the weights' own dtype
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=torch.float32 if bf16 else None,
            ),
            "offload_policy": CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
            if s.offload_param == "cpu"
            else OffloadPolicy(),
        }
        for unit in sharding_units(model, class_names=self.cfg.model.checkpoint_modules):
            fully_shard(unit, **options)
        fully_shard(model, **options)

    def load_pretrained(self, folder: str) -> None:
        """Each rank reads its own shard of every saved tensor (`LoadsPretrainedParts`)."""
        read_pretrained([self.model], folder)

    def place_reference(self, reference: nn.Module) -> nn.Module:
        """DPO's frozen reference sharded over the same mesh as the policy, block by block
        (`PlacesReference`): each rank holds 1/dp of it, gathered for its forward."""
        place(reference, self.ctx.device)
        sharded = self.ctx.is_distributed and self._sharded_ranks() > 1
        if sharded:
            assert self.meshes is not None, "setup() first"
            self._shard(reference, self.meshes)
        offloaded = sharded and self.cfg.strategy.offload_param == "cpu"
        materialise(reference, torch.device("cpu") if offloaded else self.ctx.device)
        return reference

    def unwrapped_model(self) -> nn.Module:
        """The model itself: FSDP2 and tensor parallelism shard it in place (its parameters
        are DTensors; `checkpoint_files` saves them whole through DCP)."""
        return self.model

    # ---- training ----------------------------------------------------------------

    def _vocabulary_sharded(self) -> bool:
        """`strategy.loss_parallel`, except for DPO, whose log-probabilities of the answers
        are taken on whole logits."""
        return self.cfg.strategy.loss_parallel and self.cfg.task.kind != "dpo"

    def _uses_loss_parallel(self) -> bool:
        return self.layout.tp > 1 and self.ctx.is_distributed and self._vocabulary_sharded()

    def _compute_context(self) -> contextlib.ExitStack:
        """loss_parallel (vocabulary-sharded cross-entropy) and bf16 autocast where FSDP's
        mixed-precision policy does not already cast."""
        stack = contextlib.ExitStack()
        if self.context is not None:  # the forward and backward of this rank's tokens
            stack.enter_context(self.context.shard(self.ctx.device))
        if self._uses_loss_parallel():
            stack.enter_context(loss_parallel())
        sharded_by_fsdp = isinstance(self.model, FSDPModule)
        if not sharded_by_fsdp:
            stack.enter_context(autocast(self.cfg, self.ctx.device))
        return stack

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        """One step; the first one also counts the bytes its collectives send (every step
        of a layout sends the same, and counting sees every operator: once is enough)."""
        if self._counted_bytes is not None or not self.ctx.is_distributed:
            return self._step(micro_batches)
        with CollectiveBytes() as counter:
            out = self._step(micro_batches)
        # a torch that cannot count them: the modelled bytes, once
        self._counted_bytes = counter.sent if counter.counting else self._modelled_comm_bytes()
        return out

    def _step(self, micro_batches: list[Batch]) -> StepOutput:
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        accum = len(micro_batches)
        total = torch.zeros((), device=self.ctx.device)
        for i, (x, y) in enumerate(micro_batches):
            share = 1.0
            if self.context is not None:
                x, y, share = self.context.local_with_share((x, y))
            x, y = to_device(
                (x, y),
                self.ctx.device,
                pin_memory=self.cfg.train.pin_memory,
                dtype=self.task.input_dtype,
            )
            if isinstance(self.model, FSDPModule):  # reduce gradients after the last only
                self.model.set_requires_gradient_sync(i == accum - 1)
            with self._compute_context():
                outputs = self.task.outputs(self.model, x, y)
                if share == 0:  # none of its tokens scored: no loss, no gradient of its own
                    loss = self.task.logits(outputs, y).sum() * 0.0
                else:
                    loss = self.task.loss(outputs, y, inputs=x) * share
                (loss / accum).backward()
            self._peak_grad_bytes = max(self._peak_grad_bytes, self._held_grad_bytes())
            total += local_part(loss.detach())
        finish_pending_sums(self.model.parameters())
        grad_norm = clip_grad_norm(list(self.model.parameters()), self.cfg.optim.grad_clip)
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(
            loss=total / accum, grad_norm=grad_norm, lr=lr, bytes_on_wire=self._counted_bytes
        )

    def _held_grad_bytes(self) -> int:
        grads = [local_part(p.grad) for p in self.model.parameters() if p.grad is not None]
        return storage_bytes(grads)

    # ---- evaluation and reductions -------------------------------------------------

    def evaluate(self, batches: list[Batch]) -> EvalSums:
        restore = eval_mode([self.model])

        def forward(x: torch.Tensor) -> Any:
            with self._compute_context():
                outputs = self.task.eval_outputs(self.model, x)
            # vocabulary-sharded logits (loss_parallel), alone or beside a balance loss
            # (which held-out scoring leaves out): gathered whole
            logits = getattr(outputs, "logits", outputs)
            return logits.full_tensor() if isinstance(logits, DTensor) else outputs

        if self.context is not None:
            batches = [self.context.local(batch) for batch in batches]
        sums = evaluate(self.task, forward, batches, device=self.ctx.device)
        restore()
        if self.meshes is not None:  # replicas add theirs; a tp group holds one copy
            dist.all_reduce(sums, group=self.meshes.data_parallel_group)
        return EvalSums.of(sums)

    def global_mean(self, value: torch.Tensor) -> float:
        value = local_part(value.detach()).to(self.ctx.device, torch.float64).clone()
        if self.meshes is not None:  # replicas and context-parallel ranks alike
            dist.all_reduce(value, group=self.meshes.data_parallel_group)
        return float(value) / (self.layout.dp * self.layout.cp)

    def comm_bytes_per_step(self) -> int:
        """Bytes this rank sends per step: counted from its first step's collectives
        (`comm_count.CollectiveBytes`), else modelled (ring collectives): FSDP's
        parameter all-gathers (two with `reshard_after_forward`) and gradient
        reduce-scatter over s, HSDP's all-reduce over r, and tensor parallelism's
        all-gathers and reduce-scatters of the residual stream (4 per block each way)."""
        if self._counted_bytes is not None:
            return self._counted_bytes
        return self._modelled_comm_bytes()

    def _modelled_comm_bytes(self) -> int:
        """`comm_bytes_per_step` before a step has been counted (ring collectives)."""
        layout, cfg = self.layout, self.cfg
        s, r, t = layout.dp_shard * layout.cp, layout.dp_replicate, layout.tp
        element = weight_dtype(cfg).itemsize
        param_bytes = self._tp_local_numel * element
        gathers = 2 if cfg.strategy.reshard_after_forward else 1
        fsdp = (gathers + 1) * (s - 1) * param_bytes // s
        hsdp = 2 * (r - 1) * param_bytes // (s * r)
        tp = 0
        if t > 1 and model_kind_of(cfg).shape_in_spec:  # sequence parallel activations
            stream = cfg.train.global_batch_size // layout.dp
            activation = stream * cfg.model.block_size * cfg.model.n_embd * element
            tp = 8 * cfg.model.n_layer * (t - 1) * activation // t
        return fsdp + hsdp + tp

    # ---- checkpoints -------------------------------------------------------------

    def checkpoint_files(self) -> dict[str, Any]:
        """Model and optimizer as sharded DCP state (every rank its shards); rank 0 adds
        the LR schedule."""
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=self._state_options()
        )
        model_state = kept_weights(self.cfg.model, model_state)  # a tie's alias too
        state = sharded.ShardedState({"model": model_state, "optimizer": optimizer_state})
        files: dict[str, Any] = {SHARDED_FOLDER: state}
        if self.ctx.rank == 0:
            files["scheduler.pt"] = self.scheduler.state_dict()
        return files

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        assert self.optimizer is not None and self.scheduler is not None, "setup() first"
        if not sharded.has_sharded(checkpoint, SHARDED_FOLDER):
            return self._load_full_weights(checkpoint)
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=self._state_options()
        )
        model_state = kept_weights(self.cfg.model, model_state)
        sharded.load_sharded(
            checkpoint, SHARDED_FOLDER, {"model": model_state, "optimizer": optimizer_state}
        )  # in place
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
            options=self._state_options(),
        )
        self.scheduler.load_state_dict(checkpoint.load("scheduler.pt"))
        return []

    def _state_options(self) -> StateDictOptions:
        """How DCP's state dicts take the model: with `model.lora`, the adapters alone
        (the frozen base is rebuilt from its folder or seed; the manifest names it)."""
        lora = bool(self.cfg.model.lora.rank)
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _load_full_weights(self, checkpoint: Checkpoint) -> list[str]:
        """Another strategy's portable weights, dealt to this layout's shards, and its
        optimizer state by parameter name where it has some to give."""
        assert self.optimizer is not None and self.scheduler is not None
        lora = bool(self.cfg.model.lora.rank)
        options = StateDictOptions(full_state_dict=True, strict=not lora)
        set_model_state_dict(self.model, checkpoint.full_weights(), options=options)
        return restore_optimizer_by_name(
            checkpoint,
            self.optimizer,
            self.scheduler,
            named_parameters(self.model),
            order=optimizer_order(self.model, self.cfg.optim),
        )

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's shards: parameters, gradients (the most held after any backward) and
        optimizer state, measured from the local parts of the DTensors."""
        assert self.optimizer is not None, "setup() first"
        return {
            "params": storage_bytes(local_part(p.data) for p in held_parameters(self.model)),
            "grads": self._peak_grad_bytes,
            "optimizer": storage_bytes(local_part(t) for t in tensors_in(self.optimizer.state)),
        }


def sharding_units(model: nn.Module, *, class_names: tuple[str, ...]) -> list[nn.Module]:
    """The model's repeated blocks as modules of its own tree, each one FSDP unit. A
    pipeline layer that only wraps the model's modules (a Llama decoder layer with the
    shared rotary embedding) gives the wrapped modules that hold parameters: the root's
    `fully_shard` must find every unit among its submodules."""
    registered = {id(m) for m in model.modules()}
    units: list[nn.Module] = []
    for block in repeated_blocks(model, class_names=class_names):
        if id(block) in registered:
            units.append(block)
            continue
        units += [
            child
            for child in block.children()
            if id(child) in registered and next(child.parameters(), None) is not None
        ]
    return units


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """The global gradient norm over every shard of every gradient, before clipping; scales
    the gradients to `max_norm` when it is above (`max_norm` 0: no clipping), as
    `torch.nn.utils.clip_grad_norm_` does for whole tensors."""
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(squared_norm(grads))
    scale = max_norm / (total + 1e-6)
    if max_norm and scale < 1:
        for grad in grads:
            grad.mul_(scale)
    return total
