"""Layouts on one mesh (fsdp, HSDP, tensor parallel and their products) next to DDP and
DeepSpeed ZeRO-2/3 in one run: final weights against one process, memory per rank
measured against the formula, and throughput (gloo processes on this machine's CPUs).

Every layout trains the same GPT (4 × 128, Ψ = 808,192) on the same global batch for
`--steps` AdamW steps with clipping; "max |Δw|" is the largest difference of any final
weight from one process (DDP on 1 worker). Memory is what rank 0 holds (parameters,
gradients, optimizer state), measured from its tensors; the formula is
`runtime.capacity.model_state` (fsdp: 16Ψ / (s × t)) or ZeRO's
(`zero_model_state_formula`). Bytes sent per step by rank 0: counted from its first
step's collectives for fsdp (and tensor parallel), modelled for DDP and ZeRO. Layouts
wider than the machine's cores oversubscribe them: their tokens/s says little.

    python benchmarks/mesh_layouts.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainstack.config import config_from_dict
from trainstack.runtime.capacity import model_state
from trainstack.runtime.gloo_processes import run_processes
from trainstack.strategies.zero import zero_model_state_formula

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS: list[tuple[str, int, dict[str, Any]]] = [  # name, workers, strategy
    ("ddp 1 (reference)", 1, {"kind": "ddp"}),
    ("ddp 2", 2, {"kind": "ddp"}),
    ("zero-2", 2, {"kind": "zero", "stage": 2}),
    ("zero-3", 2, {"kind": "zero", "stage": 3}),
    ("fsdp 2", 2, {"kind": "fsdp"}),
    ("fsdp 2, no reshard after forward", 2, {"kind": "fsdp", "reshard_after_forward": False}),
    ("tp 2", 2, {"kind": "fsdp", "tensor_parallel": 2}),
    ("fsdp 4", 4, {"kind": "fsdp"}),
    ("tp 2 × fsdp 2", 4, {"kind": "fsdp", "tensor_parallel": 2}),
    ("hsdp 2 × 2", 4, {"kind": "fsdp", "data_parallel_replicate": 2}),
]


def measure(
    name: str, workers: int, strategy: dict[str, Any], *, steps: int, root: Path
) -> dict[str, Any]:
    out = root / name.split(" (")[0].replace(" ", "_").replace(",", "")
    replicas = workers // strategy.get("tensor_parallel", 1)
    raw: dict[str, Any] = {
        "name": "mesh-layouts",
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
        "data": {"vocab_size": 64, "eval_samples": 0},
        "train": {"steps": steps, "global_batch_size": 16, "micro_batch_size": 16 // replicas},
        "optim": {"warmup_steps": 2, "weight_decay": 0.1},
        "strategy": strategy,
        "scaling": {"num_workers": workers},
        "checkpoint": {"storage_path": str(out / "runs")},
        "log": {"every_steps": steps},
    }
    if strategy["kind"] == "zero":  # partition every parameter, however small
        raw["deepspeed"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    cfg = config_from_dict(raw)
    summary = run_processes(cfg, world_size=workers, out_dir=out)
    held = summary["model_state_bytes"]
    psi = summary["params"]
    if strategy["kind"] == "zero":
        formula = zero_model_state_formula(psi, workers, strategy["stage"], "fp32")
    else:
        formula = model_state(cfg, psi).per_worker
    return {
        "layout": name,
        "workers": workers,
        "weights": torch.load(out / "model.pt", weights_only=True),
        "params": held["params"],
        "grads": held["grads"],
        "optimizer": held["optimizer"],
        "measured": sum(held.values()),
        "formula": formula,
        "tokens_per_s": summary["tokens_per_s"],
        "comm_bytes_per_step": summary["comm_bytes_per_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/mesh_layouts.json"))
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache/torch_extensions"))
    with tempfile.TemporaryDirectory(prefix="trainstack-mesh-") as tmp:
        rows = [measure(n, w, s, steps=args.steps, root=Path(tmp)) for n, w, s in LAYOUTS]
    reference = rows[0]["weights"]
    for row in rows:
        weights = row.pop("weights")
        row["max_diff"] = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(
        "| layout | workers | max abs diff vs 1 process | params | grads | optimizer "
        "| measured / formula | bytes sent / step | tokens/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['layout']} | {r['workers']} | {r['max_diff']:.1e} | {r['params']:,} | "
            f"{r['grads']:,} | {r['optimizer']:,} | {r['measured'] / r['formula']:.3f} | "
            f"{r['comm_bytes_per_step']:,} | {r['tokens_per_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
