"""Pipelines cut any model that exposes its layers, not only trainstack's GPT: a user's
causal transformer with tied weights (its embedding is its LM head, and two of its
blocks share one MLP), `nn.Sequential` CNN classifiers (one with batch norm, whose
running statistics are state too) and a tiny Hugging Face Llama train to what one
process trains on the same global batch, under 1F1B (p=2, p=2 × d=2), ZBV and
DeepSpeed's engine; their stage files merge into the model's own state dict, and the
bytes modelled on the wire follow the activations that really cross the cut. The torch
engine trains in float64 (within `FP64_BOUND` of one process on any CPU); DeepSpeed's in
float32, held to the reference's own float32 sensitivity (`tests/bounds.py`).

The strategies are driven directly on gloo processes with this file's batches (no
data source, no training loop), against a one-process AdamW reference written out here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainstack.config import ModelConfig, config_from_dict
from trainstack.models import build_model
from trainstack.optim import build_optimizer, build_scheduler
from trainstack.runtime.gloo_processes import rendezvous, start_processes
from trainstack.strategies import WorkerContext, build_strategy
from trainstack.strategies.base import weight_dtype
from trainstack.tasks import EvalSums, build_task, evaluate

from bounds import FP64_BOUND, max_difference, sensitivity_bound

STEPS = 10
GLOBAL_BATCH = 16
EVAL_SAMPLES = 11  # shares of 5 and 6 in micro-batches of 4: held-out shapes vary
VOCAB, SEQ, CLASSES = 16, 8, 4
LLAMA = ModelConfig(
    kind="hf",
    hf={
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    },
    block_size=SEQ,
)
LLAMA_VOCAB = 64


# ---- the user's models ------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, *, heads: int, mlp: MLP) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln1(x)).split(C, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Holds the model's embedding module and, directly, its position parameter."""

    def __init__(self, embed: nn.Embedding, pos: nn.Parameter) -> None:
        super().__init__()
        self.embed, self.pos = embed, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx) + self.pos[: idx.shape[1]]


class TiedHead(nn.Module):
    """The LM head is the embedding's weight: the tie spans the first and last stage."""

    def __init__(self, norm: nn.LayerNorm, embed: nn.Embedding) -> None:
        super().__init__()
        self.norm, self.embed = norm, embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.embed.weight)


class TiedTransformer(nn.Module):
    """A user's causal LM: blocks 0 and 2 share one MLP module (ALBERT-style), and the
    head reads the token embedding's weight."""

    def __init__(self, *, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, width))
        shared = MLP(width)
        self.blocks = nn.ModuleList(
            Block(width, heads=2, mlp=shared if i in (0, 2) else MLP(width)) for i in range(depth)
        )
        self.norm = nn.LayerNorm(width)

    def pipeline_layers(self) -> list[nn.Module]:
        return [Embed(self.embed, self.pos), *self.blocks, TiedHead(self.norm, self.embed)]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


def sequential_cnn() -> nn.Sequential:
    """Its cheapest cut passes a [B, 8, 8, 8] activation between the stages."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, CLASSES),
    )


def batch_norm_cnn() -> nn.Sequential:
    """Batch norm on both sides of the cut: its running statistics are state too."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, CLASSES),
    )


def tiny_llama() -> nn.Module:
    return build_model(LLAMA, vocab_size=LLAMA_VOCAB, seed=0)


MODELS = {
    "tied_transformer": TiedTransformer,
    "cnn": sequential_cnn,
    "batch_norm_cnn": batch_norm_cnn,
    "llama": tiny_llama,
}
TASKS = {"tied_transformer": "lm", "cnn": "classify", "batch_norm_cnn": "classify", "llama": "lm"}
VOCABS = {"tied_transformer": VOCAB, "llama": LLAMA_VOCAB}


