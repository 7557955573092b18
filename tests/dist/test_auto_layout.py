"""`strategy.kind: auto` on a model too big for DDP on its devices: the plan picks a
layout that shards the model's state, and that layout then trains.

The devices are stated (`scaling.device_memory`): 1.15 GB each, of which the plan
keeps 1 GiB for the framework, leaves too little for DDP's 101 MB of fp32 weights,
gradients and AdamW state of a 6.3M-parameter GPT (plus activations), and enough for
layouts that split it over the two workers."""

from pathlib import Path

from trainstack.config import config_from_dict
from trainstack.planner.choose import resolve_auto
from trainstack.runtime.local import run_processes

STEPS = 20


def spec(storage: Path) -> dict:
    return {
        "name": "auto",
        "model": {"kind": "gpt", "n_layer": 8, "n_head": 4, "n_embd": 256, "block_size": 32},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "strategy": {"kind": "auto"},
        "scaling": {"num_workers": 2, "device_memory": "1.15GB"},
        "checkpoint": {"storage_path": str(storage)},
        "log": {"every_steps": 5},
    }


def test_auto_shards_a_model_ddp_cannot_hold_and_the_choice_trains(tmp_path: Path) -> None:
    chosen, why = resolve_auto(config_from_dict(spec(tmp_path)))
    assert chosen.strategy.kind != "ddp"
    assert "(ddp would need about" in why  # more than the 1.15 GB stated
    summary = run_processes(chosen, world_size=2, out_dir=tmp_path / "out")
    assert summary["strategy"] == chosen.strategy.kind
    assert summary["steps"] == STEPS
    # Untrained: ln 16 = 2.77 nats; the data's floor 1.14.
    assert summary["final_loss"] < 2.5
