"""`trainstack plan SPEC`: every candidate layout's memory, bytes and modelled step
time on N devices, and the one to run.

    trainstack plan jobs/configs/demo.yaml
    trainstack plan jobs/configs/demo.yaml --devices 8 --device-memory 80GB --json

Defaults: the spec's `scaling.num_workers` devices, each with the spec's
`scaling.device_memory`, else this machine's GPU's (with `scaling.use_gpu`), else this
machine's memory divided among them; 100 GB/s a rank; 989 TFLOP/s peak (an H100's dense
bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trainstack.config import ConfigError, JobConfig, load_config
from trainstack.planner.layouts import format_value
from trainstack.planner.plan import Estimate, Hardware, Plan, make_plan
from trainstack.planner.workload import with_layout, workload_from_spec
from trainstack.units import format_bytes, format_seconds, parse_quantity


def add_plan_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `trainstack plan` to the CLI's subcommands."""
    from trainstack.cli.args import add_overrides

    parser = commands.add_parser(
        "plan", help="compare layouts' memory, bytes and modelled step time; pick one"
    )
    parser.add_argument("config", help="job spec (YAML)")
    add_overrides(parser, what="a spec key, e.g. --set model.n_layer=32")
    parser.add_argument("--devices", help="ranks, one device each (default: scaling.num_workers)")
    parser.add_argument(
        "--device-memory",
        help="memory of one device, e.g. 80GB or 16GiB (default: this machine's GPU, else "
        "its memory divided among the devices)",
    )
    parser.add_argument("--bandwidth", default="100GB/s", help="bytes a second a rank sends")
    parser.add_argument("--peak-flops", default="989e12", help="one device's peak FLOP/s")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.set_defaults(handler=plan_command)
    return parser


def plan_command(args: argparse.Namespace) -> int:
    """Print the plan; 2 (one error line) for a bad spec or flag value."""
    try:
        cfg = load_config(args.config, args.overrides)
        devices = _positive_int("--devices", args.devices or str(cfg.scaling.num_workers))
        hardware = Hardware(
            devices=devices,
            memory_bytes=_device_memory(args.device_memory, cfg=cfg, devices=devices),
            bandwidth=parse_quantity(
                "--bandwidth", args.bandwidth, units=True, example="100GB/s", suffix="/s"
            ),
            peak_flops=parse_quantity(
                "--peak-flops", args.peak_flops, units=False, example="989e12"
            ),
        )
        plan = make_plan(
            workload_from_spec(cfg),
            hardware,
            runnable=lambda keys: with_layout(cfg, keys, keep_compression=False) is not None,
        )
        if not plan.rows:
            raise ConfigError(_no_layout(devices, global_batch=cfg.train.global_batch_size))
    except ConfigError as err:
        print(f"trainstack: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([_row_json(plan, row) for row in plan.rows], indent=2))
    else:
        print(format_plan(plan, name=cfg.name))
    return 0


def _positive_int(flag: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{flag}={text}: not a device count; allowed: an integer >= 1, e.g. 8")
    return int(text)


def _no_layout(devices: int, *, global_batch: int) -> str:
    fitting = max(d for d in range(1, min(devices, global_batch) + 1) if global_batch % d == 0)
    return (
        f"--devices={devices}: the spec allows no layout on {devices} devices (the "
        f"data-parallel ranks must split train.global_batch_size={global_batch} evenly, and "
        f"the spec's limits hold); allowed: a device count such as {fitting}"
    )


def _device_memory(text: str | None, *, cfg: JobConfig, devices: int) -> int:
    """--device-memory, else what a run of the spec would plan with."""
    if text is not None:
        return int(parse_quantity("--device-memory", text, units=True, example="80GB"))
    from trainstack.planner.choose import device_memory

    return device_memory(cfg, devices=devices)


# ---- printing ----------------------------------------------------------------------

COLUMNS = (
    "layout",
    "micro-batch",
    "recompute",
    "activations",
    "memory/rank",
    "comm/step",
    "step time",
    "fits",
)


def format_plan(plan: Plan, *, name: str) -> str:
    """The plan as an aligned table, the recommended row marked `*`, and why."""
    w, hw = plan.workload, plan.hardware
    lines = [
        f"trainstack plan: {name}: {w.model}, {w.params:,} parameters"
        f"{'' if w.trainable is None else f' ({w.trainable:,} of them train: LoRA)'}, "
        f"{w.global_batch} samples × {w.tokens_per_sample} tokens a step, "
        f"{ {4: 'fp32', 2: 'bf16', 8: 'fp64'}[w.element_bytes] }",
        f"on {hw.devices} device(s) × {format_bytes(hw.memory_bytes)}, "
        f"{format_bytes(hw.bandwidth)}/s a rank, {hw.peak_flops / 1e12:g} TFLOP/s peak at "
        f"{hw.efficiency:.0%}",
        "",
    ]
    cells = [COLUMNS] + [_cells(row) for row in plan.rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for i, row_cells in enumerate(cells):
        mark = "*" if i and plan.rows[i - 1] is plan.recommended else " "
        padded = [
            c.ljust(width) if j == 0 else c.rjust(width)
            for j, (c, width) in enumerate(zip(row_cells, widths, strict=True))
        ]
        lines.append(f"{mark} " + "  ".join(padded).rstrip())
    lines += ["", _why(plan)]
    if w.shape is None:
        lines.append(
            f"activations: unknown for {w.model} (no transformer shape): memory/rank is "
            "model state and the framework's overhead only"
        )
    return "\n".join(lines)


def _cells(row: Estimate) -> tuple[str, ...]:
    memory = format_bytes(row.memory)
    if row.state.host:
        memory += f" + {format_bytes(row.state.host)} host"
    return (
        row.layout.name,
        str(row.micro_batch),
        "yes" if row.recompute else "no",
        "—" if row.activations is None else format_bytes(row.activations),
        memory,
        format_bytes(row.comm_bytes),
        format_seconds(row.step_s),
        "yes" if row.fits else "no",
    )


def _why(plan: Plan) -> str:
    best, memory = plan.recommended, format_bytes(plan.hardware.memory_bytes)
    if best is None:
        smallest = min(plan.rows, key=lambda r: r.memory)
        return (
            f"recommended: none: no layout fits {memory} a device; the smallest, "
            f"{smallest.layout.name}, needs {format_bytes(smallest.memory)}"
        )
    fitting = sum(row.fits for row in plan.rows)
    keys = " ".join(f"--set {k}={format_value(v)}" for k, v in best.spec_keys().items())
    return (
        f"recommended: {best.layout.name} (*): the fastest modelled step, "
        f"{format_seconds(best.step_s)}, of the {fitting} layouts that fit {memory} a device; "
        f"run it with {keys}"
    )


def _row_json(plan: Plan, row: Estimate) -> dict[str, Any]:
    return {
        "layout": row.layout.name,
        "spec": row.spec_keys(),
        "micro_batch": row.micro_batch,
        "accumulation": row.accumulation,
        "recompute": row.recompute,
        "state_bytes": row.state.device,
        "host_bytes": row.state.host,
        "activation_bytes": row.activations,
        "overhead_bytes": row.overhead,
        "memory_bytes": row.memory,
        "comm_bytes_per_step": row.comm_bytes,
        "compute_s": row.compute_s,
        "comm_s": row.comm_s,
        "host_s": row.host_s,
        "step_s": row.step_s,
        "fits": row.fits,
        "recommended": row is plan.recommended,
    }
