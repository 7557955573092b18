"""Whole nodes lost mid-run on a simulated multi-node cluster (ZeRO-2): the worker group
restarts on a replacement node from the newest checkpoint that verifies, loses at
most `checkpoint.every_steps` steps, and ends bitwise equal to an uninterrupted run; no
placement group or actor of the run outlives it, and ZeRO's checkpoint exports whole
weights. Restarting a group is the launcher's, whatever the strategy (the elastic test
loses nodes under DDP): each strategy's own recovery is tested with killed workers
(tests/ray, tests/dist), and `benchmarks/chaos.py` loses nodes under every strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ray.util import state

from trainstack import checkpoint as ckpt
from trainstack.cli import main
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes
from trainstack.runtime.launcher import run_job

from multinode import WORKER_NODE, SimulatedCluster

STRATEGIES: dict[str, dict[str, Any]] = {
    "zero2": {"kind": "zero", "stage": 2},
}


def spec(tmp_path: Path, strategy: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "node-loss",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": 24, "global_batch_size": 8, "micro_batch_size": 2},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "strategy": strategy,
        "scaling": {"num_workers": 2, "resources_per_worker": {WORKER_NODE: 1}},
        "checkpoint": {"every_steps": 4, "storage_path": str(tmp_path / "runs")},
        "failure": {"max_failures": 3},
        "log": {"every_steps": 2, "progress": "quiet"},
        "faults": {"step_delay_s": 0.2},  # a real model's pace: a loss lands where it is aimed
    }


def leftovers() -> tuple[list[Any], list[Any]]:
    """Placement groups and actors still alive in the cluster."""
    groups = [g for g in state.list_placement_groups() if g.state != "REMOVED"]
    actors = [a for a in state.list_actors() if a.state == "ALIVE"]
    return groups, actors


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_lost_node_mid_step_and_mid_checkpoint_costs_at_most_every_steps_and_nothing_else(
    sim_cluster: SimulatedCluster, tmp_path: Path, strategy: str
) -> None:
    sim_cluster.workers(2)
    raw = spec(tmp_path, STRATEGIES[strategy])
    # The driver hears a record a little after rank 0 sends it, and each loss holds it up
    # while a node goes and comes: one loss per worker group, at a record of the group now
    # running, and steps slow enough that the kill lands at about the step it was meant
    # for. Step 6 is heard mid-step; step 16's record goes out just before its checkpoint
    # is written and uploaded, so the second loss cuts that save (or the step after it).
    kill_after = [6, 16]
    killed: list[int] = []
    starts: list[int] = []  # the step each worker group resumed from

    def lose_a_node(record: dict[str, Any]) -> None:
        if record.get("event") == "start":
            starts.append(record["resumed_from_step"])
        if "event" in record or not kill_after or record["step"] < kill_after[0]:
            return
        if len(starts) != len(killed) + 1:  # a record the lost group sent before it went
            return
        killed.append(record["step"])
        kill_after.pop(0)
        sim_cluster.kill(sim_cluster.running_training())
        sim_cluster.add_worker()  # a replacement machine joins

    summary = run_job(config_from_dict(raw), on_record=lose_a_node)

    print(f"{strategy}: groups resumed from steps {starts}, recovery {summary['recovery']}")
    assert killed == [6, 16]
    assert summary["restarts"] == 2, summary["recovery"]
    every = raw["checkpoint"]["every_steps"]
    for restart in summary["recovery"]:
        assert restart["steps_lost"] is not None and 0 <= restart["steps_lost"] <= every
    final = ckpt.verify(Path(summary["final_checkpoint"]))
    assert final.step == 24

    ref = {**raw, "name": "reference", "scaling": {"num_workers": 2}, "faults": {}}
    run_processes(config_from_dict(ref), world_size=2, out_dir=tmp_path / "ref")
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    weights = final.full_weights()
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name

    if strategy == "zero2":  # ZeRO's shards consolidate into weights the model loads
        exported = tmp_path / "model.pt"
        assert (
            main(["export", str(ckpt.run_dir_for(config_from_dict(raw))), "--out", str(exported)])
            == 0
        )
        assert torch.equal(
            torch.load(exported, weights_only=True)["tok_emb.weight"], weights["tok_emb.weight"]
        )

    groups, actors = leftovers()
    assert groups == [], groups
    train_actors = [a for a in actors if "Train" in a.class_name or "Queue" in a.class_name]
    assert train_actors == [], [a.class_name for a in train_actors]
    # A run that streams no Ray Data started no dataset manager at any of its 3 starts.
    assert state.list_actors(filters=[("class_name", "=", "DatasetManager")]) == []
