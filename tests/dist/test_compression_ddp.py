"""Compression hooks on 2 gloo processes: the averaged gradient, the bytes, exact resume.

One spawn runs every kind on a tiny GPT wrapped in DDP (small buckets, so DDP's
single first-step bucket is regrouped into several afterwards; two micro-batches per
step, the first under `no_sync`). Each rank also computes, outside DDP, its local
gradient and gathers everyone's, so the test can rebuild the expected average from
the codecs alone.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainstack.compression import ErrorFeedback, build_compressor, register_compression
from trainstack.compression.lowrank import initial_q, low_rank_shape, orthonormal
from trainstack.compression.sparsify import sparse_k
from trainstack.config import CompressionConfig, ModelConfig, OptimConfig
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import rendezvous, start_processes


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, written out here as a plain-PyTorch reference."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


WORLD = 2
STEPS = 5
SAVE_AFTER = 3
SEED = 11
VOCAB = 16
MODEL = ModelConfig(kind="gpt", n_layer=2, n_head=2, n_embd=32, block_size=16)
CONFIGS = {  # the raw gradient compressed; "-moments": AdamW's update (the default)
    kind: CompressionConfig(
        kind=kind, ratio=0.05, bits=4, rank=2, min_numel=256, momentum_correction=False
    )
    for kind in ["none", "fp16", "bf16", "topk", "randk", "qsgd", "sign", "powersgd"]
}
CONFIGS["randk-unbiased"] = dataclasses.replace(CONFIGS["randk"], error_feedback=False)
CONFIGS["powersgd-no-ef"] = dataclasses.replace(CONFIGS["powersgd"], error_feedback=False)
# Deep Gradient Compression's parts: AdamW's moments on each rank (with the local clip
# they imply), a sparsity warm-up across every step, a powersgd warm-up sending fp32 for
# 2 steps, local clipping alone.
CONFIGS["topk-moments"] = dataclasses.replace(CONFIGS["topk"], momentum_correction=True)
CONFIGS["powersgd-moments"] = dataclasses.replace(CONFIGS["powersgd"], momentum_correction=True)
CONFIGS["topk-warmup"] = dataclasses.replace(CONFIGS["topk"], warmup_steps=STEPS)
CONFIGS["powersgd-warmup"] = dataclasses.replace(CONFIGS["powersgd"], warmup_steps=2)
CONFIGS["qsgd-local-clip"] = dataclasses.replace(CONFIGS["qsgd"], local_clip=True)
OPTIM = OptimConfig(kind="adamw", betas=(0.9, 0.95), grad_clip=0.05)
"""The optimizer the moments and clip come from (0.05 clips these gradients)."""
LOSSY = ["topk", "randk", "qsgd", "sign", "powersgd"]
CASTS = {"fp16": 2.0**-11, "bf16": 2.0**-8}  # unit roundoff


# ---- what runs in each process -----------------------------------------------------


def micro_batches(rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, 3, MODEL.block_size + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def backward(model: torch.nn.Module, batches: list, *, ddp: bool) -> None:
    for i, (x, y) in enumerate(batches):
        skip_sync = ddp and i < len(batches) - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
            (next_token_loss(model(x), y) / len(batches)).backward()


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


class Expected:
    """The mean over ranks of what each rank's compressor decodes, built without DDP."""

    def __init__(self, cfg: CompressionConfig) -> None:
        self.cfg = cfg
        codec_kind = cfg.kind not in ("none", "powersgd")
        self.codecs = [build_compressor(cfg, seed=SEED, rank=r) for r in range(WORLD) if codec_kind]
        self.feedback = [ErrorFeedback(enabled=cfg.error_feedback) for _ in range(WORLD)]
        self.q: dict[int, torch.Tensor] = {}
        self.moments: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def clipped(self, g: torch.Tensor, total: int) -> torch.Tensor:
        if not (self.cfg.local_clip or self.cfg.momentum_correction):
            return g
        # The same float operations as the hook's, in the same order: top-k at step 0
        # picks among near-ties (|m̂/sqrt(v̂)| is about 1 everywhere).
        limit = OPTIM.grad_clip * math.sqrt(g.numel() / total)
        return g * torch.clamp(limit / (g.norm() + 1e-6), max=1.0)

    def update(self, key: tuple[int, int], g: torch.Tensor, step: int) -> torch.Tensor:
        """AdamW's m̂/(sqrt(v̂)+eps) from the moments kept under `key` (g without them)."""
        if not self.cfg.momentum_correction:
            return g
        b1, b2 = OPTIM.betas
        m, v = self.moments.get(key, (torch.zeros_like(g), torch.zeros_like(g)))
        m = m.mul(b1).add(g, alpha=1 - b1)
        v = v.mul(b2).addcmul(g, g, value=1 - b2)
        self.moments[key] = (m, v)
        t = step + 1
        return (m / (1 - b1**t)).div((v / (1 - b2**t)).sqrt().add(1e-8))

    def dense(self, g: torch.Tensor, step: int) -> bool:
        warming = step < self.cfg.warmup_steps and self.cfg.kind != "topk"
        unfactored = self.cfg.kind == "powersgd" and low_rank_shape(g.shape, self.cfg.rank) is None
        small = self.cfg.kind == "none" or g.numel() < self.cfg.min_numel
        return small or warming or unfactored

    def mean(self, local: list[list[torch.Tensor]], step: int) -> list[torch.Tensor]:
        """local[r][i]: rank r's gradient of parameter i. Dense tensors: the update of
        the mean clipped gradient, from moments every rank shares; compressed ones:
        each rank compresses the update of its own clipped gradient, from its moments."""
        total = sum(g.numel() for g in local[0])
        warming = step < self.cfg.warmup_steps
        ratio = self.cfg.ratio ** (step / self.cfg.warmup_steps) if warming else self.cfg.ratio
        out = []
        for i, grads in enumerate(zip(*local, strict=True)):
            clipped = [self.clipped(g, total) for g in grads]
            if self.dense(grads[0], step):
                out.append(self.update((-1, i), torch.stack(clipped).mean(0), step))
                continue
            per_rank = [self.update((r, i), g, step) for r, g in enumerate(clipped)]
            if self.cfg.kind == "powersgd":
                out.append(self.power_sgd(i, per_rank))
            else:
                codecs = [
                    dataclasses.replace(c, ratio=ratio) if warming else c for c in self.codecs
                ]
                decoded = [
                    codecs[r].decode(
                        self.feedback[r].encode(codecs[r], g, step=step, bucket_index=i),
                        step=step,
                        bucket_index=i,
                    )
                    for r, g in enumerate(per_rank)
                ]
                out.append(torch.stack(decoded).mean(0))
        return out

    def power_sgd(self, i: int, per_rank: list[torch.Tensor]) -> torch.Tensor:
        dims = low_rank_shape(per_rank[0].shape, self.cfg.rank)
        if dims is None:
            return torch.stack(per_rank).mean(0)
        n, m, r = dims
        ms = [self.feedback[k].corrected(g, i).view(n, m) for k, g in enumerate(per_rank)]
        q = self.q.get(i, initial_q(m, r, seed=SEED, bucket_index=i, device=ms[0].device))
        p = orthonormal(torch.stack([mat @ q for mat in ms]).mean(0))
        self.q[i] = torch.stack([mat.T @ p for mat in ms]).mean(0)
        approx = p @ self.q[i].T
        for k, mat in enumerate(ms):
            self.feedback[k].update(i, mat, approx)
        return approx.view_as(per_rank[0])


