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
