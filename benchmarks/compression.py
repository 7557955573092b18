"""Gradient compression under DDP: bytes per step, ratio, step time, final loss at a fixed
step budget, and modelled communication time, on N CPU workers (gloo processes).

Bytes are what the hooks really passed to collectives on one rank in one optimizer
step. Communication time is modelled with the α-β model of ring collectives
(`trainstack.compression.modelled_comm_seconds`, α = 10 µs): all-reduce
2(N-1)α + 2(N-1)/N·bytes/β, all-gather (N-1)α + (N-1)·bytes/β, at 1, 10 and
100 Gbit/s. The plot is final loss against bytes per step.

    python benchmarks/compression.py --steps 1000
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from trainstack.compression import COLLECTIVES, modelled_comm_seconds
from trainstack.config import config_from_dict
from trainstack.runtime.local import run_processes

ROOT = Path(__file__).resolve().parents[1]
METHODS: list[tuple[str, dict[str, Any]]] = [
    ("none", {"kind": "none"}),
    ("fp16", {"kind": "fp16"}),
    ("bf16", {"kind": "bf16"}),
    ("topk 1%", {"kind": "topk", "ratio": 0.01}),
    ("randk 10%", {"kind": "randk", "ratio": 0.1}),
    ("qsgd 4-bit", {"kind": "qsgd", "bits": 4}),
    ("sign", {"kind": "sign"}),
    ("powersgd r4", {"kind": "powersgd", "rank": 4}),
]
MODELS: dict[str, dict[str, Any]] = {
    "demo": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
    "larger": {"n_layer": 2, "n_head": 8, "n_embd": 512, "block_size": 32},
}
BANDWIDTHS_GBIT = (1, 10, 100)
LATENCY_S = 10e-6


def measure(model: str, label: str, compression: dict[str, Any], *, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainstack-compress-") as storage:
        raw = {
            "name": "compression",
            "model": MODELS[model],
            "data": {"vocab_size": 32, "order": 2, "concentration": 0.2, "eval_samples": 256},
            "train": {"steps": steps, "global_batch_size": 32, "micro_batch_size": 16},
            "optim": {"lr": 3e-3 if model == "demo" else 1e-3, "warmup_steps": 20},
            "compression": compression,
            "scaling": {"num_workers": 2},
            "checkpoint": {"storage_path": storage},
            "log": {"every_steps": steps},
        }
        s = run_processes(config_from_dict(raw), world_size=2, out_dir=Path(storage))
    sent = s.get("bytes_on_wire") or 0
    collective = COLLECTIVES[compression["kind"]]
    return {
        "model": model,
        "params": s["params"],
        "method": label,
        "bytes_per_step": sent,
        "compression_ratio": s.get("compression_ratio"),
        "step_time_s": s["step_time_s"],
        "final_loss": s["final_loss"],
        "entropy_floor": s["entropy_floor"],
        **{
            f"comm_s_at_{bw}gbit": modelled_comm_seconds(
                kind=collective,
                bytes_per_rank=sent,
                world_size=2,
                bandwidth_gbit=bw,
                latency_s=LATENCY_S,
            )
            for bw in BANDWIDTHS_GBIT
        },
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(6 * len(MODELS), 4.5))
    for ax, model in zip(axes, MODELS, strict=True):
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            ax.scatter(r["bytes_per_step"], r["final_loss"])
            ax.annotate(
                r["method"],
                (r["bytes_per_step"], r["final_loss"]),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.axhline(mine[0]["entropy_floor"], color="grey", linestyle="--", label="entropy floor")
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per rank per step (log scale)")
        ax.set_ylabel("final held-out loss (nats/token)")
        ax.set_title(f"{model} GPT ({mine[0]['params'] / 1e6:.2f} M params), 2 workers")
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--larger-steps", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/compression.json"))
    parser.add_argument("--plot", default=str(ROOT / "benchmarks/compression.png"))
    args = parser.parse_args()
    rows = []
    for model, steps in (("demo", args.steps), ("larger", args.larger_steps)):
        for label, compression in METHODS:
            rows.append(measure(model, label, compression, steps=steps))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    plot(rows, Path(args.plot))
    print(
        "| model | method | bytes/step | ratio | step s | final loss | comm 1/10/100 Gbit/s (ms) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        comm = " / ".join(f"{1e3 * r[f'comm_s_at_{bw}gbit']:.3g}" for bw in BANDWIDTHS_GBIT)
        print(
            f"| {r['model']} | {r['method']} | {r['bytes_per_step']:,} | "
            f"{r['compression_ratio']:.1f}× | {r['step_time_s']:.3f} | {r['final_loss']:.4f} | "
            f"{comm} |"
        )


if __name__ == "__main__":
    main()
