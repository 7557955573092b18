"""DeepSpeed ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded
over the data-parallel ranks, optionally offloaded to host memory.

The job spec is the one source of truth: `deepspeed_config` derives DeepSpeed's
config from it and merges the spec's raw `deepspeed:` section last. trainstack builds
the optimizer and LR schedule (trainstack/optim.py) and hands both to DeepSpeed, which
then runs accumulation (loss scaled by 1/A, one optimizer step per A micro-batches),
clipping, the optimizer step and the schedule step, so a step means what it means
under DDPStrategy. The set-up it shares with the DeepSpeed pipeline is in
`deepspeed_engine.py`.

A `model.pretrained` comes with its parameters on the meta device: under stage 3 each
rank gives storage to its partition of each parameter only, before the engine is built,
and reads just that run of each saved tensor (`load_pretrained`,
strategies/zero_pretrained.py); under 1-2 each rank holds and reads the whole model.

DeepSpeed is imported inside the methods that use it: importing it is slow and prints
a notice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack.checkpoint import Checkpoint, rank_file
from trainstack.config import JobConfig
from trainstack.data.sharding import Batch
from trainstack.models.lora import kept_weights, load_weights
from trainstack.models.on_meta import has_meta_parameters
from trainstack.optim import build_optimizer, scaled_lr
from trainstack.strategies.base import (
    StepOutput,
    WorkerContext,
    apply_compile,
    fast_forward_schedule,
    storage_bytes,
    tensors_in,
    to_device,
)
from trainstack.strategies.deepspeed_engine import (
    UNSAVED_OPTIMIZER_KEYS,
    ZERO_FRAGMENTS,
    build_engine,
    config_from_spec,
    init_deepspeed_comm,
    master_partitions,
    weights_only_value,
)
from trainstack.strategies.pretrained_parts import materialise, place
from trainstack.strategies.zero_pretrained import partition_on_meta, read_held
from trainstack.tasks import EvalSums, build_task, eval_mode, evaluate, held_parameters


def deepspeed_config(cfg: JobConfig) -> dict[str, Any]:
    """DeepSpeed's config for `cfg`: derived from the spec, then `cfg.deepspeed` deep-merged."""
    s = cfg.strategy
    zero: dict[str, Any] = {
        "stage": s.stage,
        "overlap_comm": s.overlap_comm,
        "reduce_bucket_size": s.reduce_bucket_size,
    }
    if s.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": s.offload_optimizer}
    if s.offload_param != "none":
        zero["offload_param"] = {"device": s.offload_param}
    bf16 = {"enabled": cfg.train.precision == "bf16"}
    return config_from_spec(cfg, {"bf16": bf16, "zero_optimization": zero})


def zero_model_state_formula(psi: int, n: int, stage: int, precision: str) -> int:
    """Bytes of model state one of `n` ranks holds for `psi` parameters under Adam.

    What DeepSpeed 0.19.8 allocates (runtime/zero/stage_1_and_2.py, stage3.py), as
    measured by `ZeROStrategy.model_state_bytes` (e = 4 bytes in fp32, 2 in bf16):

    - parameters: the model's own copy in the training dtype, e*psi; stage 3 keeps
      only this rank's partition, e*psi/n.
    - gradients, in the training dtype: stage 1 accumulates them full-size until the
      accumulation boundary (e*psi); stages 2 and 3 reduce every micro-batch into
      this rank's partition (e*psi/n). (With one micro-batch per step stage 1 also
      ends the backward pass holding only e*psi/n.)
    - optimizer: an fp32 "master" partition that the optimizer updates, 4*psi/n,
      plus Adam's two moments, 8*psi/n. The master copy exists in fp32 too: DeepSpeed
      clones this rank's partition (`weights_partition = ....clone()`) whatever the
      dtype, so fp32 ZeRO holds 4*psi/n more than the textbook 16*psi/n.

    So in fp32: stage 1 8psi + 12psi/n, stage 2 4psi + 16psi/n, stage 3 20psi/n;
    in bf16: stage 1 4psi + 12psi/n, stage 2 2psi + 14psi/n, stage 3 16psi/n.
    Stage 0 is trainstack's DDP: fp32 weights (bf16 is autocast), grads and Adam
    moments all replicated, 16psi. Alignment padding (a few elements) is ignored.
    """
    assert stage in (0, 1, 2, 3) and precision in ("fp32", "bf16"), (stage, precision)
    if stage == 0:
        return 16 * psi
    e = 4 if precision == "fp32" else 2
    params = e * psi if stage < 3 else e * psi // n
    grads = e * psi if stage == 1 else e * psi // n
    optimizer = 4 * psi // n + 8 * psi // n
    return params + grads + optimizer


