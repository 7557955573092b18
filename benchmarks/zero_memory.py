"""ZeRO memory per rank, measured against the formula, with throughput: DDP, stages 1-3
and CPU offload, on N CPU workers (gloo processes; the strategy's math, not Ray).

Measured bytes come from `model_state_bytes()`: the tensors DDP or DeepSpeed really
hold on rank 0 (parameters, gradients, optimizer state incl. the fp32 master
partition). The formula is `zero_model_state_formula` (its docstring derives it).

    python benchmarks/zero_memory.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes
from trainstack.strategies.zero import zero_model_state_formula

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {"kind": "ddp"}),
    ("zero-1", {"kind": "zero", "stage": 1}),
    ("zero-2", {"kind": "zero", "stage": 2}),
    ("zero-3", {"kind": "zero", "stage": 3}),
    ("zero-2 + offload optimizer", {"kind": "zero", "stage": 2, "offload_optimizer": "cpu"}),
    (
        "zero-3 + offload optimizer + params",
        {"kind": "zero", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    ),
]


def measure(name: str, strategy: dict[str, Any], *, workers: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainstack-zero-") as storage:
        raw: dict[str, Any] = {
            "name": "zero-memory",
            "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
            "data": {"vocab_size": 64, "eval_samples": 0},
            "train": {"steps": steps, "global_batch_size": 8 * workers, "micro_batch_size": 4},
            "optim": {"warmup_steps": 2},
            "strategy": strategy,
            "scaling": {"num_workers": workers},
            "checkpoint": {"storage_path": storage},
            "log": {"every_steps": steps},
        }
        if strategy["kind"] == "zero":  # partition every parameter, however small
            raw["deepspeed"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        summary = run_processes(config_from_dict(raw), world_size=workers, out_dir=Path(storage))
    held = summary["model_state_bytes"]
    stage = strategy.get("stage", 0)
    offloaded = strategy.get("offload_optimizer", "none") != "none"
    psi = summary["params"]
    formula = None if offloaded else zero_model_state_formula(psi, workers, stage, "fp32")
    return {
        "layout": name,
        "psi": psi,
        "params": held["params"],
        "grads": held["grads"],
        "optimizer": held["optimizer"],
        "measured": sum(held.values()),
        "formula": formula,
        "tokens_per_s": summary["tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/zero_memory.json"))
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache/torch_extensions"))
    rows = [measure(n, s, workers=args.workers, steps=args.steps) for n, s in LAYOUTS]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print("| layout | params | grads | optimizer | measured | formula | meas/formula | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = f"{r['measured'] / r['formula']:.3f}" if r["formula"] else "-"
        formula = f"{r['formula']:,}" if r["formula"] else "(offloaded)"
        print(
            f"| {r['layout']} | {r['params']:,} | {r['grads']:,} | {r['optimizer']:,} | "
            f"{r['measured']:,} | {formula} | {ratio} | {r['tokens_per_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
