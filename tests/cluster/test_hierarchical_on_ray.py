"""The node-aware all-reduce on a simulated Ray cluster: 4 Ray Train workers on 2 nodes
of 2 find their nodes from Ray (each worker's node id), reduce in two levels, and train
what one process trains (float64, within `FP64_BOUND`), with one leader per node
sending the gradients across nodes once per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.models import build_model, num_params
from trainstack.runtime.launcher import run_job

from bounds import FP64_BOUND, max_difference, one_process
from multinode import WORKER_NODE, SimulatedCluster


def spec(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": "two-level-on-ray",
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": 8, "global_batch_size": 16, "micro_batch_size": 4, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "strategy": {"kind": "ddp", "allreduce": "hierarchical"},
        "scaling": {"num_workers": 4, "resources_per_worker": {WORKER_NODE: 1}},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"every_steps": 4, "progress": "quiet"},
    }


def test_four_workers_on_two_nodes_reduce_node_by_node_and_match_one_process(
    sim_cluster: SimulatedCluster, tmp_path: Path
) -> None:
    for node in list(sim_cluster.nodes):  # two nodes of two workers each
        sim_cluster.kill(node)
    nodes = [sim_cluster.add_worker(cpus=2), sim_cluster.add_worker(cpus=2)]
    sim_cluster.wait_for_capacity(4)
    try:
        check_two_levels(tmp_path)
    finally:  # the folder's other tests count one worker a node
        for node in nodes:
            sim_cluster.kill(node)
        sim_cluster.wait_for_capacity(0)


def check_two_levels(tmp_path: Path) -> None:
    raw = spec(tmp_path)
    notes: list[str] = []

    def on_record(record: dict[str, Any]) -> None:
        notes.extend(record.get("notes", []) if record.get("event") == "start" else [])

    summary = run_job(config_from_dict(raw), on_record=on_record)
    assert any("hierarchical over 2 nodes (2, 2 ranks)" in note for note in notes), notes
    weights = ckpt.verify(Path(summary["final_checkpoint"])).full_weights()
    reference = one_process(raw, tmp_path / "ref")
    diff = max_difference(weights, reference)
    print(f"two levels on Ray vs one process: {diff:.3g}")
    assert diff < FP64_BOUND
    params = num_params(build_model(config_from_dict(raw).model, vocab_size=16, seed=0))
    assert summary["cross_node_bytes_per_step"] == 8 * params  # 2(2 - 1)/2 of every float64
    assert weights["tok_emb.weight"].dtype == torch.float64