class ZeROStrategy:
    name = "zero"

    def __init__(self, cfg: JobConfig, ctx: WorkerContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.engine: Any = None
        """deepspeed.DeepSpeedEngine, built by `setup`."""
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._peak_grad_bytes = 0
        self.task = build_task(cfg)

    def setup(self, model: nn.Module) -> None:
        """Place the model, build the optimizer and DeepSpeed's engine around both. A model
        with meta parameters (a pretrained one, `load_pretrained` fills it) gets storage
        for what this rank holds: under stage 3 its partition of each parameter, given
        before the engine is built (which then finds the model partitioned); under 1-2
        every parameter whole."""
        init_deepspeed_comm(self.ctx)
        config = deepspeed_config(self.cfg)
        if self.ctx.device.type == "cpu":  # offloaded or not, torch's AdamW steps on CPU
            config.setdefault("zero_force_ds_cpu_optimizer", False)
        on_meta = has_meta_parameters(model)
        place(model, self.ctx.device)
        apply_compile(self.cfg, model)
        lr = scaled_lr(self.cfg.optim, data_parallel_size=self.ctx.world_size)
        # Built while the parameters still have their shapes (decay goes by dimensions).
        optimizer = self._build_optimizer(model, lr=lr)
        if on_meta and self.cfg.strategy.stage == 3:
            partition_on_meta(model, config=config)
        else:
            materialise(model, self.ctx.device)
        self.engine, self.scheduler = build_engine(model, optimizer, cfg=self.cfg, config=config)

    def load_pretrained(self, folder: str) -> None:
        """Each rank reads what it holds (`LoadsPretrainedParts`): its partition of every
        saved tensor under stage 3, every tensor whole under 1-2; the optimizer's fp32
        master copy is then taken from the weights read, as the engine takes it at start."""
        read_held(self.unwrapped_model(), folder)
        self._engine().optimizer.refresh_fp32_params()

    def _build_optimizer(self, model: nn.Module, *, lr: float) -> torch.optim.Optimizer:
        optimizer = build_optimizer(model, self.cfg.optim, lr=lr, device=self.ctx.device)
        if self.cfg.strategy.offload_optimizer == "none" or self.ctx.device.type == "cpu":
            return optimizer
        # Offloaded from an accelerator, the step runs on the host: DeepSpeed's CPU Adam
        # (a C++ op compiled on first use into $TORCH_EXTENSIONS_DIR, about two minutes),
        # several times faster there than torch's. A run on CPU keeps torch's AdamW
        # (`zero_force_ds_cpu_optimizer`: see `setup`): its step ran on the host already.
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        assert self.cfg.optim.kind == "adamw", "config validation admits only adamw"
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in optimizer.param_groups
        ]
        return DeepSpeedCPUAdam(groups, lr=lr, betas=self.cfg.optim.betas, adamw_mode=True)

    def unwrapped_model(self) -> nn.Module:
        """The model DeepSpeed trains; under stage 3 its parameters are partitioned
        (use `checkpoint_files()["model.pt"]` for full weights)."""
        module: nn.Module = self._engine().module
        return module

    def _engine(self) -> Any:
        assert self.engine is not None and self.scheduler is not None, "setup() first"
        return self.engine

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        engine = self._engine()
        assert self.scheduler is not None
        accum = len(micro_batches)
        assert accum == engine.gradient_accumulation_steps(), (accum, "micro-batches per step")
        lr = float(self.scheduler.get_last_lr()[0])
        total = torch.zeros((), device=self.ctx.device)
        for x, y in micro_batches:
            x, y = to_device(
                (x, y),
                self.ctx.device,
                pin_memory=self.cfg.train.pin_memory,
                dtype=self.task.input_dtype,
            )
            loss = self.task.loss(self.task.outputs(engine, x, y), y, inputs=x)
            engine.backward(loss)  # scales by 1/accum; reduces (stage 2, 3) or accumulates
            self._peak_grad_bytes = max(self._peak_grad_bytes, self._held_grad_bytes())
            engine.step()  # optimizer and schedule step on the accumulation boundary only
            total += loss.detach().float()
        grad_norm = engine.get_global_grad_norm()
        return StepOutput(
            loss=total / accum,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
        )

    def evaluate(self, batches: list[Batch]) -> EvalSums:
        model = self.unwrapped_model()  # stage 3's hooks gather parameters as it runs
        restore = eval_mode([model])
        sums = evaluate(
            self.task, lambda x: self.task.eval_outputs(model, x), batches, device=self.ctx.device
        )
        restore()
        if self.cfg.strategy.stage == 3:
            # A forward without backward leaves ZeRO-3's gathered parameters whole.
            self._engine().empty_partition_cache()
        dist.all_reduce(sums)
        return EvalSums.of(sums)

    def global_mean(self, value: torch.Tensor) -> float:
        value = value.detach().to(self.ctx.device, torch.float64).clone()
        dist.all_reduce(value)
        return float(value) / self.ctx.world_size

    def comm_bytes_per_step(self) -> int:
        """Modelled: a reduce-scatter or all-gather of the whole model sends (N-1)/N of it.

        Stage 1 reduce-scatters gradients once per step and all-gathers the updated
        parameters; stage 2 reduce-scatters after every micro-batch; stage 3 also
        all-gathers parameters for every forward and every backward.
        """
        n = self.ctx.world_size
        psi = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self._params())
        element = 2 if self.cfg.train.precision == "bf16" else 4
        one_pass = (n - 1) * psi * element // n
        accum = self._engine().gradient_accumulation_steps()
        passes = {1: 2, 2: accum + 1, 3: 3 * accum}[self.cfg.strategy.stage]
        return passes * one_pass

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.unwrapped_model().parameters() if p.requires_grad]

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model state, measured from the tensors DeepSpeed holds.

        params: the model's parameter storage (stage 3: its partitions, `ds_tensor`).
        grads: the most gradient storage seen after any backward pass (full-size
        accumulation buffers under stage 1, this rank's partition under 2 and 3).
        optimizer: the fp32 master partitions and the optimizer's state tensors.
        Storage shared between tensors is counted once.
        """
        zero_optimizer = self._engine().optimizer
        params = held_parameters(self.unwrapped_model())  # frozen ones and DPO's reference too
        partitions = [getattr(p, "ds_tensor") for p in params if _is_zero3(p)]  # noqa: B009
        held_params = [p.data for p in params] + partitions
        optimizer_state = [
            *master_partitions(zero_optimizer),
            *tensors_in(zero_optimizer.optimizer.state),
        ]
        return {
            "params": storage_bytes(held_params),
            "grads": self._peak_grad_bytes,
            "optimizer": storage_bytes(optimizer_state),
        }

    def _held_grad_bytes(self) -> int:
        """Bytes of every gradient buffer alive now: the model's `.grad`s and ZeRO's own."""
        zero_optimizer = self._engine().optimizer
        grads = [p.grad for p in self._params() if p.grad is not None]
        # DeepSpeed's gradient holders (stage 1/2: averaged_gradients, all_grad_tensors,
        # grads_in_partition; stage 3: grad_partitions_flat_buffer, averaged_gradients).
        for name in (
            "averaged_gradients",
            "all_grad_tensors",
            "grads_in_partition",
            "grad_partitions_flat_buffer",
        ):
            grads += tensors_in(getattr(zero_optimizer, name, None))
        grads += [m.grad for m in master_partitions(zero_optimizer) if m.grad is not None]
        return storage_bytes(grads)

    def checkpoint_files(self) -> dict[str, Any]:
        """Rank 0: `model.pt` (full fp32 weights) and `scheduler.pt`; every rank: its
        optimizer shard. A collective: gathering the weights needs every rank."""
        engine = self._engine()
        assert self.scheduler is not None
        weights = self._full_fp32_weights()
        state = engine.optimizer.state_dict()
        shard = {
            key: weights_only_value(value)
            for key, value in state.items()
            if key not in UNSAVED_OPTIMIZER_KEYS
        }
        if "param_slice_mappings" in state:  # ZeRO 1/2: so other layouts can read it by name
            shard[ZERO_FRAGMENTS] = [
                {name: [where.start, where.numel] for name, where in group.items()}
                for group in state["param_slice_mappings"]
            ]
        files: dict[str, Any] = {rank_file("optimizer", self.ctx.rank): shard}
        if self.ctx.rank == 0:
            files["model.pt"] = kept_weights(self.cfg.model, weights)
            files["scheduler.pt"] = self.scheduler.state_dict()
        return files

    def _full_fp32_weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict (same keys as the bare model's) with every parameter
        whole and in fp32, from the optimizer's fp32 partitions (a frozen one from its
        gathered partitions). A collective."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrapped_model()
        full: dict[int, torch.Tensor] = {}
        for p in self._params():  # each tensor once: tied weights share one
            shape = getattr(p, "ds_shape") if _is_zero3(p) else p.shape  # noqa: B009
            full[id(p)] = safe_get_full_fp32_param(p).detach().reshape(shape).cpu().clone()
        # Frozen parameters (LoRA's base) have no fp32 master: stage 3 gathers them whole
        # (a checkpoint keeps the adapters alone: `kept_weights`).
        frozen = [p for p in module.parameters() if not p.requires_grad and _is_zero3(p)]
        if self.cfg.model.lora.rank:
            frozen = []
        if frozen:
            with deepspeed.zero.GatheredParameters(frozen):
                for p in frozen:
                    full[id(p)] = p.detach().float().cpu().clone()
        return {
            key: full[id(value)] if id(value) in full else value.detach().cpu().clone()
            for key, value in module.state_dict(keep_vars=True).items()
        }

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        engine = self._engine()
        assert self.scheduler is not None
        weights = checkpoint.full_weights()
        reason = self._why_not_exact(checkpoint)
        if reason is None:
            self._load_exact(checkpoint, weights)
            self.scheduler.load_state_dict(checkpoint.load("scheduler.pt"))
            notes = []
        else:
            self._load_weights(weights)
            fast_forward_schedule(self.scheduler, step=checkpoint.step)
            notes = [f"optimizer state re-initialised ({reason})"]
        engine.global_steps = checkpoint.step
        engine.global_samples = checkpoint.samples_seen
        return notes

    def _why_not_exact(self, checkpoint: Checkpoint) -> str | None:
        """Why this checkpoint's optimizer shards cannot be loaded here, or None if they can."""
        manifest = checkpoint.manifest
        source = manifest.get("strategy")
        if source != self.name:
            return f"the checkpoint is from {source}"
        ranks = manifest["world"]["world_size"]
        if ranks != self.ctx.world_size:
            return f"the checkpoint has {ranks} ranks, this run {self.ctx.world_size}"
        saved = manifest["spec"]["strategy"]
        for key in ("stage", "offload_optimizer"):
            if saved[key] != getattr(self.cfg.strategy, key):
                mine = getattr(self.cfg.strategy, key)
                return f"the checkpoint has strategy.{key}={saved[key]}, this run {mine}"
        if not (
            checkpoint.has(rank_file("optimizer", self.ctx.rank)) and checkpoint.has("scheduler.pt")
        ):
            return "the checkpoint has no optimizer shard for this rank"
        return None

    def _load_exact(self, checkpoint: Checkpoint, weights: dict[str, torch.Tensor]) -> None:
        """Same layout: this rank's shard restores master weights and optimizer state."""
        zero_optimizer = self._engine().optimizer
        shard = checkpoint.load(rank_file("optimizer", self.ctx.rank))
        shard.pop(ZERO_FRAGMENTS, None)
        shard["loss_scaler"] = zero_optimizer.loss_scaler
        shards: list[dict[str, Any] | None] = [None] * self.ctx.world_size
        shards[self.ctx.rank] = shard  # ZeRO reads its own rank's entry
        if self.cfg.strategy.stage == 3:
            # Partitioned parameters are rebuilt from the fp32 master partitions.
            zero_optimizer.checkpoint_event_prologue()
            zero_optimizer.load_state_dict(shards, load_optimizer_states=True)
            zero_optimizer.checkpoint_event_epilogue()
        else:  # the working (bit16/fp32) copy
            load_weights(self.unwrapped_model(), weights, cfg=self.cfg.model)
            zero_optimizer.load_state_dict(
                shards, load_optimizer_states=True, load_from_fp32_weights=True
            )

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Full fp32 weights into both the model's copy and the fp32 master partitions."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.unwrapped_model()
        if self.cfg.strategy.stage == 3:
            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if self.ctx.rank == 0:  # broadcast and re-partitioned on exit
                    load_weights(module, weights, cfg=self.cfg.model)
        else:
            load_weights(module, weights, cfg=self.cfg.model)
        for name, p in module.named_parameters():
            if p.requires_grad:
                safe_set_full_fp32_param(p, weights[name].to(self.ctx.device))


def _is_zero3(p: nn.Parameter) -> bool:
    return hasattr(p, "ds_tensor")
