"""Gradient compression under DDP on the demo job (jobs/configs/demo.yaml: 1500 steps,
2 CPU workers): final held-out loss against dense DDP's, bytes per step and over the
run, step time; and the bytes a larger 6.3 M-parameter GPT would send.

Each lossy method runs twice: compressing the raw gradient ahead of AdamW (`gradient`),
and with the optimizer's moments on each rank and the update compressed
(`compression.momentum_correction: true`, `moments`). Bytes are what the hooks really
passed to collectives on one rank: `bytes/step` in the last step, `ratio (run)` dense
bytes over sent bytes across every step (warm-up included). Communication time is
modelled with the α-β model of ring collectives (α = 10 µs) at 1, 10 and 100 Gbit/s.

    python benchmarks/compression.py                 # about 14 minutes on 2 cores
    python benchmarks/compression.py --only moments --reuse .cache/bench/compression.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml

from trainstack.compression import COLLECTIVES, modelled_comm_seconds
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

ROOT = Path(__file__).resolve().parents[1]
LOSSY: list[tuple[str, dict[str, Any]]] = [
    ("topk 1%", {"kind": "topk", "ratio": 0.01}),
    ("powersgd r4", {"kind": "powersgd", "rank": 4}),
    ("qsgd 4-bit", {"kind": "qsgd", "bits": 4}),
    ("sign", {"kind": "sign"}),
]
METHODS: list[tuple[str, dict[str, Any]]] = [
    ("none", {"kind": "none"}),
    *[(f"{label}, gradient", {**c, "momentum_correction": False}) for label, c in LOSSY],
    *[(f"{label}, moments", {**c, "momentum_correction": True}) for label, c in LOSSY],
    ("auto, measured link", {"kind": "auto", "ratio": 0.01}),
    ("auto, 0.1 Gbit/s link", {"kind": "auto", "ratio": 0.01, "auto_link_gbit": 0.1}),
]
LARGER_METHODS: list[tuple[str, dict[str, Any]]] = [
    ("none", {"kind": "none"}),
    ("topk 1%", {"kind": "topk", "ratio": 0.01}),
    ("powersgd r4", {"kind": "powersgd", "rank": 4}),
    ("powersgd r2", {"kind": "powersgd", "rank": 2}),
]
LARGER = {"n_layer": 2, "n_head": 8, "n_embd": 512, "block_size": 32}
BANDWIDTHS_GBIT = (1, 10, 100)
LATENCY_S = 10e-6


def job(compression: dict[str, Any], storage: str, *, larger_steps: int = 0) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "jobs/configs/demo.yaml").read_text())
    raw["compression"] = compression
    raw["checkpoint"] = {"storage_path": storage}
    raw["log"] = {"every_steps": 50}
    if larger_steps:
        raw["model"] = {"kind": "gpt", **LARGER}
        raw["train"] = {**raw["train"], "steps": larger_steps, "global_batch_size": 32}
        raw["optim"] = {**raw["optim"], "lr": 1e-3, "warmup_steps": 2}
    return raw


def measure(label: str, compression: dict[str, Any], *, larger_steps: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainstack-compress-") as storage:
        cfg = config_from_dict(job(compression, storage, larger_steps=larger_steps))
        s = run_processes(cfg, world_size=2, out_dir=Path(storage))
        records = [json.loads(line) for line in (Path(storage) / "events.jsonl").open()]
    sent = s.get("bytes_on_wire") or 0
    moves = [(r["step"], r["ratio"]) for r in records if r.get("event") == "compression"]
    dense_now = (s.get("compression_ratio") or 1.0) <= 1.0  # auto may end dense
    collective = "all_reduce" if dense_now else COLLECTIVES[compression["kind"]]
    return {
        "model": "larger" if larger_steps else "demo",
        "params": s["params"],
        "method": label,
        "bytes_per_step": sent,
        "compression_ratio": s.get("compression_ratio") or 1.0,
        "compression_ratio_run": s.get("compression_ratio_run") or 1.0,
        "step_time_s": s["step_time_s"],
        "final_loss": s["final_loss"],
        "entropy_floor": s["entropy_floor"],
        "curve": [(r["step"], r["loss"]) for r in records if "event" not in r],
        "auto_moves": moves,
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

    demo = [r for r in rows if r["model"] == "demo"]
    fig, (front, curves) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in demo:
        front.scatter(r["bytes_per_step"], r["final_loss"])
        front.annotate(
            r["method"],
            (r["bytes_per_step"], r["final_loss"]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
        curves.plot(*zip(*r["curve"], strict=True), label=r["method"], linewidth=1)
    for ax in (front, curves):
        ax.axhline(demo[0]["entropy_floor"], color="grey", linestyle="--", label="entropy floor")
    front.set_xscale("log")
    front.set_xlabel("bytes sent per rank per step (log scale)")
    front.set_ylabel("final held-out loss (nats/token)")
    front.set_title(f"demo GPT ({demo[0]['params'] / 1e6:.2f} M params), 2 workers, 1500 steps")
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_ylim(demo[0]["entropy_floor"] - 0.05, 3.6)
    curves.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict[str, Any]]) -> str:
    dense = {r["model"]: r for r in rows if r["method"] == "none"}
    lines = [
        "| model | method | final loss | vs dense | bytes/step | ratio (step / run) | step s "
        "| comm 1/10/100 Gbit/s (ms) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        base = dense.get(r["model"])
        gap = f"{100 * (r['final_loss'] / base['final_loss'] - 1):+.1f}%" if base else ""
        comm = " / ".join(f"{1e3 * r[f'comm_s_at_{bw}gbit']:.3g}" for bw in BANDWIDTHS_GBIT)
        loss = f"{r['final_loss']:.4f}" if r["model"] == "demo" else "–"
        lines.append(
            f"| {r['model']} | {r['method']} | {loss} | {gap if r['model'] == 'demo' else '–'} "
            f"| {r['bytes_per_step']:,} | {r['compression_ratio']:.1f}× / "
            f"{r['compression_ratio_run']:.1f}× | {r['step_time_s']:.3f} | {comm} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the methods whose label has this")
    parser.add_argument(
        "--reuse", default="", help="a previous --out file: its rows stand for methods not run"
    )
    parser.add_argument("--larger-steps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/compression.json"))
    parser.add_argument("--plot", default=str(ROOT / "benchmarks/compression.png"))
    args = parser.parse_args()
    previous = json.loads(Path(args.reuse).read_text()) if args.reuse else []
    reused = {(r["model"], r["method"]): r for r in previous}
    rows = []
    for model, methods in (("demo", METHODS), ("larger", LARGER_METHODS)):
        for label, compression in methods:
            if args.only not in label and (model, label) in reused:
                rows.append(reused[model, label])
                continue
            if args.only not in label:
                continue
            steps = args.larger_steps if model == "larger" else 0
            rows.append(measure(label, compression, larger_steps=steps))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    if {r["model"] for r in rows} == {"demo", "larger"}:
        plot(rows, Path(args.plot))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
