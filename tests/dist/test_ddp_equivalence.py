"""DDP's math: N gloo processes train exactly what one process trains on the same global
batch (in float64, within `FP64_BOUND` on any CPU)."""

from pathlib import Path

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND, assert_trained, max_difference


def tiny_spec(
    *,
    workers: int,
    micro_batch: int,
    steps: int = 10,
    storage: Path,
    activation_checkpointing: bool = False,
) -> dict:
    return {
        "name": "ddp-equivalence",
        "model": {
            "kind": "gpt",
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 32,
            "block_size": 16,
            "activation_checkpointing": activation_checkpointing,
        },
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {
            "steps": steps,
            "global_batch_size": 16,
            "micro_batch_size": micro_batch,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "scaling": {"num_workers": workers},
        "log": {"every_steps": 5},
        "checkpoint": {"storage_path": str(storage)},
    }


def train_weights(
    tmp_path: Path, *, workers: int, micro_batch: int, activation_checkpointing: bool = False
) -> dict[str, torch.Tensor]:
    out = tmp_path / f"w{workers}b{micro_batch}c{activation_checkpointing}"
    raw = tiny_spec(
        workers=workers,
        micro_batch=micro_batch,
        storage=out,
        activation_checkpointing=activation_checkpointing,
    )
    cfg = config_from_dict(raw)
    run_processes(cfg, world_size=workers, out_dir=out)
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.parametrize("micro_batch", [4, 8])
def test_two_workers_match_one_worker_with_twice_the_micro_batch(
    tmp_path: Path, micro_batch: int
) -> None:
    reference = train_weights(tmp_path, workers=1, micro_batch=2 * micro_batch)
    ddp = train_weights(tmp_path, workers=2, micro_batch=micro_batch)
    assert max_difference(ddp, reference) < FP64_BOUND
    assert_trained(reference, tiny_spec(workers=1, micro_batch=8, storage=tmp_path))


def test_activation_checkpointing_under_ddp_trains_the_same_weights(tmp_path: Path) -> None:
    plain = train_weights(tmp_path, workers=2, micro_batch=4)
    recomputed = train_weights(tmp_path, workers=2, micro_batch=4, activation_checkpointing=True)
    assert max_difference(recomputed, plain) < FP64_BOUND
