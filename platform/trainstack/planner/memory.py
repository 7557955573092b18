"""Model-state bytes per rank: parameters, gradients and optimizer state.

Ψ parameters, N ranks, e bytes a training-dtype element (4 fp32, 2 bf16), o bytes of
fp32 optimizer state a parameter (AdamW 8). What trainstack's engines allocate, as
`benchmarks/zero_memory.py` and `benchmarks/mesh_layouts.py` measure; the one model of
it: `trainstack plan`, `strategy.kind: auto` and pre-flight's capacity check
(`runtime.capacity.model_state`) all ask `model_state_bytes`:

| layout | parameters | gradients | optimizer |
| --- | --- | --- | --- |
| ddp | 4Ψ | 4Ψ | oΨ |
| ddp × expert parallel ep (Ψ_e experts) | 4Ψ' | 4Ψ' | oΨ', Ψ' = Ψ − Ψ_e + Ψ_e/ep |
| zero-1 | eΨ | eΨ | (4 + o)Ψ/N (an fp32 master copy and the state) |
| zero-2 | eΨ | eΨ/N | (4 + o)Ψ/N |
| zero-3 | eΨ/N | eΨ/N | (4 + o)Ψ/N |
| fsdp, shard s, tp t | 4Ψ/(s·t) | 4Ψ/(s·t) | oΨ/(s·t) |
| pipeline p (× tp t) | 4Ψ/(p·t) | 4Ψ/(p·t) | oΨ/(p·t) |
| … with replicas sharded s ways | 4Ψ/(p·t·s) | 4Ψ/(p·t·s) | oΨ/(p·t·s) |

DDP and FSDP keep fp32 weights under bf16 (autocast, FSDP's mixed-precision policy
casts for compute). ZeRO's `offload_optimizer` moves the master copy and state to host
memory, `offload_param` its parameters; FSDP's `offload_param` moves all three.
A parameter-server worker holds weights and gradients (8Ψ), its shards the weights and
optimizer state ((4 + o)Ψ over all shards). With LoRA (`model.lora`) Ψ_t of the Ψ
parameters train: the gradients, ZeRO's master copy and the optimizer state count Ψ_t.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainstack.planner.layouts import Layout

FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Model state one rank holds, by where it lies."""

    device: int
    """On the rank's device (its GPU; on CPU, the same RAM as `host`)."""
    host: int
    """Offloaded to host memory."""

    @property
    def total(self) -> int:
        return self.device + self.host


def model_state_bytes(
    layout: Layout,
    *,
    params: int,
    element_bytes: int,
    optimizer_bytes: int,
    weight_bytes: int = FP32_BYTES,
    expert_params: int = 0,
    trainable: int | None = None,
    reference_copy: bool = False,
) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state one rank of `layout` holds
    (the table in the module docstring, whose 4 is `weight_bytes`: 8 when the torch
    engines train in fp64; integer division). `trainable`: the parameters that train
    (LoRA's adapters; default all): gradients, ZeRO's master copy and the optimizer's
    state are theirs alone, every parameter is held. `reference_copy`: DPO's frozen
    reference (without LoRA), a second copy of the weights held as the policy's are."""
    psi, n, e, o = params, layout.devices, element_bytes, optimizer_bytes
    g = psi if trainable is None else trainable
    copies = 2 if reference_copy else 1
    if layout.kind == "zero":
        weights = copies * (e * psi if layout.stage < 3 else e * psi // n)
        grads = e * g if layout.stage == 1 else e * g // n
        state = (FP32_BYTES + o) * g // n
        host = state * layout.offload_optimizer + weights * layout.offload_param
        return StateBytes(device=weights + grads + state - host, host=host)
    whole = copies * weight_bytes * psi + (weight_bytes + o) * g
    if layout.kind == "fsdp":
        split = whole // (layout.shard * layout.tensor_parallel)
        host = split if layout.offload_param else 0
        return StateBytes(device=split - host, host=host)
    if layout.kind == "pipeline":
        split = layout.stages * layout.tensor_parallel * layout.shard
        return StateBytes(device=whole // split, host=0)
    held = psi - expert_params + expert_params // layout.expert_parallel  # ddp × ep
    trained = g - expert_params + expert_params // layout.expert_parallel
    return StateBytes(device=copies * weight_bytes * held + (weight_bytes + o) * trained, host=0)


def parameter_server_bytes(*, params: int, optimizer_bytes: int) -> tuple[int, int]:
    """(bytes one worker holds, bytes all the shards hold together): a worker's fp32
    weights and gradients; the shards' weights and optimizer state."""
    return 2 * FP32_BYTES * params, (FP32_BYTES + optimizer_bytes) * params


def zero_paper_bytes(psi: float, *, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per rank in ZeRO's paper (Rajbhandari et al. 2020, Section 3
    and Figure 1): mixed-precision Adam, fp16 parameters and gradients (2Ψ each) and
    K bytes a parameter of optimizer state (fp32 master copy, momentum and variance:
    K = 12).

    stage 0 (DDP): (2 + 2 + K)Ψ; P_os (stage 1): 2Ψ + 2Ψ + KΨ/N; P_os+g (stage 2):
    2Ψ + (2 + K)Ψ/N; P_os+g+p (stage 3): (2 + 2 + K)Ψ/N.
    """
    params = 2 * psi if stage < 3 else 2 * psi / n
    grads = 2 * psi if stage < 2 else 2 * psi / n
    state = k * psi if stage < 1 else k * psi / n
    return params + grads + state
