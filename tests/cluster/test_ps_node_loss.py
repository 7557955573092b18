"""Parameter-server placement on a simulated multi-node cluster: shards reserve a CPU
each and prefer nodes that do not train; the node holding them lost mid-run, they are
restarted elsewhere from their checkpoints and the run still learns; with no such node
they start on the training nodes; with local servers per node (two levels), a lost
node's local server costs at most the worker steps it held unsent, its restarted
workers go to the global shards, and the staleness bound holds end to end; no actor of
a run outlives it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from ray.util import state

from trainstack.config import config_from_dict
from trainstack.runtime.launcher import run_job

from multinode import WORKER_NODE, SimulatedCluster

PS_ACTORS = ("ParameterServerShard", "ParameterServerWorker", "ClockBoard", "LocalServer")


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
    return live("ParameterServerShard")


def live(class_name: str) -> list[Any]:
    return state.list_actors(
        filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")], detail=True
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_local_server_costs_at_most_its_unsent_steps_and_its_workers_go_on(
    sim_cluster: SimulatedCluster, tmp_path: Path
) -> None:
    """2 nodes × 2 workers, a local server on each (ssp, bound 1; each sends every 2 worker
    steps; parameters at most 1 clock old), the shards on a service node. The node of
    a local server is lost mid-run with its two workers: Ray restarts the workers on a
    machine that joins and they push to the shards directly; the lost server's unsent
    steps (at most sync_every - 1) are the only loss, and the run still learns."""
    for node in list(sim_cluster.nodes):  # two nodes of two workers each
        sim_cluster.kill(node)
    nodes = [sim_cluster.add_worker(cpus=2), sim_cluster.add_worker(cpus=2)]
    service = sim_cluster.add_service_node(cpus=2)
    sim_cluster.wait_for_capacity(4)
    raw = spec(tmp_path, workers=4, steps=100)
    raw["strategy"].update(local_servers="per_node", sync_every=2, max_local_staleness=1)
    raw["faults"] = {"step_delay_s": 0.05}  # still mid-run when the node is gone
    placed: dict[str, list[Any]] = {}  # the local servers and workers before the loss
    joined: list[Any] = []

    def lose_a_local_servers_node(record: dict[str, Any]) -> None:
        if "event" in record or record["step"] < 20 or placed:
            return
        while len(placed.get("local", [])) < 2 or len(placed.get("workers", [])) < 4:
            placed["local"] = live("LocalServer")  # the state API may answer late at first
            placed["workers"] = live("ParameterServerWorker")
        lost = next(n for n in nodes if n.node_id == placed["local"][0].node_id)
        sim_cluster.kill(lost)
        joined.append(sim_cluster.add_worker(cpus=2))  # a replacement machine joins

    try:
        check_a_lost_local_server(raw, lose_a_local_servers_node, placed)
    finally:  # the cluster goes back to what the folder's tests count on
        for node in [*sim_cluster.nodes]:
            sim_cluster.kill(node)
        sim_cluster.kill(service)


def check_a_lost_local_server(
    raw: dict[str, Any], on_record: Any, placed: dict[str, list[Any]]
) -> None:
    from trainstack.ps.local import clock_lag_bound

    summary = run_job(config_from_dict(raw), on_record=on_record)
    ps = summary["ps"]
    print(
        f"on shards {ps['workers_on_shards']}, lost {ps['pushes_lost']}, lag max "
        f"{ps['clock_lag_max']}, final loss {summary['final_loss']:.3f}"
    )
    # each local server started on the node of its workers
    worker_nodes = {a.node_id for a in placed["workers"]}
    assert {a.node_id for a in placed["local"]} == worker_nodes and len(worker_nodes) == 2
    assert len(ps["local_servers_lost"]) == 1
    kept = sorted(w for server in ps["local_servers"] for w in server["workers"])
    lost_workers = [w for w, restarts in enumerate(ps["worker_restarts"]) if restarts]
    assert ps["workers_on_shards"] == lost_workers == sorted({0, 1, 2, 3} - set(kept))
    assert ps["worker_restarts"].count(1) == 2
    steps = raw["train"]["steps"]
    assert ps["worker_clocks"] == [steps] * 4 and summary["steps"] == steps
    assert 0 <= ps["pushes_lost"] <= raw["strategy"]["sync_every"] - 1
    bound = clock_lag_bound(config_from_dict(raw))
    assert bound == 1 + 1 + 1 and 0 < ps["clock_lag_max"] <= bound
    # Measured over 100 steps (the node lost at step 22-25): 1.17-1.35 in 6 runs, 3 of
    # them beside a busy core, against the floor's 1.14, a context-blind model's 2.42 and
    # the untrained model's 2.72 (ln 16 = 2.77). Over 60 steps it was 1.37-1.72, the run
    # still descending, and 1.71 missed this bound in a clean clone's suite.
    assert summary["final_loss"] < summary["entropy_floor"] + 0.5
    wait_until_no_ps_actor_is_left()
