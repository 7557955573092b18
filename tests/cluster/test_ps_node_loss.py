"""Parameter-server placement on a simulated multi-node cluster: shards reserve a CPU
each and prefer nodes that do not train; the node holding them lost mid-run, they are
restarted elsewhere from their checkpoints and the run still learns; with no such node
they start on the training nodes; no actor of a run outlives it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from ray.util import state

from trainstack.config import config_from_dict
from trainstack.runtime.launcher import run_job

from multinode import WORKER_NODE, SimulatedCluster

PS_ACTORS = ("ParameterServerShard", "ParameterServerWorker", "ClockBoard")


def spec(tmp_path: Path, *, workers: int, steps: int) -> dict[str, Any]:
    return {
        "name": "ps-node-loss",
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": steps, "global_batch_size": 16, "micro_batch_size": 16 // workers},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 0},
        "strategy": {
            "kind": "ps",
            "num_shards": 2,
            "consistency": "ssp",  # async's staleness makes the final loss vary run to run
            "staleness_bound": 1,
            "checkpoint_every_updates": 4,
        },
        "scaling": {
            "num_workers": workers,
            "resources_per_worker": {WORKER_NODE: 1},
            "start_timeout_s": 60,
        },
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "failure": {"max_failures": 1},
        "log": {"every_steps": 2, "progress": "quiet"},
    }


def live_shards() -> list[Any]:
    return state.list_actors(
        filters=[("class_name", "=", "ParameterServerShard"), ("state", "=", "ALIVE")],
        detail=True,
    )


def wait_until_no_ps_actor_is_left() -> None:
    """Every actor of the run goes (the driver's kills take a moment to show); one left
    alive keeps this waiting until the test's timeout fails it."""
    while True:
        alive = [a for a in state.list_actors() if a.state == "ALIVE"]
        if not [a.class_name for a in alive if a.class_name in PS_ACTORS]:
            return
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shards_on_a_lost_service_node_restart_elsewhere_and_the_run_still_learns(
    sim_cluster: SimulatedCluster, tmp_path: Path
) -> None:
    sim_cluster.workers(3)
    service = sim_cluster.add_service_node(cpus=2)  # room for both shards, and no training
    raw = spec(tmp_path, workers=2, steps=80)
    raw["faults"] = {"step_delay_s": 0.05}  # still mid-run when the node is gone
    placed: list[Any] = []  # the shards when their node was lost
    replaced: list[Any] = []  # the restarted shards, once both are up

    def lose_the_shards_node(record: dict[str, Any]) -> None:
        if "event" in record or record["step"] < 20 or replaced:
            return
        if not placed:
            placed.extend(live_shards())
            sim_cluster.kill(service)
            sim_cluster.add_worker()  # a replacement machine joins
        elif len(shards := live_shards()) == 2:
            replaced.extend(shards)

    summary = run_job(config_from_dict(raw), on_record=lose_the_shards_node)

    ps = summary["ps"]
    print(f"shard failures {ps['shard_failures']}, final loss {summary['final_loss']:.3f}")
    assert {a.node_id for a in placed} == {service.node_id}, [a.node_id for a in placed]
    assert [a.required_resources.get("CPU") for a in placed] == [1.0, 1.0]
    assert len(replaced) == 2 and service.node_id not in {a.node_id for a in replaced}
    # Both shards were restarted from a checkpoint (not the seed), losing at most one
    # checkpoint interval of updates each.
    every = raw["strategy"]["checkpoint_every_updates"]
    assert sorted(f["shard"] for f in ps["shard_failures"]) == [0, 1], ps["shard_failures"]
    for lost in ps["shard_failures"]:
        assert lost["restored_version"] >= every and 0 <= lost["updates_lost"] <= every
    assert ps["worker_clocks"] == [80, 80] and summary["steps"] == 80
    # Measured: 1.13 in 3 runs (unkilled, 1.13 to 1.16), against the floor's 1.14 and the
    # untrained model's 2.72 (ln 16 = 2.77).
    assert summary["final_loss"] < summary["entropy_floor"] + 0.3
    wait_until_no_ps_actor_is_left()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_a_node_free_of_training_the_shards_start_on_training_nodes(
    sim_cluster: SimulatedCluster, tmp_path: Path
) -> None:
    for node in list(sim_cluster.service_nodes):
        sim_cluster.kill(node)
    nodes = sim_cluster.workers(3)  # one worker and two one-CPU shards fill them exactly
    placed: list[Any] = []

    def see_the_shards(record: dict[str, Any]) -> None:
        if "event" not in record and not placed:
            placed.extend(live_shards())

    summary = run_job(
        config_from_dict(spec(tmp_path, workers=1, steps=6)), on_record=see_the_shards
    )

    assert summary["steps"] == 6
    assert len(placed) == 2
    assert {a.node_id for a in placed} <= {node.node_id for node in nodes}
    assert [a.required_resources.get("CPU") for a in placed] == [1.0, 1.0]
    wait_until_no_ps_actor_is_left()