def gather_local(model: torch.nn.Module, batches: list) -> list[list[torch.Tensor]]:
    local = copy.deepcopy(model)
    backward(local, batches, ddp=False)
    mine = torch.cat([g.reshape(-1) for g in grads(local)])
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine)
    shapes = [p.shape for p in model.parameters()]
    sizes = [shape.numel() for shape in shapes]
    return [
        [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True)]
        for flat in everyone
    ]


def train(
    cfg: CompressionConfig, rank: int, *, start: dict[str, Any] | None, steps: range
) -> dict[str, Any]:
    """SGD steps on a fresh DDP model; `start` restores weights and compression state."""
    model = build_model(MODEL, vocab_size=VOCAB, seed=0)
    if start is not None:
        model.load_state_dict(start["model"])
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = register_compression(ddp, cfg, world_size=WORLD, seed=SEED, optim=OPTIM)
    if start is not None and start["compression"] is not None:
        state.load_state_dict(torch.load(io.BytesIO(start["compression"]), weights_only=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = Expected(cfg)
    out: dict[str, Any] = {"hook": [], "expected": [], "dense": [], "scale": [], "stats": []}
    for step in steps:
        batches = micro_batches(rank, step)
        local = gather_local(model, batches)
        out["expected"].append(expected.mean(local, step) if start is None else None)
        per_param = [torch.stack(per_rank) for per_rank in zip(*local, strict=True)]
        out["dense"].append([g.mean(0) for g in per_param])
        out["scale"].append([g.abs().mean(0) for g in per_param])
        backward(ddp, batches, ddp=True)
        out["hook"].append(grads(model))
        stats = state.stats
        out["stats"].append((stats.bytes_sent, stats.gathered_bytes, stats.dense_bytes))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == SAVE_AFTER and start is None:
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            out["saved"] = {"model": copy.deepcopy(model.state_dict()), "compression": buffer}
    return out


def worker(rank: int, init_method: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # anything drawn from the global RNG would differ per rank
    results = {}
    try:
        for name, cfg in CONFIGS.items():
            run = train(cfg, rank, start=None, steps=range(STEPS))
            saved = run.pop("saved")
            saved["compression"] = saved["compression"].getvalue()
            resumed = train(cfg, rank, start=saved, steps=range(SAVE_AFTER, STEPS))
            weights_only = {"model": saved["model"], "compression": None}
            fresh = train(cfg, rank, start=weights_only, steps=range(SAVE_AFTER, STEPS))
            results[name] = {**run, "resumed": resumed["hook"], "fresh": fresh["hook"]}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---- the test process --------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("compression")
    start_processes(worker, args=(rendezvous(out), str(out)), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def expected_bytes(name: str, step: int = STEPS) -> tuple[int, int]:
    """This rank's bytes at `step` from the formulas, parameter by parameter: (all, gathered)."""
    cfg, reduced, gathered = CONFIGS[name], 0, 0
    kind, warming = cfg.kind, step < cfg.warmup_steps
    ratio = cfg.ratio ** (step / cfg.warmup_steps) if warming else cfg.ratio
    for p in build_model(MODEL, vocab_size=VOCAB, seed=0).parameters():
        n = p.numel()
        dims = low_rank_shape(p.shape, cfg.rank)
        k = sparse_k(n, ratio)
        if (
            kind == "none"
            or n < cfg.min_numel
            or (kind == "powersgd" and (dims is None or warming))
        ):
            reduced += 4 * n
        elif kind == "powersgd":
            assert dims is not None
            reduced += 4 * (dims[0] + dims[1]) * dims[2]
        elif kind in ("fp16", "bf16", "randk"):
            reduced += 4 * k if kind == "randk" else 2 * n
        else:
            gathered += {
                "topk": 8 * k,
                "qsgd": math.ceil(n * cfg.bits / 8) + 4,
                "sign": math.ceil(n / 8) + 4,
            }[kind]
    return reduced + gathered, gathered


@pytest.mark.parametrize("name", CONFIGS)
def test_every_rank_ends_with_the_expected_average(
    results: list[dict[str, Any]], name: str
) -> None:
    kind = CONFIGS[name].kind
    ours, theirs = results[0][name], results[1][name]
    for step in range(STEPS):
        for hook, other in zip(ours["hook"][step], theirs["hook"][step], strict=True):
            assert torch.equal(hook, other), f"ranks disagree at step {step}"
        for hook, want, dense, scale in zip(
            ours["hook"][step],
            ours["expected"][step],
            ours["dense"][step],
            ours["scale"][step],
            strict=True,
        ):
            if kind in CASTS:  # the hook sums 16-bit floats: one more rounding
                eps = CASTS[kind]
                # 1e-7 per element: fp16 keeps gradients under 6e-5 (a key projection's)
                # as subnormals, whose spacing (6e-8) is absolute, not relative.
                floor = 1e-7 * hook.numel() ** 0.5
                assert ((hook - want).abs() <= 2 * eps * want.abs() + 1e-7).all(), step
                assert (hook - dense).norm() <= 4 * eps * scale.norm() + floor, step
            else:
                assert torch.allclose(hook, want, rtol=1e-5, atol=1e-7), step
    if kind in LOSSY:
        last = torch.cat([g.reshape(-1) for g in ours["hook"][-1]])
        dense = torch.cat([g.reshape(-1) for g in ours["dense"][-1]])
        assert not torch.allclose(last, dense, atol=1e-4), "lossy method sent the dense gradient"


@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_sent_per_step_match_the_formula(results: list[dict[str, Any]], name: str) -> None:
    kind = CONFIGS[name].kind
    dense = 4 * sum(p.numel() for p in build_model(MODEL, vocab_size=VOCAB, seed=0).parameters())
    for rank_results in results:
        for step, stats in enumerate(rank_results[name]["stats"]):
            assert stats == (*expected_bytes(name, step), dense)
    sent = expected_bytes(name)[0]
    if kind != "none":
        assert sent < dense
    if kind in LOSSY:
        assert sent < dense / 2


@pytest.mark.parametrize("name", CONFIGS)
def test_restored_state_continues_identically(results: list[dict[str, Any]], name: str) -> None:
    kind = CONFIGS[name].kind
    for rank_results in results:
        run = rank_results[name]
        for continued, resumed in zip(run["hook"][SAVE_AFTER:], run["resumed"], strict=True):
            for a, b in zip(continued, resumed, strict=True):
                assert torch.equal(a, b)
        if kind != "none":  # without the restored state it would not be
            fresh = torch.cat([g.reshape(-1) for g in run["fresh"][0]])
            continued = torch.cat([g.reshape(-1) for g in run["hook"][SAVE_AFTER]])
            assert not torch.equal(fresh, continued)
