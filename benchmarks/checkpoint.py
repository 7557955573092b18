"""What checkpoints cost a run: none, synchronous, and in the background.

A GPT of about 100M parameters whose training state (weights, gradients, AdamW's two
moments) is about 1.6 GB, trained on 2 gloo processes (no Ray: the figure is the
checkpoint's, not the worker group's) under each layout, with a checkpoint every
`--every` steps (each about 1.2 GB: weights and optimizer state) or none. For each run:

    throughput     steps x tokens per step / the loop's wall time (saves included)
    vs none        that throughput over the same layout's run without checkpoints
    stall/save     the loop's wall time beyond the run without checkpoints, per save in
                   the loop (the saver's own count of its training-thread seconds, the
                   state, host copy and any wait for the save before, is beside it)
    write/save     seconds per save of writing, hashing and committing

The same model, micro-batch and steps for every row, in one invocation.

    python benchmarks/checkpoint.py                      # ddp, zero2, fsdp x none/sync/async
    python benchmarks/checkpoint.py --layouts ddp --steps 20 --every 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "zero2": {"kind": "zero", "stage": 2},
    "fsdp": {"kind": "fsdp"},
}
MODES = ("none", "sync", "async")


def spec(storage: Path, *, layout: str, mode: str, steps: int, every: int) -> dict[str, Any]:
    return {
        "name": f"ckpt-{layout}-{mode}",
        # 14 x 12 x 768^2 ~ 99M parameters: 0.40 GB of fp32 weights, 1.6 GB with their
        # gradients and AdamW's moments.
        "model": {"kind": "gpt", "n_layer": 14, "n_head": 12, "n_embd": 768, "block_size": 32},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 0},
        "train": {"steps": steps, "global_batch_size": 2, "micro_batch_size": 1},
        "optim": {"lr": 1e-4, "warmup_steps": 2},
        "strategy": LAYOUTS[layout],
        "scaling": {"num_workers": 2},
        "checkpoint": {
            "every_steps": 0 if mode == "none" else every,
            "keep": 1,
            "storage_path": str(storage),
            "async_save": mode == "async",
        },
        "log": {"every_steps": every},
    }


def measure(layout: str, mode: str, *, steps: int, every: int) -> dict[str, Any]:
    storage = Path(tempfile.mkdtemp(prefix="trainstack-ckpt-bench-", dir=ROOT / ".cache"))
    try:
        cfg = config_from_dict(
            spec(storage / "runs", layout=layout, mode=mode, steps=steps, every=every)
        )
        began = time.perf_counter()
        summary = run_processes(cfg, world_size=2, out_dir=storage / "out")
        wall = time.perf_counter() - began
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    tokens = steps * cfg.train.global_batch_size * cfg.tokens_per_sample
    saves = summary["checkpoint_saves"]  # the loop's: the final one is not in them
    return {
        "layout": layout,
        "mode": mode,
        "steps": steps,
        "every": every,
        "saves": saves,
        "train_s": summary["train_s"],
        "tokens_per_s": tokens / summary["train_s"],
        "saver_stall_per_save_s": summary["checkpoint_stall_s"] / saves if saves else 0.0,
        "write_per_save_s": summary["checkpoint_write_s"] / saves if saves else 0.0,
        "wall_s": wall,
        "model_state_bytes": summary["model_state_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/checkpoint.json"))
    args = parser.parse_args()
    (ROOT / ".cache").mkdir(exist_ok=True)
    rows = []
    print(f"{'layout':<7}{'mode':<7}{'tok/s':>9}{'vs none':>9}{'stall/save':>12}{'write/save':>12}")
    for layout in args.layouts:
        base = None
        for mode in args.modes:
            row = measure(layout, mode, steps=args.steps, every=args.every)
            if mode == "none":
                base = row
            row["vs_none"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
            # the loop's wall time beyond the run without checkpoints, per save in it
            row["stall_per_save_s"] = (
                (row["train_s"] - base["train_s"]) / row["saves"] if base and row["saves"] else 0.0
            )
            rows.append(row)
            versus = f"{row['vs_none']:.3f}" if row["vs_none"] is not None else "-"
            print(
                f"{layout:<7}{mode:<7}{row['tokens_per_s']:>9.1f}{versus:>9}"
                f"{row['stall_per_save_s']:>11.2f}s{row['write_per_save_s']:>11.2f}s",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
