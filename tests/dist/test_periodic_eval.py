"""`log.eval_every_steps`: the held-out loss logged mid-run is the loss of the weights
at that step, and evaluating never changes what is trained."""

import json
from pathlib import Path

import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.data import build_corpus
from trainstack.data.sharding import eval_batches
from trainstack.models import build_model
from trainstack.runtime.local import run_processes


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, written out here as a plain-PyTorch reference."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def spec(storage: Path, *, eval_every: int) -> dict:
    return {
        "name": f"eval-every-{eval_every}",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 24},
        "train": {"steps": 20, "global_batch_size": 16, "micro_batch_size": 4},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "log": {"every_steps": 5, "eval_every_steps": eval_every},
        "checkpoint": {"storage_path": str(storage), "every_steps": 10},
    }


@torch.no_grad()
def one_process_eval_loss(cfg, weights: dict[str, torch.Tensor]) -> float:
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    model.load_state_dict(weights)
    model.eval()
    batches = eval_batches(
        build_corpus(cfg.data),
        count=cfg.data.eval_samples,
        seq_len=cfg.model.block_size,
        micro_batch_size=5,
        rank=0,
        world_size=1,
    )
    total = sum(float(next_token_loss(model(x), y)) * y.numel() for x, y in batches)
    return total / sum(y.numel() for _, y in batches)


def test_logged_eval_loss_is_the_held_out_loss_of_that_steps_weights(tmp_path: Path) -> None:
    cfg = config_from_dict(spec(tmp_path / "runs", eval_every=10))
    run_processes(cfg, world_size=2, out_dir=tmp_path / "out")
    records = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").open()]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert list(evals) == [10]  # every 10 steps, and the final one is the summary's

    at_10 = ckpt.read(ckpt.run_dir_for(cfg) / ckpt.dir_name(10))
    assert abs(evals[10] - one_process_eval_loss(cfg, at_10.full_weights())) < 1e-5

    plain = config_from_dict(spec(tmp_path / "runs", eval_every=0))
    run_processes(plain, world_size=2, out_dir=tmp_path / "plain")
    trained = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    untouched = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    assert all(torch.equal(trained[k], untouched[k]) for k in trained)
