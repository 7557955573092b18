"""Peak host memory per rank when a pretrained model loads: the whole model on every rank
(then sharded), against each rank reading its own part into a model built on the meta
device (what fsdp, the torch pipelines and zero 3 do).

A qwen2 of about 146M parameters (0.58 GB in fp32; hidden 1024, 10 layers, vocabulary
32,000, tied head) is created here with `save_pretrained` (random weights, nothing
downloaded), then loaded by trainstack's own start of a run (`build_job_model`,
`set_up_strategy`) on 2 gloo processes, each started fresh (spawn). Per rank: its
resident memory before the model is built (torch and transformers imported) and its
high-water mark (VmHWM in /proc/self/status) once the model is loaded and set up, and
the parameter bytes it holds after. "whole" forces the full per-rank load
(`from_pretrained`, as every layout did before and ddp still does) under the same
strategy, for comparison.

    python benchmarks/pretrained_memory.py              # fsdp, a 2-stage pipeline, zero 3, ~4 min
    python benchmarks/pretrained_memory.py --layers 4   # a smaller model, quicker
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import rendezvous
from trainstack.runtime.loop import build_job_model, set_up_strategy
from trainstack.strategies import WorkerContext, build_strategy
from trainstack.strategies.dtensor_state import local_part

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
VOCAB, BLOCK = 32_000, 64
ROWS: list[tuple[str, dict[str, Any], str]] = [
    ("fsdp", {"kind": "fsdp"}, "whole"),
    ("fsdp", {"kind": "fsdp"}, "parts"),
    ("pipeline 2 stages", {"kind": "pipeline", "stages": 2, "microbatches": 2}, "parts"),
    ("zero 3", {"kind": "zero", "stage": 3}, "whole"),
    ("zero 3", {"kind": "zero", "stage": 3}, "parts"),
]
"""Under zero 3 a rank's set-up also allocates what DeepSpeed's engine keeps, 4/N of the
model: its partition of the weights, a defragmented copy of it while the engine is
built, the fp32 master partition and the gradient partition."""


def save_model(folder: Path, *, layers: int) -> int:
    """A random qwen2 saved with save_pretrained; its parameter count."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=BLOCK,
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _worker(rank: int, raw: dict[str, Any], mode: str, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        # the family's modeling code imported before the baseline (about 90 MB of it)
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401

        if raw["strategy"]["kind"] == "zero":
            import deepspeed  # noqa: F401 - imported before the baseline too

        cfg = config_from_dict(raw)
        ctx = WorkerContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        strategy = build_strategy(cfg, ctx)
        before = memory_kb("VmRSS")
        if mode == "whole":
            model = build_model(cfg.model, vocab_size=VOCAB, seed=0)
        else:
            model = build_job_model(cfg, strategy)
        set_up_strategy(cfg, strategy, model)
        held = {id(p): _held(p) for p in strategy.unwrapped_model().parameters()}
        result = {
            "rss_before_kb": before,
            "peak_kb": memory_kb("VmHWM"),
            "held_bytes": sum(t.numel() * t.element_size() for t in held.values()),
        }
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _held(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, a ZeRO-3 parameter's partition (`ds_tensor`), else `p`."""
    partition = getattr(p, "ds_tensor", None)
    return partition if partition is not None else local_part(p)


def measure(folder: Path, strategy: dict[str, Any], mode: str, work: Path) -> list[dict[str, Any]]:
    raw = {
        "name": "pretrained-memory",
        "model": {"kind": "hf", "pretrained": str(folder), "block_size": BLOCK},
        "data": {"vocab_size": VOCAB},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2},
        "optim": {"warmup_steps": 0},
        "strategy": strategy,
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(work / "runs")},
    }
    out = work / f"{strategy['kind']}{strategy.get('stage', '')}-{mode}"
    out.mkdir(parents=True)
    args = (raw, mode, rendezvous(out), str(out))
    mp.start_processes(_worker, args=args, nprocs=2, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/pretrained_memory.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainstack-pretrained-") as tmp:
        work = Path(tmp)
        params = save_model(work / "model", layers=args.layers)
        size = params * 4
        print(f"qwen2, {params / 1e6:.0f}M parameters, {size / GB:.2f} GB in fp32; 2 ranks")
        print(
            f"{'layout':<18} {'load':<6} {'rank':>4} {'RSS before':>11} {'peak RSS':>9} "
            f"{'peak - before':>14} {'held params':>12}"
        )
        for name, strategy, mode in ROWS:
            for rank, r in enumerate(measure(work / "model", strategy, mode, work)):
                rise = (r["peak_kb"] - r["rss_before_kb"]) * 1024
                row = {"layout": name, "load": mode, "rank": rank, "model_bytes": size, **r}
                rows.append(row)
                print(
                    f"{name:<18} {mode:<6} {rank:>4} {r['rss_before_kb'] * 1024 / GB:>9.2f}GB "
                    f"{r['peak_kb'] * 1024 / GB:>7.2f}GB {rise / GB:>12.2f}GB "
                    f"{r['held_bytes'] / GB:>10.2f}GB"
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
