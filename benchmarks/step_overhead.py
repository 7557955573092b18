"""Each layout's per-step CPU work against a hand-written loop: one process, one tiny GPT.

On one device nothing is communicated, so what a layout adds to a step over the plain
loop is its own bookkeeping: DDP's hooks and buckets, FSDP2's pre-forward hooks and
DTensor dispatch, ZeRO's per-parameter gradient hooks and bucket copies, trainstack's
loop. With a model this small the arithmetic is a few milliseconds and those costs
show; on a GPU the same CPU time is what keeps a small model from the kernels' speed.

(a) raw: the loop written out below: the same GPT, batches, AdamW, clipping and LR
    schedule, `loss.backward()` and `optimizer.step()`, nothing else;
(b) trainstack: `run_processes` with one process (in this one, no Ray) under each
    `--layouts` entry.
Reported per layout: the median step time after `--warmup` steps, its ratio to the raw
loop's, and the milliseconds it adds. Runs alternate raw and layouts `--repeats` times,
so drift on a busy machine falls on both. A JSON row per run goes to `--out`.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --layouts ddp fsdp --steps 80 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform as host
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainstack.config import JobConfig, config_from_dict
from trainstack.data import build_corpus
from trainstack.data.sharding import ShardedBatches
from trainstack.models import build_model
from trainstack.optim import build_optimizer, build_scheduler
from trainstack.runtime.gloo_processes import run_processes

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "fsdp": {"kind": "fsdp"},
    "zero1": {"kind": "zero", "stage": 1},
    "zero2": {"kind": "zero", "stage": 2},
    "zero3": {"kind": "zero", "stage": 3},
}


def spec(*, steps: int, strategy: dict[str, Any], storage: str) -> dict[str, Any]:
    return {
        "name": "step-overhead",
        # Four blocks (the per-parameter and per-module costs of a real model's
        # structure), arithmetic of about a millisecond: what is left is bookkeeping.
        "model": {"kind": "gpt", "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 64, "eval_samples": 0},
        "train": {"steps": steps, "global_batch_size": 4, "micro_batch_size": 4},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "strategy": strategy,
        "scaling": {"num_workers": 1, "cpus_per_worker": 1},
        "checkpoint": {"storage_path": storage, "every_steps": 0},
        "log": {"every_steps": 1_000_000, "progress": "quiet"},
    }


def raw_step_times(cfg: JobConfig) -> list[float]:
    """The plain loop: what one engineer writes for one device."""
    torch.set_num_threads(cfg.scaling.torch_threads)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optim, lr=cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=cfg.train.steps)
    batches = ShardedBatches.for_job(cfg, build_corpus(cfg.data), rank=0, world_size=1)
    times = []
    for _ in range(cfg.train.steps):
        start = time.perf_counter()
        for x, y in batches.next_step():
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] or times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/step_overhead.jsonl"))
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps={args.steps} must be more than --warmup={args.warmup}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    medians: dict[str, list[float]] = {"raw": [], **{name: [] for name in args.layouts}}
    with (
        tempfile.TemporaryDirectory(prefix="trainstack-step-overhead-") as storage,
        out.open("a") as rows,
    ):
        for repeat in range(args.repeats):
            for name in ["raw", *args.layouts]:
                strategy = LAYOUTS.get(name, {"kind": "ddp"})
                raw = spec(steps=args.steps, strategy=strategy, storage=f"{storage}/{repeat}")
                cfg = config_from_dict({**raw, "name": f"{name}-{repeat}"})
                if name == "raw":
                    step_s = median_after(raw_step_times(cfg), args.warmup)
                else:
                    summary = run_processes(
                        cfg, world_size=1, out_dir=Path(storage) / f"out-{name}-{repeat}"
                    )
                    step_s = float(summary["step_time_p50_s"])
                medians[name].append(step_s)
                row = {"layout": name, "repeat": repeat, "step_time_p50_s": step_s}
                rows.write(json.dumps({**row, "cpu": host.processor() or host.machine()}) + "\n")
                print(f"{name:6s} repeat {repeat}: {1e3 * step_s:7.2f} ms a step", flush=True)
    raw_s = statistics.median(medians["raw"])
    print("\n| layout | ms / step | vs raw | added ms |\n| --- | ---: | ---: | ---: |")
    print(f"| raw loop | {1e3 * raw_s:.2f} | 1.000 | |")
    for name in args.layouts:
        step_s = statistics.median(medians[name])
        print(
            f"| {name} | {1e3 * step_s:.2f} | {raw_s / step_s:.3f} | "
            f"{1e3 * (step_s - raw_s):+.2f} |"
        )


if __name__ == "__main__":
    main()
