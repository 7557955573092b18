"""Figures on one GPU: trainstack against a plain PyTorch loop, same model, same script.

For each GPT size (block 1024, GPT-2's 50,304-token vocabulary, random token files):
(a) trainstack: `run_job` on an embedded local Ray, one GPU worker, bf16 autocast, SDPA
    attention, fused AdamW, `train.compile` (each block compiled), under each `--layouts`
    entry (`ddp`, `zero1`, `zero2`, `zero3`, `fsdp`; a pipeline needs two devices);
(b) raw: the loop below, written out by hand: the same GPT, torch.compile, bf16
    autocast, fused AdamW, batches of the same token file.
Each trainstack row is compared with the raw loop at its own micro-batch (a variant
that doubles it gets a raw loop at the doubled one), and the table says which.
Reported: steady-state tokens/s (after `--warmup` steps), MFU for both from one count
(6 FLOPs a parameter a token plus attention's 12·L·h·T, the PaLM paper's) against the
device's peak (`trainstack.observe.throughput.PEAK_FLOPS`), peak memory, trainstack/raw
and trainstack's time to the first step (with its start-up split in the JSON rows).

    python benchmarks/gpu.py --sizes 124M 355M 1.3B --layouts ddp zero1 zero2 zero3 fsdp
    python benchmarks/gpu.py --device cpu --sizes tiny --steps 6   # checks the script

On CPU there is no peak to compare with (MFU is None) and bf16 and compile are off:
only the plumbing is checked.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainstack.config import ModelConfig, config_from_dict
from trainstack.data.tokens import write_token_file
from trainstack.models.gpt import GPT
from trainstack.observe.throughput import device_peak_flops, mfu


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int = 50_304
    block: int = 1024
    micro_batch: int = 8


SIZES = {
    "tiny": Size(n_layer=2, n_embd=64, n_head=2, vocab=256, block=64, micro_batch=4),
    "124M": Size(n_layer=12, n_embd=768, n_head=12, micro_batch=16),
    "355M": Size(n_layer=24, n_embd=1024, n_head=16, micro_batch=8),
    "1.3B": Size(n_layer=24, n_embd=2048, n_head=16, micro_batch=4),
}
LAYOUTS = {
    "ddp": {"kind": "ddp"},
    "zero1": {"kind": "zero", "stage": 1},
    "zero2": {"kind": "zero", "stage": 2},
    "zero3": {"kind": "zero", "stage": 3},
    "fsdp": {"kind": "fsdp"},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "zero2-nocontig": {"deepspeed": {"zero_optimization": {"contiguous_gradients": False}}},
    "ddp-fused": {"model": {"fused_loss": True}},
    "ddp-fused-2x": {"model": {"fused_loss": True}, "micro_batch_scale": 2},
}
"""Variants: a layout of LAYOUTS (the name before the dash) with raw DeepSpeed keys, model
keys (`fused_loss`: the head's cross-entropy without the logits) or a micro-batch that
many times the size's (the memory the fused loss frees)."""
for _variant in VARIANTS:
    LAYOUTS[_variant] = LAYOUTS[_variant.split("-")[0]]


def token_file(folder: Path, size: Size, *, steps: int) -> Path:
    """Random ids: enough windows for every step, and a tenth more held out."""
    path = folder / f"tokens_{size.vocab}.bin"
    count = (steps + 2) * 2 * size.micro_batch * (size.block + 1) * 12 // 10 + 1  # 2x variants
    rng = np.random.default_rng(0)
    write_token_file(path, rng.integers(0, size.vocab, count, dtype=np.int64))
    return path


def model_config(size: Size) -> dict[str, Any]:
    return {
        "kind": "gpt",
        "n_layer": size.n_layer,
        "n_embd": size.n_embd,
        "n_head": size.n_head,
        "block_size": size.block,
    }


def through_trainstack(
    size: Size, layout: str, *, tokens: Path, steps: int, warmup: int, gpu: bool, out: Path
) -> dict[str, Any]:
    from trainstack.runtime.launcher import run_job

    variant = VARIANTS.get(layout, {})
    micro_batch = size.micro_batch * variant.get("micro_batch_scale", 1)
    raw = {
        "name": f"gpu-{layout}",
        "model": {**model_config(size), **variant.get("model", {})},
        "data": {
            "kind": "tokens",
            "train": [str(tokens)],
            "vocab_size": size.vocab,
            "val_fraction": 0.1,
            "eval_samples": micro_batch,
        },
        "train": {
            "steps": steps,
            "global_batch_size": micro_batch,
            "micro_batch_size": micro_batch,
            "precision": "bf16" if gpu else "fp32",
            "compile": gpu,
        },
        "optim": {"lr": 3e-4, "warmup_steps": 1, "weight_decay": 0.1},
        "strategy": LAYOUTS[layout],
        "deepspeed": variant.get("deepspeed", {}),
        "scaling": {"num_workers": 1, "use_gpu": gpu},
        "checkpoint": {"storage_path": str(out), "every_steps": steps},
        "log": {"every_steps": max(1, steps // 5), "progress": "quiet"},
    }
    summary = run_job(config_from_dict(raw))
    device = torch.device("cuda" if gpu else "cpu")
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": model_flops_utilisation(size, summary["params"], summary["tokens_per_s"], device),
        "peak_mem_bytes": summary.get("peak_mem_bytes"),
        "final_loss": summary["final_loss"],
        "time_to_first_step_s": summary.get("time_to_first_step_s"),
        "startup": summary.get("startup"),
    }


def raw_loop(
    size: Size, *, micro_batch: int, tokens: Path, steps: int, warmup: int, gpu: bool
) -> dict[str, Any]:
    """The same GPT trained by hand at `micro_batch`: compile, bf16 autocast, fused AdamW
    (on a GPU)."""
    device = torch.device("cuda" if gpu else "cpu")
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="gpt",
        n_layer=size.n_layer,
        n_embd=size.n_embd,
        n_head=size.n_head,
        block_size=size.block,
    )
    model: Any = GPT(cfg, vocab_size=size.vocab).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=gpu)
    if gpu:
        model = torch.compile(model)
    ids = np.memmap(tokens, dtype=np.uint16, mode="r", offset=1024)
    window = micro_batch * (size.block + 1)
    times = []
    for step in range(steps):
        # Timed from the batch's read, as trainstack's meter times its steps.
        start = time.perf_counter()
        chunk = torch.from_numpy(np.array(ids[step * window : (step + 1) * window], np.int64))
        chunk = chunk.view(micro_batch, size.block + 1)
        x, y = chunk[:, :-1].to(device, non_blocking=True), chunk[:, 1:].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = times[warmup:] or times
    tokens_per_s = micro_batch * size.block / (sum(steady) / len(steady))
    if gpu:
        torch.cuda.reset_peak_memory_stats()  # the next loop's peak is its own
    return {
        "micro_batch": micro_batch,
        "tokens_per_s": tokens_per_s,
        "mfu": model_flops_utilisation(size, params, tokens_per_s, device),
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if gpu else None,
        "final_loss": float(loss),
        "params": params,
    }


