"""Context parallelism's activation memory and step time against sequence length: a
demo-sized GPT, one row a micro-batch, on cp = 1, 2 and 4 gloo processes (CPU).

Measured: rank 0's peak saved-activation bytes over one forward and backward
(`SavedActivationMeter`: every tensor autograd keeps, the ring's own saved tensors
included), and the median wall time of that forward and backward. Planned: the figure
`trainstack plan` and pre-flight use for the same spec (`planner/plan.py`: the GPT's
expressions at a sequence of s / c).

    python benchmarks/context_parallel.py --seq 256 512 1024 2048
    python benchmarks/context_parallel.py --model demo --seq 16384 --cp 1 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.planner.choose import default_hardware, layout_of
from trainstack.planner.plan import estimate
from trainstack.planner.workload import workload_from_spec
from trainstack.runtime.gloo_processes import rendezvous, start_processes
from trainstack.strategies.context_parallel import ContextParallel, context_parallel_groups
from trainstack.strategies.pipeline_probe import SavedActivationMeter
from trainstack.tasks import build_task

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "small": ({"n_layer": 2, "n_head": 4, "n_embd": 128}, 256),
    "demo": ({"n_layer": 2, "n_head": 2, "n_embd": 64}, 32),  # jobs/configs/demo.yaml's
}
"""`--model`: the GPT's sizes and vocabulary."""
MODEL = {"name": "small"}


def spec(seq: int, cp: int) -> dict[str, Any]:
    sizes, vocab = MODELS[MODEL["name"]]
    return {
        "model": {"kind": "gpt", **sizes, "block_size": seq},
        "data": {"vocab_size": vocab},
        "train": {"global_batch_size": 1, "micro_batch_size": 1},
        "strategy": {"kind": "fsdp", "context_parallel": cp} if cp > 1 else {"kind": "fsdp"},
        "scaling": {"num_workers": cp, "device_memory": "80GB"},
    }


def planned_activations(seq: int, cp: int) -> float:
    cfg = config_from_dict(spec(seq, cp))
    layout = layout_of(cfg)
    assert layout is not None
    hardware = default_hardware(cfg, devices=cp)
    figure = estimate(workload_from_spec(cfg), layout, hardware, micro_batch=1, recompute=False)
    assert figure.activations is not None
    return figure.activations


def worker(
    rank: int, init_method: str, seq: int, cp: int, repeats: int, out: str, model_name: str
) -> None:
    MODEL["name"] = model_name
    if cp > 1:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=cp)
    torch.set_num_threads(1)
    cfg = config_from_dict(spec(seq, cp))
    vocab = cfg.data.vocab_size
    model = build_model(cfg.model, vocab_size=vocab, seed=0)
    task = build_task(cfg)
    tokens = torch.randint(vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    dims = cfg.dims
    context = ContextParallel(context_parallel_groups(dims), seq_len=seq) if cp > 1 else None
    x, y = context.local(batch) if context else batch
    peak, times = 0, []
    for _ in range(repeats):
        meter = SavedActivationMeter(
            exclude={p.untyped_storage().data_ptr() for p in model.parameters()}
        )
        start = time.perf_counter()
        shard = context.shard(torch.device("cpu")) if context else _nothing()
        with shard, meter.recording():
            loss = task.loss(task.outputs(model, x, y), y, inputs=x)
            loss.backward()
        times.append(time.perf_counter() - start)
        peak = max(peak, meter.peak_bytes)
        model.zero_grad(set_to_none=True)
    if rank == 0:
        record = {"seq": seq, "cp": cp, "measured": peak, "step_s": statistics.median(times)}
        Path(out).write_text(json.dumps(record))
    if cp > 1:
        dist.destroy_process_group()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def measure(seq: int, cp: int, *, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainstack-cp-") as folder:
        out = Path(folder) / "rank0.json"
        args = (rendezvous(Path(folder)), seq, cp, repeats, str(out), MODEL["name"])
        start_processes(worker, args=args, nprocs=cp)
        record: dict[str, Any] = json.loads(out.read_text())
    record["planned"] = planned_activations(seq, cp)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/context_parallel.json"))
    args = parser.parse_args()
    MODEL["name"] = args.model
    rows = [measure(seq, cp, repeats=args.repeats) for seq in args.seq for cp in args.cp]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    header = ("seq", 6), ("cp", 3), ("measured", 11), ("planned", 11), ("planned/measured", 17)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'step':>9}")
    for r in rows:
        print(
            f"{r['seq']:>6} {r['cp']:>3} {r['measured'] / 2**20:>9.2f}Mi "
            f"{r['planned'] / 2**20:>9.2f}Mi {r['planned'] / r['measured']:>17.3f} "
            f"{r['step_s'] * 1e3:>7.1f}ms"
        )


if __name__ == "__main__":
    main()
