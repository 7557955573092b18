"""The layouts a plan compares for N devices, and what each means as spec keys.

One `Layout` is a strategy and its degrees: DDP; DeepSpeed ZeRO stage 1, 2 or 3 with
or without offload; FSDP2 (with or without resharding after the forward, with or
without CPU offload) alone or × tensor parallel; a pipeline × data parallel (replicas
replicated or FSDP-sharded), alone or × tensor parallel. The search is small and
deterministic: degrees are powers of two that divide the devices (tensor parallel also
the heads and the width; pipeline stages also the layers), in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trainstack.config.layout import CONTEXT_PARALLEL_FAMILIES
from trainstack.planner.workload import TransformerShape

if TYPE_CHECKING:
    from trainstack.config import JobConfig

LayoutKind = Literal["ddp", "zero", "fsdp", "pipeline"]

DEGREES = (2, 4, 8)
"""Tensor-parallel and pipeline degrees tried: up to one machine's 8 GPUs."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to place a model on `devices` ranks."""

    kind: LayoutKind
    devices: int
    """World size N."""
    stage: int = 0
    """zero: the ZeRO stage (1, 2, 3)."""
    offload_optimizer: bool = False
    """zero: the fp32 master copy and optimizer state live in host memory."""
    offload_param: bool = False
    """zero stage 3: the parameters too; fsdp: parameters, gradients and optimizer state."""
    reshard_after_forward: bool = True
    """fsdp: free gathered parameters after the forward (gather again for the backward)."""
    tensor_parallel: int = 1
    """t: ranks that split every layer (fsdp and pipeline)."""
    replicate: int = 1
    """fsdp, and a pipeline's sharded replicas: r replica groups (HSDP)."""
    stages: int = 1
    """pipeline: p stages; the data-parallel degree is N / (p × t)."""
    shard_replicas: bool = False
    """pipeline: each stage FSDP-sharded over its d replicas (in `replicate` groups)."""
    expert_parallel: int = 1
    """ddp: ranks that split each MoE block's experts (`strategy.expert_parallel`)."""
    context_parallel: int = 1
    """fsdp: ranks that split every row's tokens (`strategy.context_parallel`); FSDP shards
    over them too."""

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: N / (t × p × c)."""
        return self.devices // (self.tensor_parallel * self.stages * self.context_parallel)

    @property
    def shard(self) -> int:
        """The shard degree: fsdp s = N / (r × t); a pipeline's d / r with sharded replicas,
        else 1."""
        if self.kind == "pipeline":
            return self.data_parallel // self.replicate if self.shard_replicas else 1
        return self.devices // (self.replicate * self.tensor_parallel)

    @property
    def name(self) -> str:
        """How tables name it: `zero-3 + offload optimizer`, `pp 2 × dp 2 × tp 2`."""
        t = self.tensor_parallel
        if self.kind == "ddp":
            ep = self.expert_parallel
            return f"ddp {self.devices}" + (f" × ep {ep}" if ep > 1 else "")
        if self.kind == "zero":
            offload = ["optimizer"] * self.offload_optimizer + ["params"] * self.offload_param
            return f"zero-{self.stage}" + (f" + offload {' + '.join(offload)}" if offload else "")
        if self.kind == "fsdp":
            parts = [f"tp {t}"] if t > 1 else []
            if self.context_parallel > 1:
                parts.append(f"cp {self.context_parallel}")
            if self.replicate > 1:
                parts.append(f"hsdp {self.replicate} × {self.shard}")
            elif self.shard > 1:
                parts.append(f"fsdp {self.shard}")
            name = " × ".join(parts)
            if self.shard > 1 and not self.reshard_after_forward:
                name += ", no reshard"
            return name + (" + offload" if self.offload_param else "")
        parts = [f"pp {self.stages}"]
        if self.shard_replicas and self.replicate > 1:
            parts.append(f"hsdp {self.replicate} × {self.shard}")
        elif self.shard_replicas:
            parts.append(f"fsdp {self.data_parallel}")
        elif self.data_parallel > 1:
            parts.append(f"dp {self.data_parallel}")
        if t > 1:
            parts.append(f"tp {t}")
        return " × ".join(parts)

    @property
    def complexity(self) -> int:
        """How much machinery it takes, to break ties between equally fast layouts:
        DDP 0, ZeRO by stage, fsdp 3, pipelines 5; offload and tensor parallel add 2."""
        base = {"ddp": 0, "zero": self.stage, "fsdp": 3, "pipeline": 5}[self.kind]
        split = (self.tensor_parallel > 1) + (self.context_parallel > 1)
        extra = 2 * (self.offload_optimizer + self.offload_param + split)
        return base + extra + (self.expert_parallel > 1)

    def spec_keys(self) -> dict[str, Any]:
        """The job-spec keys that select this layout (`--set` form)."""
        keys: dict[str, Any] = {"strategy.kind": self.kind, "scaling.num_workers": self.devices}
        if self.kind == "zero":
            keys["strategy.stage"] = self.stage
            if self.offload_optimizer:
                keys["strategy.offload_optimizer"] = "cpu"
            if self.offload_param:
                keys["strategy.offload_param"] = "cpu"
        if self.kind == "fsdp":
            if self.offload_param:
                keys["strategy.offload_param"] = "cpu"
            if not self.reshard_after_forward:
                keys["strategy.reshard_after_forward"] = False
            if self.replicate > 1:
                keys["strategy.data_parallel_replicate"] = self.replicate
        if self.kind == "pipeline":
            keys["strategy.stages"] = self.stages
            keys["strategy.data_parallel"] = self.data_parallel
            if self.shard_replicas:
                keys["strategy.shard_replicas"] = True
            if self.replicate > 1:
                keys["strategy.data_parallel_replicate"] = self.replicate
        if self.tensor_parallel > 1:
            keys["strategy.tensor_parallel"] = self.tensor_parallel
        if self.context_parallel > 1:
            keys["strategy.context_parallel"] = self.context_parallel
        if self.expert_parallel > 1:
            keys["strategy.expert_parallel"] = self.expert_parallel
        return keys


# ---- the spec's own layout, by strategy kind (`StrategyKind.plan_layout`) ---------


def ddp_layout(cfg: JobConfig) -> Layout:
    return Layout(
        kind="ddp", devices=cfg.scaling.num_workers, expert_parallel=cfg.strategy.expert_parallel
    )


def zero_layout(cfg: JobConfig) -> Layout:
    s = cfg.strategy
    return Layout(
        kind="zero",
        devices=cfg.scaling.num_workers,
        stage=s.stage,
        offload_optimizer=s.offload_optimizer != "none",
        offload_param=s.offload_param != "none",
    )


def fsdp_layout(cfg: JobConfig) -> Layout:
    s = cfg.strategy
    return Layout(
        kind="fsdp",
        devices=cfg.scaling.num_workers,
        offload_param=s.offload_param != "none",
        reshard_after_forward=s.reshard_after_forward,
        tensor_parallel=s.tensor_parallel,
        replicate=s.data_parallel_replicate,
        context_parallel=s.context_parallel,
    )


def pipeline_layout(cfg: JobConfig) -> Layout:
    s = cfg.strategy
    return Layout(
        kind="pipeline",
        devices=cfg.scaling.num_workers,
        stages=s.stages,
        tensor_parallel=s.tensor_parallel,
        shard_replicas=s.shard_replicas and s.data_parallel > 1,
        replicate=s.data_parallel_replicate,
    )


def candidate_layouts(
    devices: int, shape: TransformerShape | None, *, experts: int = 0
) -> list[Layout]:
    """Every layout tried on `devices` ranks, simplest first. Tensor parallelism and
    pipelines need a transformer shape (heads and width to split, layers to cut); DDP ×
    expert parallelism a model with `experts` per MoE block to split."""
    n = devices
    layouts = [Layout(kind="ddp", devices=n)]
    if n == 1:
        return layouts
    splits_experts = (ep for ep in DEGREES if n % ep == 0 and experts and experts % ep == 0)
    layouts += [Layout(kind="ddp", devices=n, expert_parallel=ep) for ep in splits_experts]
    layouts += [Layout(kind="zero", devices=n, stage=stage) for stage in (1, 2, 3)]
    layouts += [
        Layout(kind="zero", devices=n, stage=2, offload_optimizer=True),
        Layout(kind="zero", devices=n, stage=3, offload_optimizer=True),
        Layout(kind="zero", devices=n, stage=3, offload_optimizer=True, offload_param=True),
        Layout(kind="fsdp", devices=n),
        Layout(kind="fsdp", devices=n, reshard_after_forward=False),
        Layout(kind="fsdp", devices=n, offload_param=True),
    ]
    if shape is None:
        return layouts
    splits = [t for t in DEGREES if n % t == 0 and shape.heads % t == 0 and shape.hidden % t == 0]
    layouts += [Layout(kind="fsdp", devices=n, tensor_parallel=t) for t in splits]
    if shape.family in ("gpt", *CONTEXT_PARALLEL_FAMILIES):  # the spec's checks keep
        # the rows it cannot run (a pretrained folder's, for one)
        contexts = (c for c in DEGREES if n % c == 0 and shape.seq % (2 * c) == 0)
        layouts += [Layout(kind="fsdp", devices=n, context_parallel=c) for c in contexts]
    for p in (p for p in DEGREES if n % p == 0 and shape.layers % p == 0):
        for t in (t for t in (1, *splits) if n % (p * t) == 0):
            layouts.append(Layout(kind="pipeline", devices=n, stages=p, tensor_parallel=t))
            if n // (p * t) > 1:  # replicas to shard
                sharded = Layout(
                    kind="pipeline", devices=n, stages=p, tensor_parallel=t, shard_replicas=True
                )
                layouts.append(sharded)
    return layouts


def format_value(value: Any) -> str:
    """A spec value as `--set` takes it (booleans lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