def record(row: dict[str, Any], path: Path | None, *, device: str) -> None:
    """Append one measured row (with the device and date) as a JSON line, as it lands."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps({**row, "device": device, "date": time.strftime("%Y-%m-%d")}) + "\n")


def model_flops_utilisation(
    size: Size, params: int, tokens_per_s: float, device: torch.device
) -> float | None:
    """6 FLOPs a parameter a token plus attention's 12·L·h·T, over the device's peak."""
    flops_per_token = 6 * params + 12 * size.n_layer * size.n_embd * size.block
    return mfu(
        flops_per_token=flops_per_token,
        tokens_per_s=tokens_per_s,
        peak_flops=device_peak_flops(device),
        world_size=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["124M", "355M", "1.3B"], choices=SIZES)
    parser.add_argument("--layouts", nargs="+", default=["ddp"], choices=LAYOUTS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--jsonl", type=Path, default=None, help="append each row here as it is measured"
    )
    args = parser.parse_args()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: no CUDA device; use --device cpu to check it")
    device_name = torch.cuda.get_device_name() if gpu else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainstack-gpu-") as tmp:
        for name in args.sizes:
            size = SIZES[name]
            tokens = token_file(Path(tmp), size, steps=args.steps)
            raws: dict[int, dict[str, Any]] = {}  # the raw loop at each micro-batch compared
            for layout in args.layouts:
                micro_batch = size.micro_batch * VARIANTS.get(layout, {}).get(
                    "micro_batch_scale", 1
                )
                if micro_batch not in raws:
                    raw = raw_loop(
                        size,
                        micro_batch=micro_batch,
                        tokens=tokens,
                        steps=args.steps,
                        warmup=args.warmup,
                        gpu=gpu,
                    )
                    raws[micro_batch] = raw
                    rows.append({"size": name, "run": "raw", **raw})
                    record(rows[-1], args.jsonl, device=device_name)
                raw = raws[micro_batch]
                ours = through_trainstack(
                    size,
                    layout,
                    tokens=tokens,
                    steps=args.steps,
                    warmup=args.warmup,
                    gpu=gpu,
                    out=Path(tmp) / f"{name}-{layout}",
                )
                ratio = ours["tokens_per_s"] / raw["tokens_per_s"]  # at the same micro-batch
                row = {"micro_batch": micro_batch, **ours, "vs_raw": ratio}
                rows.append({"size": name, "run": f"trainstack {layout}", **row})
                record(rows[-1], args.jsonl, device=device_name)
    print(f"{device_name}, {time.strftime('%Y-%m-%d')}")
    print(
        f"{'size':>5}  {'run':<22} {'micro':>5} {'tokens/s':>12} {'MFU':>6} {'peak mem':>10} "
        f"{'vs raw':>7} {'first step':>10}"
    )
    for row in rows:
        share = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        memory = f"{row['peak_mem_bytes'] / 2**30:.1f} GiB" if row["peak_mem_bytes"] else "-"
        ratio = f"{row['vs_raw']:.3f}" if "vs_raw" in row else ""
        first = row.get("time_to_first_step_s")
        first_s = f"{first:.1f} s" if first is not None else ""
        print(
            f"{row['size']:>5}  {row['run']:<22} {row['micro_batch']:>5} "
            f"{row['tokens_per_s']:>12,.0f} {share:>6} {memory:>10} {ratio:>7} {first_s:>10}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
