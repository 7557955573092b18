"""Pipeline schedules measured: bubble next to theory, activation memory, tokens/s.

Each (schedule, p, m) trains the same GPT on p gloo CPU processes (the strategy's
math, not Ray) and reports, from the run's summary:

- measured bubble: per rank, 1 - (seconds in stage forward/backward compute) /
  (seconds in the schedule's step), averaged over ranks, first step excluded;
- ideal bubble: the schedule's own action order replayed with equal stages, free
  communication and backward = 2 × forward (`pipeline_probe.simulated_bubble`);
- theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) for the interleaved
  schedules (the zero-bubble ones have no closed form here: see the ideal column);
- peak activation bytes per stage (tensors autograd saved for backward, live at once).

With more processes than cores the ranks share CPUs and the measured bubble mixes in
time-slicing: say so next to the figures.

    python benchmarks/pipeline.py --stages 2 --microbatches 4 8 16
    python benchmarks/pipeline.py --stages 4 --microbatches 4 8 16 --schedules gpipe 1f1b
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import run_processes
from trainstack.strategies.pipeline_probe import SavedActivationMeter
from trainstack.tasks import build_task

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_interleaved", "zbv", "dualpipev")
MICRO_BATCH = 4


def spec(
    storage: str,
    *,
    schedule: str,
    p: int,
    m: int,
    steps: int,
    n_layer: int,
    n_embd: int,
    checkpointing: bool = False,
    engine: str = "torch",
) -> dict[str, Any]:
    return {
        "name": "pipeline-bench",
        "model": {
            "n_layer": n_layer,
            "n_head": 4,
            "n_embd": n_embd,
            "block_size": 64,
            "activation_checkpointing": checkpointing,
        },
        "data": {"vocab_size": 64, "eval_samples": 0},
        "train": {
            "steps": steps,
            "global_batch_size": m * MICRO_BATCH,
            "micro_batch_size": MICRO_BATCH,
        },
        "optim": {"warmup_steps": 1},
        "strategy": {
            "kind": "pipeline",
            "engine": engine,
            "schedule": schedule,
            "stages": p,
            "microbatches": m,
        },
        "scaling": {"num_workers": p, "cpus_per_worker": max(1, (os.cpu_count() or 1) // p)},
        "checkpoint": {"storage_path": storage},
        "log": {"every_steps": steps, "progress": "quiet"},
    }


def theory(schedule: str, *, p: int, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return None


def measure(
    schedule: str, *, p: int, m: int, args: argparse.Namespace, **kw: Any
) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="trainstack-pp-") as storage:
        try:
            cfg = config_from_dict(
                spec(
                    storage,
                    schedule=schedule,
                    p=p,
                    m=m,
                    steps=args.steps,
                    n_layer=args.n_layer,
                    n_embd=args.n_embd,
                    engine=args.engine,
                    **kw,
                )
            )
        except ConfigError as err:
            print(f"skip {schedule} p={p} m={m}: {err}")
            return None
        summary = run_processes(cfg, world_size=p, out_dir=Path(storage) / "out")
    pp = summary["pipeline"]
    row = {
        "schedule": schedule if args.engine == "torch" else f"deepspeed {schedule}",
        "p": p,
        "m": m,
        "v": cfg.pipeline_virtual_stages,
        "measured_bubble": pp["bubble_fraction"],
        "measured_bubble_per_rank": pp["bubble_fraction_per_rank"],
        "ideal_bubble": pp["ideal_bubble_fraction"],
        "theory_bubble": theory(schedule, p=p, m=m, v=cfg.pipeline_virtual_stages),
        "tokens_per_s": summary["tokens_per_s"],
        "activation_peak_bytes_per_stage": pp["activation_peak_bytes_per_stage"],
        "split": pp["split"],
    }
    print(json.dumps(row), flush=True)
    return row


def whole_model_activation_bytes(args: argparse.Namespace, *, checkpointing: bool) -> int:
    """Bytes autograd saves for one micro-batch through the whole model (what each DDP
    rank holds per micro-batch in flight), with or without activation checkpointing."""
    cfg = config_from_dict(
        spec(
            "unused",
            schedule="1f1b",
            p=2,
            m=2,
            steps=2,
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            checkpointing=checkpointing,
        )
    )
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    meter = SavedActivationMeter(
        exclude={p.untyped_storage().data_ptr() for p in model.parameters()}
    )
    idx = torch.randint(0, cfg.data.vocab_size, (MICRO_BATCH, cfg.model.block_size))
    with meter.recording():
        loss = build_task(cfg).loss(model(idx), idx)
    held = meter.live_bytes
    loss.backward()
    return held


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def bubble_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | p | m | v | measured bubble | ideal (simulated) | theory | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {percent(r['measured_bubble'])} "
            f"| {percent(r['ideal_bubble'])} | {percent(r['theory_bubble'])} "
            f"| {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | p | m | peak activation KiB per stage |",
        "|---|---|---|---|",
    ]
    for r in rows:
        peaks = ", ".join(f"{b / 1024:,.0f}" for b in r["activation_peak_bytes_per_stage"])
        lines.append(f"| {r['label']} | {r['p']} | {r['m']} | {peaks} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--engine", default="torch", choices=["torch", "deepspeed"])
    parser.add_argument("--memory", action="store_true", help="also GPipe vs 1F1B vs checkpointed")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()

    rows = [
        row
        for p in args.stages
        for m in args.microbatches
        for schedule in args.schedules
        if (row := measure(schedule, p=p, m=m, args=args)) is not None
    ]
    print(f"\n{os.cpu_count()} CPUs\n")
    print(bubble_table(rows))
    memory: list[dict[str, Any]] = []
    if args.memory:
        p, m = args.stages[0], max(args.microbatches)
        for label, schedule, checkpointing in (
            ("GPipe", "gpipe", False),
            ("1F1B", "1f1b", False),
            ("1F1B + activation checkpointing", "1f1b", True),
        ):
            row = measure(schedule, p=p, m=m, args=args, checkpointing=checkpointing)
            assert row is not None
            memory.append({**row, "label": label})
        print()
        print(memory_table(memory))
        for checkpointing in (False, True):
            held = whole_model_activation_bytes(args, checkpointing=checkpointing)
            print(
                f"DDP, whole model, one micro-batch, checkpointing={checkpointing}: "
                f"{held / 1024:,.0f} KiB"
            )
    if args.json:
        args.json.write_text(json.dumps({"bubble": rows, "memory": memory}, indent=2))


if __name__ == "__main__":
    main()
