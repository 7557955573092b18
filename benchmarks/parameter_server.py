"""Parameter server under a straggler: async, SSP and BSP, and a single-actor peer.

On one local Ray (CPU), N workers (default 4) train the demo GPT (2 layers, 2 heads,
width 64, 64-token samples of the order-2 Markov language of jobs/configs/demo.yaml;
global batch 64, so 16 samples per worker step) against S shards (default 2), with
the optimizer settings of jobs/configs/ps.yaml (AdamW, lr 3e-3, inverse staleness lr
with a = 0.5). Each run is cut by a wall-clock budget (`time_budget_s`; `train.steps`
is set far beyond it). For each of async, ssp s=2, ssp s=8 and bsp it runs once with
equal workers and once with worker 0 made 4× slower (`faults.slow_rank: 0,
slow_factor: 4`: that worker sleeps 3× its compute time after each gradient), and
reports from the run's summary:

- updates/s: model updates per second, `summary["ps"]["updates_per_s"]` (async, ssp:
  one per push; bsp: one per round of N pushes);
- samples/s, the held-out loss of the parameters at the budget, staleness of the
  pushes (in shard updates) mean / p99;
- the straggler run's updates/s over the equal-workers run's, per mode;
- where a worker's wall clock goes per step (`summary["ps"]["worker_seconds"]`:
  compute, straggler sleep, push, pull, ssp/bsp wait), and the compute-only ceiling
  (cores / one step's forward + backward timed alone on one thread).

The peer is the classic single-actor parameter server of Ray's documentation
("Parameter Server" example, asynchronous variant): one `ParameterServer` actor holds
all weights and the optimizer, `apply_gradients(*gradients)` sums the gradients it is
given, steps and returns the weights (a dict of numpy arrays); `DataWorker` actors
`compute_gradients(weights)`; the driver `ray.wait`s for any gradient, passes it to
`apply_gradients` and hands the returned weights to that worker's next
`compute_gradients`. Here it trains the same model on the same data (worker w reads
rank w of the same `ShardedBatches`) with the same AdamW and lr schedule (its warm-up
counted in updates / N), no staleness lr, and is evaluated the same way as the
trainstack driver (`_held_out`).

All actors share this machine's cores: on a 2-core box the 4 workers (Ray is told
max(4, N) CPUs, one per worker, one torch thread each), the shards, the clock board
and the driver time-slice 2 cores, so throughput is CPU-bound and a straggler's sleep
hands its core to the others.

With `--two-level` it instead runs a simulated cluster of 2 training nodes × 2
workers and a service node holding the shards (`ray.cluster_utils.Cluster`, on this
machine's cores), each of async, ssp s=2 and bsp flat (workers push to the shards),
through a local server per node sending every worker step (`sync_every` 1), and for
async and ssp every 4 steps, and reports the bytes the global shards move per step
(pushes in, pulls out: `ps.global_bytes_per_step`), updates/s, samples/s, the loss at
the budget and the end-to-end clock lag.

    python benchmarks/parameter_server.py
    python benchmarks/parameter_server.py --budget 20 --json ps.json
    python benchmarks/parameter_server.py --workers 8 --shards 4 --no-peer-straggler
    python benchmarks/parameter_server.py --two-level --budget 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from trainstack.config import config_from_dict
from trainstack.data import build_corpus
from trainstack.data.sharding import ShardedBatches
from trainstack.models import build_model
from trainstack.optim import build_optimizer, lr_multiplier, scaled_lr
from trainstack.runtime.ps_job import _held_out, run_parameter_server


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, written out here as a plain-PyTorch reference."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODES: list[tuple[str, str, int]] = [
    ("async", "async", 0),
    ("ssp s=2", "ssp", 2),
    ("ssp s=8", "ssp", 8),
    ("bsp", "bsp", 0),
]
STEPS = 1_000_000  # far beyond any budget: the budget ends every run
SLOW_FACTOR = 4.0


def spec(
    storage: str,
    *,
    workers: int,
    shards: int,
    consistency: str,
    bound: int,
    straggler: bool,
    batch: int,
) -> dict[str, Any]:
    return {
        "name": "ps-bench",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {
            "kind": "markov",
            "vocab_size": 32,
            "order": 2,
            "concentration": 0.2,
            "seed": 1234,
            "eval_samples": 256,
        },
        "train": {
            "steps": STEPS,
            "global_batch_size": batch,
            "micro_batch_size": batch // workers,
            "seed": 0,
        },
        "optim": {"kind": "adamw", "lr": 3.0e-3, "warmup_steps": 20, "grad_clip": 0},
        "strategy": {
            "kind": "ps",
            "num_shards": shards,
            "consistency": consistency,
            "staleness_bound": bound,
            "staleness_lr": "inverse",
            "staleness_alpha": 0.5,
            "pull_every": 1,
            "checkpoint_every_updates": 200,
        },
        "scaling": {"num_workers": workers, "cpus_per_worker": 1},
        "checkpoint": {"storage_path": storage},
        "log": {"every_steps": 1000, "progress": "quiet"},
        "faults": {"slow_rank": 0, "slow_factor": SLOW_FACTOR} if straggler else {},
    }


# ---- trainstack ------------------------------------------------------------------------


def measure_trainstack(
    label: str, consistency: str, bound: int, *, straggler: bool, args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainstack-psbench-") as storage:
        cfg = config_from_dict(
            spec(
                storage,
                workers=args.workers,
                shards=args.shards,
                consistency=consistency,
                bound=bound,
                straggler=straggler,
                batch=args.batch,
            )
        )
        start = time.perf_counter()
        summary = run_parameter_server(cfg, time_budget_s=args.budget)
        wall = time.perf_counter() - start
    ps = summary["ps"]
    seconds = {
        key: [round(s[key], 2) for s in ps["worker_seconds"]] for key in ps["worker_seconds"][0]
    }
    row = {
        "system": "trainstack",
        "mode": label,
        "straggler": straggler,
        "updates": ps["updates"],
        "updates_per_s": ps["updates_per_s"],
        "pushes": ps["pushes"] // ps["num_shards"],
        "samples_per_s": summary["samples_per_s"],
        "loss": summary["final_loss"],
        "entropy_floor": summary["entropy_floor"],
        "staleness_mean": ps["staleness_mean"],
        "staleness_p99": ps["staleness_p99"],
        "staleness_max": ps["staleness_max"],
        "clock_gap_max": ps["clock_gap_max"],
        "waits": ps["waits"],
        "wait_s": ps["wait_s"],
        "train_s": summary["train_s"],
        "run_wall_s": wall,
        "worker_clocks": ps["worker_clocks"],
        "worker_steps_per_s": ps["worker_steps_per_s"],
        "worker_seconds": seconds,
    }
    print(json.dumps(row), flush=True)
    return row


# ---- the peer: Ray's documented single-actor parameter server ---------------------------


class ParameterServer:
    """One actor holding every weight and the optimizer (Ray docs' ParameterServer)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.cfg = cfg = config_from_dict(raw)
        torch.set_num_threads(1)
        self.model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
        self.params = dict(self.model.named_parameters())  # the tied head once
        self.base_lr = scaled_lr(cfg.optim, data_parallel_size=cfg.scaling.num_workers)
        self.optimizer = build_optimizer(self.model, cfg.optim, lr=self.base_lr)
        self.updates = 0
        self.apply_s = 0.0

    def apply_gradients(self, *gradients: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        summed = {name: np.stack([g[name] for g in gradients]).sum(axis=0) for name in self.params}
        clock = self.updates // self.cfg.scaling.num_workers  # the workers' mean clock
        lr = self.base_lr * lr_multiplier(clock, self.cfg.optim, total_steps=self.cfg.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        for name, p in self.params.items():
            p.grad = torch.from_numpy(summed[name])
        self.optimizer.step()
        self.updates += 1
        self.apply_s += time.perf_counter() - start
        return self.get_weights()

    def get_weights(self) -> dict[str, np.ndarray]:
        return {name: p.detach().numpy() for name, p in self.params.items()}

    def report(self) -> dict[str, Any]:
        return {"updates": self.updates, "apply_s": self.apply_s}


class DataWorker:
    """Computes a gradient on its share of the next global batch from given weights."""

    def __init__(self, raw: dict[str, Any], index: int, slow_factor: float) -> None:
        cfg = config_from_dict(raw)
        torch.set_num_threads(1)
        self.model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
        self.params = dict(self.model.named_parameters())
        self.batches = ShardedBatches.for_job(
            cfg, build_corpus(cfg.data), rank=index, world_size=cfg.scaling.num_workers
        )
        self.slow_factor = slow_factor
        self.seconds = {"set_weights": 0.0, "compute": 0.0, "slow": 0.0}

    def compute_gradients(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = time.perf_counter()
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(torch.from_numpy(np.array(weights[name], copy=True)))
        self.seconds["set_weights"] += time.perf_counter() - t
        t = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        micro_batches = self.batches.next_step()
        for x, y in micro_batches:
            (next_token_loss(self.model(x), y) / len(micro_batches)).backward()
        compute = time.perf_counter() - t
        self.seconds["compute"] += compute
        if self.slow_factor > 1:  # a slower device, as faults.slow_factor does in trainstack
            delay = (self.slow_factor - 1.0) * compute
            time.sleep(delay)
            self.seconds["slow"] += delay
        return {name: p.grad.numpy() for name, p in self.params.items()}

    def report(self) -> dict[str, float]:
        return self.seconds


def unstored_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's async spec for code that stores nothing (the peer, the ceiling)."""
    return spec(
        "unused",
        workers=args.workers,
        shards=args.shards,
        consistency="async",
        bound=0,
        straggler=False,
        batch=args.batch,
    )


def measure_peer(*, straggler: bool, args: argparse.Namespace) -> dict[str, Any]:
    raw = unstored_spec(args)
    cfg = config_from_dict(raw)
    server: Any = ray.remote(ParameterServer).options(num_cpus=0).remote(raw)
    workers: list[Any] = [
        ray.remote(DataWorker)
        .options(num_cpus=cfg.scaling.cpus_per_worker)
        .remote(raw, w, SLOW_FACTOR if straggler and w == 0 else 1.0)
        for w in range(args.workers)
    ]
    ray.get([a.__ray_ready__.remote() for a in [server, *workers]])

    # The documentation's asynchronous loop: apply each gradient as it arrives and give
    # its worker the weights that update returned.
    start = time.perf_counter()
    current = server.get_weights.remote()
    gradients = {worker.compute_gradients.remote(current): (worker, 0) for worker in workers}
    applied = 0  # updates submitted to the server, which applies them in this order
    staleness: list[int] = []
    clocks = [0] * args.workers
    while time.perf_counter() - start < args.budget:
        ready, _ = ray.wait(list(gradients), num_returns=1, timeout=0.5)
        if not ready:
            continue
        worker, based_on = gradients.pop(ready[0])
        staleness.append(applied - based_on)
        clocks[workers.index(worker)] += 1
        current = server.apply_gradients.remote(*[ready[0]])
        applied += 1
        gradients[worker.compute_gradients.remote(current)] = (worker, applied)
    final = ray.get(current)
    train_s = time.perf_counter() - start
    server_report = ray.get(server.report.remote())
    seconds = ray.get([w.report.remote() for w in workers])
    for actor in [server, *workers]:
        ray.kill(actor)

    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.array(final[name], copy=True)))
    updates = server_report["updates"]
    per_worker = cfg.train.global_batch_size // cfg.scaling.num_workers
    stale = np.array(staleness, dtype=np.int64)
    row = {
        "system": "peer",
        "mode": "async",
        "straggler": straggler,
        "updates": updates,
        "updates_per_s": updates / train_s,
        "pushes": updates,
        "samples_per_s": updates * per_worker / train_s,
        "loss": _held_out(cfg, model)["eval_loss"],
        "entropy_floor": build_corpus(cfg.data).loss_floor(cfg.model.block_size),
        "staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "staleness_p99": float(np.percentile(stale, 99)) if stale.size else 0.0,
        "staleness_max": int(stale.max()) if stale.size else 0,
        "train_s": train_s,
        "server_apply_s": server_report["apply_s"],
        "worker_clocks": clocks,
        "worker_seconds": {
            key: [round(s[key], 2) for s in seconds] for key in ("set_weights", "compute", "slow")
        },
    }
    print(json.dumps(row), flush=True)
    return row


def compute_ms(args: argparse.Namespace) -> float:
    """One worker step's forward + backward, alone on one thread (no Ray), in ms."""
    raw = unstored_spec(args)
    cfg = config_from_dict(raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    batches = ShardedBatches.for_job(
        cfg, build_corpus(cfg.data), rank=0, world_size=cfg.scaling.num_workers
    )
    times = []
    for _ in range(30):
        micro_batches = batches.next_step()
        t = time.perf_counter()
        model.zero_grad(set_to_none=True)
        for x, y in micro_batches:
            (next_token_loss(model(x), y) / len(micro_batches)).backward()
        times.append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return 1e3 * statistics.median(times[10:])


# ---- report ----------------------------------------------------------------------------


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each straggler row's updates/s over its equal-workers row's."""
    equal = {(r["system"], r["mode"]): r for r in rows if not r["straggler"]}
    for r in rows:
        base = equal.get((r["system"], r["mode"]))
        r["vs_equal"] = (
            r["updates_per_s"] / base["updates_per_s"]
            if base is not None and base["updates_per_s"]
            else None
        )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | straggler | updates/s | samples/s | loss at budget | staleness mean / p99 "
        "| vs equal-workers throughput |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["mode"] if r["system"] == "trainstack" else f"peer (Ray docs PS) {r['mode']}"
        strag = f"worker 0 × {SLOW_FACTOR:g}" if r["straggler"] else "none"
        ratio = f"{r['vs_equal']:.2f}×" if r["vs_equal"] is not None else "—"
        lines.append(
            f"| {name} | {strag} | {r['updates_per_s']:.1f} | {r['samples_per_s']:.0f} "
            f"| {r['loss']:.3f} | {r['staleness_mean']:.2f} / {r['staleness_p99']:.0f} "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]]) -> str:
    """Milliseconds per step of a worker: mean over workers (the straggler included),
    except `slow`, the straggler's own sleep per step."""
    keys = ("compute", "slow", "push", "pull", "wait", "set_weights")
    lines = [
        "| mode | straggler | " + " | ".join(keys) + " | server apply / update |",
        "|---|---|" + "---|" * len(keys) + "---|",
    ]
    for r in rows:
        name = r["mode"] if r["system"] == "trainstack" else f"peer (Ray docs PS) {r['mode']}"
        clocks = r["worker_clocks"]
        cells = []
        for key in keys:
            per_worker = r["worker_seconds"].get(key)
            if per_worker is None:
                cells.append("—")
                continue
            ms = [1e3 * s / c for s, c in zip(per_worker, clocks, strict=True) if c]
            if not ms:
                cells.append("—")
            elif key == "slow":  # the straggler's own sleep per step
                cells.append(f"{max(ms):.1f}")
            else:
                cells.append(f"{statistics.fmean(ms):.1f}")
        apply = r.get("server_apply_s")
        server = f"{1e3 * apply / r['updates']:.1f}" if apply is not None else "—"
        strag = "worker 0" if r["straggler"] else "none"
        lines.append(f"| {name} | {strag} | " + " | ".join(cells) + f" | {server} |")
    return "\n".join(lines)


def find(rows: list[dict[str, Any]], system: str, mode: str, straggler: bool) -> dict[str, Any]:
    [row] = [
        r
        for r in rows
        if r["system"].startswith(system) and r["mode"] == mode and r["straggler"] == straggler
    ]
    return row


def goals(rows: list[dict[str, Any]]) -> list[str]:
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out = []
    ts_async = find(rows, "trainstack", "async", False)
    peer = find(rows, "peer", "async", False)
    speedup = ts_async["updates_per_s"] / peer["updates_per_s"]
    out.append(
        f"trainstack async updates/s ÷ peer updates/s (equal workers): "
        f"{ts_async['updates_per_s']:.1f} / {peer['updates_per_s']:.1f} = {speedup:.2f}× "
        f"(goal ≥ 3×: {verdict(speedup >= 3)})"
    )
    a = find(rows, "trainstack", "async", True)["vs_equal"]
    out.append(
        f"async with the straggler keeps {a:.2f}× its no-straggler throughput "
        f"(goal ≥ 0.9×: {verdict(a >= 0.9)})"
    )
    b = find(rows, "trainstack", "bsp", True)["vs_equal"]
    out.append(
        f"bsp with the straggler falls to {b:.2f}× (goal ~0.25–0.35×: {verdict(0.25 <= b <= 0.35)})"
    )
    return out


TWO_LEVEL: list[tuple[str, str, int, str, int]] = [
    # label, consistency, staleness bound, local_servers, sync_every
    ("async flat", "async", 0, "none", 1),
    ("async per node, sync 1", "async", 0, "per_node", 1),
    ("async per node, sync 4", "async", 0, "per_node", 4),
    ("ssp s=2 flat", "ssp", 2, "none", 1),
    ("ssp s=2 per node, sync 1", "ssp", 2, "per_node", 1),
    ("ssp s=2 per node, sync 4", "ssp", 2, "per_node", 4),
    ("bsp flat", "bsp", 0, "none", 1),
    ("bsp per node", "bsp", 0, "per_node", 1),
]


def two_level(args: argparse.Namespace) -> None:
    """Flat against local servers per node on a simulated 2 nodes × 2 workers."""
    from ray.cluster_utils import Cluster

    node = "bench_worker_node"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={node: 2})
    cluster.add_node(num_cpus=2)  # the shards' (one CPU each), where no worker trains
    ray.init(address=cluster.address, log_to_driver=False)
    rows = []
    try:
        for label, consistency, bound, local, every in TWO_LEVEL:
            with tempfile.TemporaryDirectory(prefix="trainstack-psbench-") as storage:
                raw = spec(
                    storage,
                    workers=4,
                    shards=args.shards,
                    consistency=consistency,
                    bound=bound,
                    straggler=False,
                    batch=args.batch,
                )
                raw["strategy"].update(local_servers=local, sync_every=every)
                raw["scaling"]["resources_per_worker"] = {node: 1}
                summary = run_parameter_server(config_from_dict(raw), time_budget_s=args.budget)
            ps = summary["ps"]
            row = {
                "mode": label,
                "global_bytes_per_step": ps["global_bytes_per_step"],
                "updates_per_s": ps["updates_per_s"],
                "samples_per_s": summary["samples_per_s"],
                "loss": summary["final_loss"],
                "clock_lag_max": ps["clock_lag_max"],
                "params": summary["params"],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(
        f"\n2 nodes × 2 workers, {args.shards} shards on a service node, global batch "
        f"{args.batch}, budget {args.budget:g} s per run, {rows[0]['params']:,} parameters "
        f"({rows[0]['params'] * 4:,} bytes in fp32)\n"
    )
    print("| run | global-shard bytes / step | updates/s | samples/s | loss | clock lag max |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['global_bytes_per_step']:,.0f} | {r['updates_per_s']:.1f} "
            f"| {r['samples_per_s']:.0f} | {r['loss']:.3f} | {r['clock_lag_max']} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch (samples per clock)")
    parser.add_argument("--budget", type=float, default=25.0, help="seconds of training per run")
    parser.add_argument(
        "--no-peer-straggler",
        dest="peer_straggler",
        action="store_false",
        help="run the peer with equal workers only",
    )
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument(
        "--two-level",
        action="store_true",
        help="flat vs local servers on a simulated 2 nodes × 2 workers",
    )
    args = parser.parse_args()
    if args.batch % args.workers:
        parser.error(f"--batch {args.batch} is not a multiple of --workers {args.workers}")

    if args.two_level:
        two_level(args)
        return
    step_ms = compute_ms(args)
    ray.init(num_cpus=max(4, args.workers), include_dashboard=False, log_to_driver=False)
    begin = time.perf_counter()
    rows = [
        measure_trainstack(label, consistency, bound, straggler=straggler, args=args)
        for label, consistency, bound in MODES
        for straggler in (False, True)
    ]
    rows.append(measure_peer(straggler=False, args=args))
    if args.peer_straggler:
        rows.append(measure_peer(straggler=True, args=args))
    total = time.perf_counter() - begin
    ray.shutdown()

    add_ratios(rows)
    floor = statistics.fmean(r["entropy_floor"] for r in rows)
    print(
        f"\n{os.cpu_count()} CPUs, {args.workers} workers, {args.shards} shards, "
        f"global batch {args.batch}, budget {args.budget:g} s per run "
        f"(entropy floor {floor:.3f}; all runs {total:.0f} s)\n"
    )
    print(table(rows))
    print(
        "\nMilliseconds per worker step (wall clock, mean over workers; slow: the straggler's):\n"
    )
    print(time_table(rows))
    print()
    for line in goals(rows):
        print(f"- {line}")
    cores = os.cpu_count() or 1
    ceiling = cores / step_ms * 1e3
    print(
        f"- compute-only ceiling: {cores} cores / {step_ms:.1f} ms per worker step "
        f"(forward + backward alone, one thread) = {ceiling:.0f} async updates/s"
    )
    if args.json:
        meta = vars(args) | {"json": str(args.json), "cpus": cores, "compute_ms": step_ms}
        args.json.write_text(json.dumps({"args": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
