"""The plan at launch: `strategy.kind: auto` takes its recommended layout, and every run
is checked against the devices' memory before anything starts.

Both plan for `scaling.num_workers` devices (`default_hardware`) of the memory the spec
states (`scaling.device_memory`), else of this machine: its GPU's for each worker with
`scaling.use_gpu`, else its memory divided among the workers (a local run's workers
share it). On a cluster the driver cannot see the workers' devices before connecting,
so the launcher checks the layout only for local runs; `auto` plans with
`scaling.device_memory` or this machine's figures, and its line says which.
"""

from __future__ import annotations

from trainstack.config import ConfigError, JobConfig
from trainstack.kinds import kind_of, load
from trainstack.machine import local_memory_bytes
from trainstack.planner.layouts import Layout, format_value
from trainstack.planner.plan import Estimate, Hardware, Plan, estimate, make_plan
from trainstack.planner.workload import Workload, with_layout, workload_from_spec
from trainstack.units import format_bytes, format_seconds, parse_quantity

BANDWIDTH = 100e9
"""Bytes a second a rank sends, as `trainstack plan` assumes by default."""
PEAK_FLOPS = 989e12
"""One device's peak, as `trainstack plan` assumes by default (an H100's dense bf16)."""


def default_hardware(cfg: JobConfig, *, devices: int) -> Hardware:
    """`devices` ranks with the memory each worker of this job gets (`device_memory`)."""
    return Hardware(
        devices=devices,
        memory_bytes=device_memory(cfg, devices=devices),
        bandwidth=BANDWIDTH,
        peak_flops=PEAK_FLOPS,
    )


def device_memory(cfg: JobConfig, *, devices: int) -> int:
    """One device's memory: the spec's `scaling.device_memory`, else this machine's GPU's
    (with `scaling.use_gpu`), else this machine's memory divided among the devices."""
    import torch

    if cfg.scaling.device_memory:
        stated = cfg.scaling.device_memory
        return int(parse_quantity("scaling.device_memory", stated, units=True, example="80GB"))
    if cfg.scaling.use_gpu and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return local_memory_bytes() // devices


def resolve_auto(cfg: JobConfig) -> tuple[JobConfig, str]:
    """`cfg` with `strategy.kind: auto` replaced by the plan's recommended layout on
    `scaling.num_workers` devices (its strategy keys, micro-batch size and activation
    checkpointing), and one line saying which and why. ConfigError when nothing fits."""
    workload = workload_from_spec(cfg)
    hardware = default_hardware(cfg, devices=cfg.scaling.num_workers)
    plan = make_plan(
        workload,
        hardware,
        runnable=lambda keys: with_layout(cfg, keys, keep_compression=True) is not None,
    )
    best = plan.recommended
    if best is None:
        raise ConfigError(f"strategy.kind=auto: {_nothing_fits(plan)}")
    chosen = with_layout(cfg, best.spec_keys(), keep_compression=True)
    assert chosen is not None, "make_plan keeps only runnable settings"
    fitting = sum(row.fits for row in plan.rows)
    keys = ", ".join(f"{k}={format_value(v)}" for k, v in best.spec_keys().items())
    why = (
        f"strategy.kind=auto chose {best.layout.name} ({keys}): the fastest modelled step, "
        f"{format_seconds(best.step_s)}, of the {fitting} of {len(plan.rows)} layouts that "
        f"fit {format_bytes(hardware.memory_bytes)} a device; it needs about "
        f"{format_bytes(best.memory)} a rank"
    )
    return chosen, why + _unfit_note(plan)


def check_layout_fits(cfg: JobConfig) -> None:
    """Raise ConfigError when the plan says the spec's own layout needs more memory a
    rank than this machine gives each worker, naming the plan's figure and the best
    layout that fits. The parameter server, and models the plan cannot size (no
    meta-device build, pretrained weights), are left to pre-flight."""
    layout = layout_of(cfg)
    if layout is None:
        return
    try:
        workload = workload_from_spec(cfg)
    except ConfigError:  # a model that does not build: pre-flight's real build says why
        return
    hardware = default_hardware(cfg, devices=cfg.scaling.num_workers)
    mine = _estimate_of(cfg, workload, layout, hardware)
    if mine is None or mine.fits:
        return
    plan = make_plan(
        workload,
        hardware,
        runnable=lambda keys: with_layout(cfg, keys, keep_compression=True) is not None,
    )
    best = plan.recommended
    instead = "; nothing the plan knows fits either: use a smaller model or more devices"
    if best is not None:
        keys = " ".join(f"--set {k}={format_value(v)}" for k, v in best.spec_keys().items())
        instead = (
            f"; the plan's best layout that fits is {best.layout.name}, about "
            f"{format_bytes(best.memory)} a rank ({keys}, or strategy.kind=auto)"
        )
    activations = (
        "" if mine.activations is None else f" + activations {format_bytes(mine.activations)}"
    )
    state, overhead = format_bytes(mine.state.device), format_bytes(mine.overhead)
    raise ConfigError(
        f"{layout.name} needs about {format_bytes(mine.memory)} a rank (model state "
        f"{state}{activations} + {overhead} framework), more than the "
        f"{format_bytes(hardware.memory_bytes)} each worker has here{instead}"
    )


def layout_of(cfg: JobConfig) -> Layout | None:
    """The plan's layout for the spec's strategy (its kind's `plan_layout`); None for a
    kind the planner does not model (the parameter server)."""
    path = kind_of(cfg).plan_layout
    return load(path)(cfg) if path else None


def _estimate_of(
    cfg: JobConfig, workload: Workload, layout: Layout, hardware: Hardware
) -> Estimate | None:
    """The spec's own setting: its micro-batch size and activation checkpointing."""
    micro = cfg.train.micro_batch_size
    if layout.kind == "pipeline":  # a replica's batch in m micro-batches
        micro = workload.global_batch // (layout.data_parallel * cfg.strategy.microbatches)
    if micro < 1:
        return None
    return estimate(
        workload,
        layout,
        hardware,
        micro_batch=micro,
        recompute=cfg.model.activation_checkpointing,
    )


def _nothing_fits(plan: Plan) -> str:
    memory = format_bytes(plan.hardware.memory_bytes)
    if not plan.rows:
        return f"the spec allows no layout on {plan.hardware.devices} devices"
    smallest = min(plan.rows, key=lambda r: r.memory)
    return (
        f"no layout fits {memory} a device; the smallest, {smallest.layout.name}, needs "
        f"about {format_bytes(smallest.memory)} a rank: use a smaller model or more devices"
    )


def _unfit_note(plan: Plan) -> str:
    ddp = next((row for row in plan.rows if row.layout.kind == "ddp"), None)
    if ddp is None or ddp.fits:
        return ""
    return f" (ddp would need about {format_bytes(ddp.memory)})"
