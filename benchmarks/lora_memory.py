"""Model-state memory per rank of a LoRA fine-tune against a full fine-tune of the same
model, measured and planned, with throughput: DDP, ZeRO-2 and FSDP on N CPU workers
(gloo processes).

Measured bytes are the strategy's `model_state_bytes()` on rank 0 (parameters,
gradients, optimizer state: the tensors it really holds); planned bytes are the
planner's `model_state_bytes` (`planner/memory.py`, the one pre-flight and `trainstack
plan` use) with the trainable count `trainable_parameter_count` gives.

    python benchmarks/lora_memory.py --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from trainstack.config import config_from_dict
from trainstack.planner.layouts import Layout
from trainstack.planner.memory import model_state_bytes
from trainstack.planner.workload import state_element_bytes, trainable_parameter_count
from trainstack.runtime.gloo_processes import run_processes

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {"kind": "ddp"}),
    ("zero-2", {"kind": "zero", "stage": 2}),
    ("fsdp", {"kind": "fsdp"}),
]


def measure(
    name: str, strategy: dict[str, Any], *, rank: int, workers: int, steps: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainstack-lora-") as storage:
        raw: dict[str, Any] = {
            "name": "lora-memory",
            "model": {
                "n_layer": 4,
                "n_head": 4,
                "n_embd": 256,
                "block_size": 64,
                "lora": {"rank": rank, "target_modules": ["q_proj", "v_proj"]},
            },
            "data": {"vocab_size": 64, "eval_samples": 0},
            "train": {"steps": steps, "global_batch_size": 8 * workers, "micro_batch_size": 4},
            "optim": {"warmup_steps": 2},
            "strategy": strategy,
            "scaling": {"num_workers": workers},
            "checkpoint": {"storage_path": storage},
            "log": {"every_steps": steps},
        }
        cfg = config_from_dict(raw)
        summary = run_processes(cfg, world_size=workers, out_dir=Path(storage))
    held = summary["model_state_bytes"]
    element, optimizer, weight = state_element_bytes(cfg)
    layout = Layout(kind=strategy["kind"], devices=workers, stage=strategy.get("stage", 0))
    trainable = trainable_parameter_count(cfg)
    planned = model_state_bytes(
        layout,
        params=summary["params"],
        element_bytes=element,
        optimizer_bytes=optimizer,
        weight_bytes=weight,
        trainable=trainable,
    )
    return {
        "layout": name,
        "lora_rank": rank,
        "params": summary["params"],
        "trainable": summary["params"] if trainable is None else trainable,
        "measured": sum(held.values()),
        "measured_split": held,
        "planned": planned.total,
        "tokens_per_s": summary["tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=8, help="the LoRA rank")
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/lora_memory.json"))
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache/torch_extensions"))
    rows = [
        measure(name, strategy, rank=rank, workers=args.workers, steps=args.steps)
        for name, strategy in LAYOUTS
        for rank in (0, args.rank)
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(
        f"{'layout':8} {'fine-tune':>10} {'trainable':>10} {'measured':>10} {'planned':>10} "
        f"{'planned/measured':>16} {'tokens/s':>9}"
    )
    for r in rows:
        what = f"LoRA r{r['lora_rank']}" if r["lora_rank"] else "full"
        print(
            f"{r['layout']:8} {what:>10} {r['trainable']:>10,} {r['measured'] / 2**20:>8.2f}Mi "
            f"{r['planned'] / 2**20:>8.2f}Mi {r['planned'] / r['measured']:>16.3f} "
            f"{r['tokens_per_s']:>9,.0f}"
        )


if __name__ == "__main__":
    main()
