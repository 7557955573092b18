"""Context parallelism (`strategy.context_parallel`, under fsdp): every row's tokens split
over the ranks, attention a ring (`strategies/context_parallel.py`). In float64 on gloo
processes: each token's loss computed on a rank holding its share of the row equals the
loss computed on the whole row; cp 2, cp 2 × fsdp 2 (killed once and resumed) and cp 2 ×
tensor parallel 2 train what one process trains; a checkpoint written under cp 2 resumes
under DDP with its Adam state."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import rendezvous, run_processes, start_processes
from trainstack.strategies.context_parallel import ContextParallel

from bounds import FP64_BOUND, assert_trained, max_difference, one_process
from chat_data import make_tokenizer, sums, write_jsonl
from user_model_specs import HF_WIDTHS

STEPS = 10
BLOCK = 16


def spec(out: Path) -> dict[str, Any]:
    return {
        "name": "cp",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": BLOCK},
        "data": {"vocab_size": 16, "order": 2, "eval_samples": 16},
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(out / "runs"), "every_steps": 5, "keep": 10},
        "log": {"every_steps": 5},
    }


def with_context(raw: dict[str, Any], out: Path, *, workers: int) -> dict[str, Any]:
    job = copy.deepcopy(raw)
    job["strategy"] = {"kind": "fsdp", "context_parallel": 2}
    job["scaling"] = {"num_workers": workers}
    job["checkpoint"]["storage_path"] = str(out / "runs")
    return job


def per_token_losses(rank: int, init_method: str, out_dir: str) -> None:
    """Rank `rank` of 2: the per-token cross-entropy of its share of 3 rows under the
    ring, and the whole rows' computed alone (for the test to compare)."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        cfg = config_from_dict(spec(Path(out_dir)))
        model = build_model(cfg.model, vocab_size=16, seed=0).double()
        g = torch.Generator().manual_seed(0)
        x, y = (
            torch.randint(16, (3, BLOCK), generator=g),
            torch.randint(16, (3, BLOCK), generator=g),
        )
        context = ContextParallel(dist.new_group([0, 1]), seq_len=BLOCK)
        mine = context.positions[rank]
        local_x, local_y = context.local((x, y))
        with context.shard(torch.device("cpu")):
            logits = model(local_x)
            split = F.cross_entropy(logits.flatten(0, 1), local_y.flatten(), reduction="none")
            split.sum().backward()  # the ring's backward runs too
        whole = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
        torch.save(
            {
                "positions": mine,
                "split": split.detach().view(3, -1),
                "whole": whole.detach().view(3, BLOCK),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_each_tokens_loss_on_its_share_of_the_row_is_its_loss_on_the_whole_row(
    tmp_path: Path,
) -> None:
    start_processes(per_token_losses, args=(rendezvous(tmp_path), str(tmp_path)), nprocs=2)
    held = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # each rank holds an early and a late quarter of the row: together, every position once
    assert torch.equal(
        torch.sort(torch.cat([h["positions"] for h in held])).values, torch.arange(BLOCK)
    )
    assert held[0]["positions"].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    for h in held:
        expected = h["whole"][:, h["positions"]]
        assert torch.allclose(h["split"], expected, rtol=0, atol=1e-12)
        # attention over its own tokens alone would differ: the late chunk sees the middle
        assert not torch.allclose(h["split"][:, 4:], h["whole"][:, 4:8], atol=1e-3)


DOCUMENTS = (5, 9, 3, 7, 8)
"""Lengths of the documents packed into one row of BLOCK + 16 = 32 positions (with 0
of padding): the chunks cut documents apart, and a document spans ranks."""


def packed_per_token_losses(rank: int, init_method: str, out_dir: str) -> None:
    """Rank `rank` of 2: the per-token cross-entropy of its share of 2 packed rows under
    the ring, the same rows unsplit (packed, one process's forward), and each document
    alone, unpacked."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        raw = spec(Path(out_dir))
        raw["model"]["block_size"] = 32
        cfg = config_from_dict(raw)
        model = build_model(cfg.model, vocab_size=16, seed=0).double()
        g = torch.Generator().manual_seed(1)
        rows = []
        for shift in (0, 1):  # the second row's documents in another order
            lengths = DOCUMENTS[shift:] + DOCUMENTS[:shift]
            tokens = torch.randint(16, (32,), generator=g)
            positions = torch.cat([torch.arange(n) for n in lengths])
            rows.append((tokens, positions, lengths))
        x = torch.stack([torch.stack([t, p]) for t, p, _ in rows])  # [2, 2, 32]
        y = torch.randint(16, (2, 32), generator=g)
        context = ContextParallel(dist.new_group([0, 1]), seq_len=32)
        local_x, local_y = context.local((x, y))
        with context.shard(torch.device("cpu")):
            logits = model(local_x)
            split = F.cross_entropy(logits.flatten(0, 1), local_y.flatten(), reduction="none")
            split.sum().backward()
        packed = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
        one_document = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)  # ids all 0: leaky
        leaky = F.cross_entropy(model(one_document).flatten(0, 1), y.flatten(), reduction="none")
        alone = torch.zeros(2, 32, dtype=torch.float64)
        for r, (tokens, _, lengths) in enumerate(rows):
            at = 0
            for n in lengths:
                doc = model(tokens[None, at : at + n])
                alone[r, at : at + n] = F.cross_entropy(doc[0], y[r, at : at + n], reduction="none")
                at += n
        torch.save(
            {
                "positions": context.positions[rank],
                "split": split.detach().view(2, -1),
                "packed": packed.detach().view(2, 32),
                "leaky": leaky.detach().view(2, 32),
                "alone": alone.detach(),
            },
            Path(out_dir) / f"packed{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_packed_documents_split_over_ranks_have_the_losses_they_have_alone(
    tmp_path: Path,
) -> None:
    """Packed rows (token and position ids restarting at each document) under cp 2: each
    token attends only within its document, across the ranks its document spans, and
    its loss is the document's computed alone, unpacked; so is the packed rows' on one
    process."""
    start_processes(packed_per_token_losses, args=(rendezvous(tmp_path), str(tmp_path)), nprocs=2)
    held = [torch.load(tmp_path / f"packed{r}.pt") for r in range(2)]
    alone = held[0]["alone"]
    assert torch.allclose(held[0]["packed"], alone, rtol=0, atol=1e-12)
    for h in held:
        assert torch.allclose(h["split"], alone[:, h["positions"]], rtol=0, atol=1e-12)
    # attending across documents (the same rows given one document id) changes every
    # document's losses but the first's
    leaky = held[0]["leaky"]
    assert torch.allclose(leaky[0, :5], alone[0, :5], rtol=0, atol=1e-12)
    assert (leaky[0, 5:] - alone[0, 5:]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("cp-reference")
    return one_process(spec(out), out / "one")


@pytest.fixture(scope="module")
def cp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cp 2 on two ranks (the FSDP shard degree 1 × context 2): its output folder."""
    out = tmp_path_factory.mktemp("cp2")
    run_processes(
        config_from_dict(with_context(spec(out), out, workers=2)), world_size=2, out_dir=out
    )
    return out


def test_cp2_trains_what_one_process_trains(cp2: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = torch.load(cp2 / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"max |cp 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(weights, spec(cp2))
    summary = json.loads((cp2 / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["eval_loss"] is not None


def test_cp2_x_fsdp2_killed_and_resumed_trains_what_one_process_trains(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    raw = with_context(spec(tmp_path), tmp_path, workers=4)
    raw["faults"] = {"kill_at_steps": [7], "rank": 3}
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(config_from_dict(raw), world_size=4, out_dir=tmp_path)
    summary = run_processes(config_from_dict(raw), world_size=4, out_dir=tmp_path)
    assert summary["resumed_from_step"] == 5
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"max |cp 2 x fsdp 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND


def test_cp2_x_tensor_parallel_2_trains_what_one_process_trains(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Each tensor-parallel rank's heads go round the ring of the same tp rank of each
    context-parallel rank; the sequence-parallel norms split the rank's own tokens."""
    raw = with_context(spec(tmp_path), tmp_path, workers=4)
    raw["strategy"]["tensor_parallel"] = 2
    run_processes(config_from_dict(raw), world_size=4, out_dir=tmp_path)
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"max |cp 2 x tp 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND


def test_a_cp2_checkpoint_resumes_under_ddp_with_its_adam_state(
    cp2: Path, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """From cp 2's step 5 to the end on one DDP process: Adam's moments come through (a
    restart of them would move every weight by about the learning rate, 1e-2)."""
    saved = ckpt.resolve(cp2 / "runs" / "cp")
    start = saved.path.parent / ckpt.dir_name(5)
    raw = spec(tmp_path)
    raw["strategy"], raw["scaling"] = {"kind": "ddp"}, {"num_workers": 1}
    summary = run_processes(
        config_from_dict(raw), world_size=1, out_dir=tmp_path, resume_from=start
    )
    assert summary["resumed_from_step"] == 5
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert max_difference(weights, reference) < FP64_BOUND


def test_packed_chat_rows_under_cp2_train_what_one_process_trains(tmp_path: Path) -> None:
    """Packed chat rows, whose unscored prompt tokens fall unevenly on the two ranks: each
    rank weighs its mean loss by its share of the row's scored tokens, so the gradient is
    one process's mean over them."""
    raw = {
        "name": "cp-chat",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64},
        "data": {
            "kind": "chat",
            "train": [str(write_jsonl(tmp_path / "chat.jsonl", sums(40)))],
            "tokenizer": str(make_tokenizer(tmp_path / "tok")),
            "vocab_size": 32,
            "eval_samples": 2,
            "val_fraction": 0.2,
            "pack": True,
        },
        "train": {"steps": 6, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"every_steps": 3},
    }
    reference = one_process(raw, tmp_path / "one")
    summary = run_processes(
        config_from_dict(with_context(raw, tmp_path / "cp2", workers=2)),
        world_size=2,
        out_dir=tmp_path / "cp2",
    )
    weights = torch.load(tmp_path / "cp2" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"max |packed chat, cp 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    expected = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-12)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_hugging_face_family_under_cp2_trains_what_one_process_trains(
    tmp_path: Path, family: str
) -> None:
    """Its attention layers call the ring through transformers' attention functions
    (qwen2 by its own forward, llama by trainstack's pipeline layers), its rotary angles
    from each token's global position."""
    raw = {
        "name": f"cp-{family}",
        "model": {"kind": "hf", "hf": {"model_type": family, **HF_WIDTHS}, "block_size": 16},
        "data": {"vocab_size": 16, "order": 2, "eval_samples": 16},
        "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"every_steps": 3},
    }
    reference = one_process(raw, tmp_path / "one")
    job = with_context(raw, tmp_path / "cp2", workers=2)
    run_processes(config_from_dict(job), world_size=2, out_dir=tmp_path / "cp2")
    weights = torch.load(tmp_path / "cp2" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"max |{family}, cp 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(weights, raw)
