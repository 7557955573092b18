"""Mixture of experts on the demo corpus: dense against MoE at equal active parameters,
the all-to-all bytes against the formula, and time per step for expert_parallel 1/2/4.

(a) quality: the demo's GPT (order-2 Markov language, vocabulary 32) dense, and with
    every block's MLP replaced by E experts of the dense MLP's width / k with top-k
    routing (the same active parameters per token, E/k times the expert parameters),
    one process each, the same steps and tokens; held-out loss against the floor.
(b) bytes: each MoE run under `strategy.expert_parallel: P` on P gloo processes
    reports what each rank sent other ranks by all-to-all per step
    (`moe_a2a_bytes_per_step`); with even routing that is, per MoE block and micro-
    batch of N tokens, 4 · N · k · (P − 1)/P · d elements (dispatch and combine, each
    forward and backward).
(c) speed: the median step time of those runs.

    python benchmarks/moe.py                       # about 3 minutes on 2 cores
    python benchmarks/moe.py --steps 600 --eps 1 2 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes


def spec(storage: Path, *, steps: int, experts: int, top_k: int, ep: int) -> dict[str, Any]:
    d = 64
    moe = {"experts": experts, "top_k": top_k, "expert_hidden": 4 * d // top_k} if experts else {}
    return {
        "name": f"moe-e{experts}-ep{ep}",
        "model": {
            "kind": "gpt",
            "n_layer": 2,
            "n_head": 2,
            "n_embd": d,
            "block_size": 64,
            "moe": moe,
        },
        "data": {
            "kind": "markov",
            "vocab_size": 32,
            "order": 2,
            "concentration": 0.2,
            "seed": 1234,
            "eval_samples": 256,
        },
        "train": {"steps": steps, "global_batch_size": 64, "micro_batch_size": 64 // ep},
        "optim": {"lr": 3e-3, "warmup_steps": 20, "grad_clip": 1.0, "weight_decay": 0.0},
        "strategy": {"kind": "ddp", "expert_parallel": ep},
        "scaling": {"num_workers": ep},
        "log": {"every_steps": steps, "progress": "quiet"},
        "checkpoint": {"storage_path": str(storage)},
    }


def formula_bytes(*, tokens: int, top_k: int, ep: int, d: int, blocks: int) -> float:
    """All-to-all bytes one rank sends per step with even routing (fp32)."""
    return 4 * tokens * top_k * (ep - 1) / ep * d * 4 * blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=None, help="append JSON rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(0, 1)] + [(args.experts, ep) for ep in args.eps]
        for experts, ep in runs:
            raw = spec(
                Path(tmp) / f"{experts}-{ep}",
                steps=args.steps,
                experts=experts,
                top_k=args.top_k,
                ep=ep,
            )
            summary = run_processes(
                config_from_dict(raw), world_size=ep, out_dir=Path(tmp) / f"out-{experts}-{ep}"
            )
            tokens = 64 // ep * 64  # one micro-batch per rank per step
            row = {
                "model": "dense" if not experts else f"moe E={experts} k={args.top_k}",
                "expert_parallel": ep,
                "params": summary["params"],
                "eval_loss": summary["eval_loss"],
                "floor": summary["entropy_floor"],
                "step_time_s": summary["step_time_p50_s"],
                "a2a_bytes_per_step": summary.get("moe_a2a_bytes_per_step_run"),
                "a2a_formula": formula_bytes(tokens=tokens, top_k=args.top_k, ep=ep, d=64, blocks=2)
                if experts
                else None,
                "load_cv": summary.get("moe_load_cv"),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
