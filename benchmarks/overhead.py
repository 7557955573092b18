"""What trainstack costs over plain torch.distributed: same model, data, steps, world size.

(a) trainstack: `run_job` on an embedded local Ray (Ray Train worker group, DDP).
(b) plain: the same training loop written out by hand below, in N processes started
    with torch.multiprocessing over gloo: no Ray, no trainstack runtime.
Steady-state tokens/s excludes the first `WARMUP` steps of each; start-up (process
group or Ray worker group, model build) is reported apart.

    python benchmarks/overhead.py --steps 150 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from trainstack.config import JobConfig, config_from_dict, config_to_dict, load_config
from trainstack.data import build_corpus
from trainstack.data.sharding import ShardedBatches
from trainstack.models import build_model
from trainstack.optim import build_optimizer, build_scheduler
from trainstack.runtime.gloo_processes import rendezvous


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, written out here as a plain-PyTorch reference."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3


def plain_worker(rank: int, spec: dict[str, Any], world: int, init_method: str, out: str) -> None:
    """A hand-written DDP loop: what an engineer would write without a platform."""
    start = time.perf_counter()
    cfg = config_from_dict(spec)
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.strategy.bucket_cap_mb)
    optimizer = build_optimizer(model, cfg.optim, lr=cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=cfg.train.steps)
    batches = ShardedBatches.for_job(cfg, build_corpus(cfg.data), rank=rank, world_size=world)
    startup_s = time.perf_counter() - start
    times = []
    for _ in range(cfg.train.steps):
        t0 = time.perf_counter()
        micro = batches.next_step()
        for i, (x, y) in enumerate(micro):
            if i < len(micro) - 1:
                with ddp.no_sync():
                    (next_token_loss(ddp(x), y) / len(micro)).backward()
            else:
                (next_token_loss(ddp(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "startup_s": startup_s}))
    dist.destroy_process_group()


def run_plain(cfg: JobConfig, out: Path) -> dict[str, float]:
    wall = time.perf_counter()
    world = cfg.scaling.num_workers
    rendezvous_file = rendezvous(out.parent / ".rendezvous")
    mp.spawn(
        plain_worker, args=(config_to_dict(cfg), world, rendezvous_file, str(out)), nprocs=world
    )
    data = json.loads(out.read_text())
    steady = data["times"][WARMUP:]
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    return {
        "tokens_per_s": tokens / statistics.mean(steady),
        "startup_s": data["startup_s"],
        "wall_s": time.perf_counter() - wall,
    }


def run_trainstack(cfg: JobConfig) -> dict[str, float]:
    from trainstack.runtime.launcher import run_job

    with tempfile.TemporaryDirectory(prefix="trainstack-overhead-") as storage:
        fresh = dataclasses.replace(
            cfg, checkpoint=dataclasses.replace(cfg.checkpoint, storage_path=storage)
        )
        summary = run_job(fresh)
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "startup_s": summary["wall_s"] - summary["train_s"],
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "jobs/configs/demo.yaml"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/overhead.json"))
    args = parser.parse_args()
    cfg = load_config(
        args.config,
        [
            f"train.steps={args.steps}",
            f"scaling.num_workers={args.workers}",
            "log.every_steps=1000000",
            "log.progress=quiet",
            "data.eval_samples=0",
            f"checkpoint.storage_path={ROOT / '.cache/bench/runs'}",
        ],
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "trainstack": []}
    for _ in range(args.repeats):  # interleaved, so drift on a busy machine hits both
        rows["plain"].append(run_plain(cfg, out.with_suffix(".plain.json")))
        rows["trainstack"].append(run_trainstack(cfg))
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in rows.items()}
    result = {
        "config": args.config,
        "steps": args.steps,
        "world_size": cfg.scaling.num_workers,
        "cpus": os.cpu_count(),
        "runs": rows,
        "plain_tokens_per_s": best["plain"],
        "trainstack_tokens_per_s": best["trainstack"],
        "ratio": best["trainstack"] / best["plain"],
        "plain_startup_s": min(r["startup_s"] for r in rows["plain"]),
        "trainstack_startup_s": min(r["startup_s"] for r in rows["trainstack"]),
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"{'':12} {'tokens/s':>10} {'start-up s':>11}")
    for name in ("plain", "trainstack"):
        print(f"{name:12} {best[name]:>10,.0f} {result[name + '_startup_s']:>11.1f}")
    print(f"ratio trainstack/plain (steady state): {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
