"""`log.eval_every_steps`: the held-out loss logged mid-run is the loss of the weights
at that step, and evaluating never changes what is trained."""

import json
from pathlib import Path

import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import held_out_loss


def spec(storage: Path, *, eval_every: int) -> dict:
    return {
        "name": f"eval-every-{eval_every}",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 24},
        # float64: the logged loss and the one recomputed here agree to 1e-9 on any CPU
        "train": {
            "steps": 20,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "log": {"every_steps": 5, "eval_every_steps": eval_every},
        "checkpoint": {"storage_path": str(storage), "every_steps": 10},
    }


def test_logged_eval_loss_is_the_held_out_loss_of_that_steps_weights(tmp_path: Path) -> None:
    cfg = config_from_dict(spec(tmp_path / "runs", eval_every=10))
    run_processes(cfg, world_size=2, out_dir=tmp_path / "out")
    records = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").open()]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert list(evals) == [10]  # every 10 steps, and the final one is the summary's

    raw = spec(tmp_path / "runs", eval_every=10)
    at_10, at_20 = (ckpt.read(ckpt.run_dir_for(cfg) / ckpt.dir_name(s)) for s in (10, 20))
    assert abs(evals[10] - held_out_loss(raw, at_10.full_weights())) < 1e-9
    assert abs(evals[10] - held_out_loss(raw, at_20.full_weights())) > 1e-3  # not the last

    plain = config_from_dict(spec(tmp_path / "runs", eval_every=0))
    run_processes(plain, world_size=2, out_dir=tmp_path / "plain")
    trained = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    untouched = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    assert all(torch.equal(trained[k], untouched[k]) for k in trained)