def build(model: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built: nn.Module = MODELS[model]()
    return built.to(dtype)


# ---- batches ----------------------------------------------------------------------------


def samples(model: str, count: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if TASKS[model] == "lm":
        tokens = torch.randint(0, VOCABS[model], (count, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(count, 1, 8, 8, generator=g), torch.randint(
        0, CLASSES, (count,), generator=g
    )


def replica_batches(model: str, *, step: int, replica: int, d: int, m: int) -> list[Any]:
    """Replica `replica`'s slice of step `step`'s global batch, as m micro-batches."""
    x, y = samples(model, GLOBAL_BATCH, seed=step)
    share = GLOBAL_BATCH // d
    x, y = x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]
    return list(zip(x.chunk(m), y.chunk(m), strict=True))


def eval_share(model: str, *, replica: int, d: int) -> list[Any]:
    x, y = samples(model, EVAL_SAMPLES, seed=1000)
    lo, hi = replica * EVAL_SAMPLES // d, (replica + 1) * EVAL_SAMPLES // d
    return list(zip(x[lo:hi].split(4), y[lo:hi].split(4), strict=True))


def spec(model: str, *, p: int, d: int, m: int = 4, **strategy: Any) -> dict[str, Any]:
    lm = TASKS[model] == "lm"
    if model == "llama":
        model_spec: dict[str, Any] = {"kind": "hf", "hf": LLAMA.hf, "block_size": SEQ}
    else:
        model_spec = {"kind": "custom", "target": f"test_pipeline_any_model:{model}"}
    return {
        "name": "any-model",
        "model": model_spec,
        "task": {"kind": TASKS[model]},
        "data": {
            "kind": "markov" if lm else "clusters",
            "vocab_size": VOCABS.get(model, VOCAB),
            "num_classes": CLASSES,
        },
        "train": {
            "steps": STEPS,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": GLOBAL_BATCH // (d * m),
            "precision": "fp32" if strategy.get("engine") == "deepspeed" else "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1},
        "strategy": {
            "kind": "pipeline",
            "stages": p,
            "data_parallel": d,
            "microbatches": m,
            "schedule": "1f1b",
            **strategy,
        },
        "scaling": {"num_workers": p * d},
    }


# ---- the pipeline on gloo processes, and one process ------------------------------------


def _worker(rank: int, raw: dict[str, Any], model: str, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    cfg = config_from_dict(raw)
    world = cfg.scaling.num_workers
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        ctx = WorkerContext(
            rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu")
        )
        strategy = build_strategy(cfg, ctx)
        strategy.setup(build(model, weight_dtype(cfg)))
        d, m = cfg.strategy.data_parallel, cfg.strategy.microbatches
        replica = rank % d
        norms = []
        for step in range(STEPS):
            batches = replica_batches(model, step=step, replica=replica, d=d, m=m)
            norms.append(strategy.train_step(batches).grad_norm)
        sums = strategy.evaluate(eval_share(model, replica=replica, d=d))
        files = strategy.checkpoint_files()
        result_file = {
            "stages": {k: v for k, v in files.items() if k.startswith("model/")},
            "comm_bytes": strategy.comm_bytes_per_step(),
            "eval": sums,
            "norms": norms,
        }
        torch.save(result_file, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_pipeline(raw: dict[str, Any], model: str, out: Path) -> list[dict[str, Any]]:
    """Every rank's results: stage files, comm bytes, eval sums and grad norms."""
    out.mkdir(parents=True, exist_ok=True)
    world = raw["scaling"]["num_workers"]
    start_processes(_worker, args=(raw, model, rendezvous(out), str(out)), nprocs=world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def run_reference(raw: dict[str, Any], model: str, *, split: int = 1) -> dict[str, Any]:
    """One process: the same global batches accumulated over the same micro-batches,
    clipped and stepped with trainstack's AdamW and schedule, in `raw`'s precision; with
    `split`, each micro-batch cut in that many (the same sum in another order)."""
    cfg = config_from_dict(raw)
    task, net = build_task(cfg), build(model, weight_dtype(cfg))
    optimizer = build_optimizer(net, cfg.optim, lr=cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=STEPS)
    d, m = cfg.strategy.data_parallel, cfg.strategy.microbatches
    norms = []
    for step in range(STEPS):
        micro = [
            b for r in range(d) for b in replica_batches(model, step=step, replica=r, d=d, m=m)
        ]
        if split > 1:
            micro = [
                part for x, y in micro for part in zip(x.chunk(split), y.chunk(split), strict=True)
            ]
        for x, y in micro:
            x = x.to(weight_dtype(cfg)) if x.is_floating_point() else x
            (task.loss(net(x), y) / len(micro)).backward()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), cfg.optim.grad_clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    net.eval()
    held_out = [b for r in range(d) for b in eval_share(model, replica=r, d=d)]
    sums = EvalSums.of(evaluate(task, net, held_out, device=torch.device("cpu")))
    return {"state": net.state_dict(), "norms": norms, "eval": sums, "cfg": cfg}


def merged_stages(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for name in sorted(n for r in ranks for n in r["stages"]):
        merged.update(next(r["stages"][name] for r in ranks if name in r["stages"]))
    return merged


def assert_trains_like_one_process(
    ranks: list[dict[str, Any]],
    reference: dict[str, Any],
    *,
    model: str,
    label: str,
    bound: float = FP64_BOUND,
) -> None:
    merged, expected = merged_stages(ranks), reference["state"]
    assert merged.keys() == expected.keys()  # the model's own keys
    diff = max_difference(merged, expected)
    print(f"{label}: max |pipeline - one process| = {diff:.3g} (bound {bound:.3g})")
    assert diff < bound
    assert max_difference(expected, build(model).state_dict()) > 1e-2  # training moved it
    # Clipping engaged, and on the whole model's norm (each tied tensor once).
    clip = reference["cfg"].optim.grad_clip
    assert max(reference["norms"]) > clip
    for norm in [r["norms"] for r in ranks]:
        assert norm == pytest.approx(reference["norms"], rel=1e-4)
    sums: EvalSums = ranks[0]["eval"]
    assert all(r["eval"] == sums for r in ranks)
    assert sums.count == reference["eval"].count and sums.correct == reference["eval"].correct
    assert math.isclose(sums.loss, reference["eval"].loss, rel_tol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("p", "d", "schedule"), [(2, 1, "1f1b"), (2, 2, "1f1b"), (2, 1, "zbv")], ids=str
)
def test_tied_user_transformer_matches_one_process_after_10_steps(
    tmp_path: Path, p: int, d: int, schedule: str
) -> None:
    raw = spec("tied_transformer", p=p, d=d, schedule=schedule)
    ranks = run_pipeline(raw, "tied_transformer", tmp_path)
    reference = run_reference(raw, "tied_transformer")
    label = f"tied_transformer {schedule} p={p} d={d}"
    assert_trains_like_one_process(ranks, reference, model="tied_transformer", label=label)
    if (schedule, d) == ("1f1b", 1):
        assert [r["comm_bytes"] for r in ranks] == [tied_transformer_comm_bytes()] * 2


def tied_transformer_comm_bytes(element: int = 8) -> int:
    """Bytes each of its two 1F1B ranks sends per step: 4 micro-batches of [4, T, 32]
    floats across the cut (forward on one rank, gradients back on the other), and one
    copy of each tied tensor (a two-rank all-reduce): the embedding and the shared MLP;
    `element` bytes a float (8: the torch engine's runs here are float64)."""
    model = TiedTransformer()
    activation = (GLOBAL_BATCH // 4) * SEQ * 32 * element
    tied = [model.embed.weight, *model.blocks[0].mlp.parameters()]
    return 4 * activation + element * sum(t.numel() for t in tied)


@pytest.mark.parametrize(("p", "d"), [(2, 1), (2, 2)], ids=str)
def test_sequential_cnn_classifier_matches_one_process_after_10_steps(
    tmp_path: Path, p: int, d: int
) -> None:
    raw = spec("cnn", p=p, d=d)
    ranks = run_pipeline(raw, "cnn", tmp_path)
    reference = run_reference(raw, "cnn")
    assert_trains_like_one_process(ranks, reference, model="cnn", label=f"cnn 1f1b p={p} d={d}")
    if d == 1:  # the cut passes [micro, 8, 8, 8] float64s forward and their gradients back
        activation = (GLOBAL_BATCH // 4) * 8 * 8 * 8 * 8
        assert [r["comm_bytes"] for r in ranks] == [4 * activation, 4 * activation]


def test_deepspeed_engine_runs_the_tied_user_transformer(tmp_path: Path) -> None:
    raw = spec("tied_transformer", p=2, d=1, engine="deepspeed")  # float32 only
    ranks = run_pipeline(raw, "tied_transformer", tmp_path)
    reference = run_reference(raw, "tied_transformer")
    sensitivity = max(  # the reference's own float32 sensitivity: other summation orders
        max_difference(run_reference(raw, "tied_transformer", split=n)["state"], reference["state"])
        for n in (2, 4)
    )
    assert sensitivity > 0
    label = "tied_transformer deepspeed p=2 d=1"
    bound = sensitivity_bound(sensitivity)
    assert_trains_like_one_process(
        ranks, reference, model="tied_transformer", label=label, bound=bound
    )
    assert [r["comm_bytes"] for r in ranks] == [tied_transformer_comm_bytes(element=4)] * 2


def test_tiny_hf_llama_matches_one_process_after_10_steps(tmp_path: Path) -> None:
    raw = spec("llama", p=2, d=1)
    ranks = run_pipeline(raw, "llama", tmp_path)
    reference = run_reference(raw, "llama")
    label = "hf llama 1f1b p=2 d=1"
    assert_trains_like_one_process(ranks, reference, model="llama", label=label)


def test_batch_norm_statistics_match_one_process(tmp_path: Path) -> None:
    raw = spec("batch_norm_cnn", p=2, d=1)
    ranks = run_pipeline(raw, "batch_norm_cnn", tmp_path)
    reference = run_reference(raw, "batch_norm_cnn")
    label = "batch_norm_cnn 1f1b p=2 d=1"
    assert_trains_like_one_process(ranks, reference, model="batch_norm_cnn", label=label)
