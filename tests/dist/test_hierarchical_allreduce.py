"""Node-aware all-reduce: four gloo processes as 2 nodes × 2 ranks reduce each bucket
within the node, across the two leaders, and back, and train what one process trains
(float64, within `FP64_BOUND`), with the bytes that cross nodes counted and equal to
the formula: a leader sends 2(n − 1)/n of each bucket, one copy per node. Compressed,
only the leaders' level is: 2 nodes × 2 ranks with top-k train what 2 ranks (one per
node, each with its node's samples) train with top-k, and what crosses nodes is the
top-k payload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainstack.config import config_from_dict
from trainstack.models import build_model, num_params
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND, assert_trained, max_difference, one_process


def spec(
    storage: Path, *, allreduce: str = "flat", workers: int = 1, micro: int = 4
) -> dict[str, Any]:
    return {
        "name": "two-level",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {
            "steps": 10,
            "global_batch_size": 16,
            "micro_batch_size": micro,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": {"kind": "ddp", "allreduce": allreduce, "bucket_cap_mb": 0.01},
        "scaling": {"num_workers": workers},
        "checkpoint": {"storage_path": str(storage / "runs")},
    }


def test_two_nodes_of_two_ranks_reduce_in_two_levels_and_train_what_one_process_trains(
    tmp_path: Path,
) -> None:
    allreduce = "hierarchical"
    reference = one_process(spec(tmp_path / "ref"), tmp_path / "ref")
    raw = spec(tmp_path / "nodes", allreduce=allreduce, workers=4)
    summary = run_processes(
        config_from_dict(raw), world_size=4, out_dir=tmp_path / "nodes", ranks_per_node=2
    )
    weights = torch.load(tmp_path / "nodes" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"{allreduce}: max |w - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
    # Every gradient (float64, in several buckets) crosses once per step: 2(2 - 1)/2 of it.
    cfg = config_from_dict(raw)
    params = num_params(build_model(cfg.model, vocab_size=16, seed=0))
    assert summary["cross_node_bytes_per_step"] == 8 * params


def test_auto_measures_both_levels_and_takes_what_the_model_says_is_faster(
    tmp_path: Path,
) -> None:
    """Auto times all-reduces within each node and across the leaders, and takes two
    levels only when they model faster than a flat ring; here every "node" shares one
    machine's loopback, so the links are alike and flat usually wins. Either way the run
    trains what one process trains, and the summary shows the figures it chose from."""
    from trainstack.compression.auto import LinkFit
    from trainstack.strategies.hierarchical import choose_levels

    reference = one_process(spec(tmp_path / "ref"), tmp_path / "ref")
    raw = spec(tmp_path / "nodes", allreduce="auto", workers=4)
    summary = run_processes(
        config_from_dict(raw), world_size=4, out_dir=tmp_path / "nodes", ranks_per_node=2
    )
    chose = summary["allreduce_auto"]
    print(f"auto: {chose}")
    weights = torch.load(tmp_path / "nodes" / "model.pt", weights_only=True)
    assert max_difference(weights, reference) < FP64_BOUND
    params = num_params(build_model(config_from_dict(raw).model, vocab_size=16, seed=0))
    again = choose_levels(
        LinkFit(**chose["intra"]),
        LinkFit(**chose["inter"]),
        grad_bytes=8 * params,  # float64 gradients
        ranks_per_node=(2, 2),
    )
    assert again.figures() == chose
    assert chose["chosen"] == ("hierarchical" if again.two_levels_s < again.flat_s else "flat")
    assert ("cross_node_bytes_per_step" in summary) == (chose["chosen"] == "hierarchical")


def test_hierarchical_on_one_node_is_the_flat_all_reduce_compressed_or_not(
    tmp_path: Path,
) -> None:
    """With every rank on one node there is one level: DDP's all-reduce, or the
    compression hook on it (registering both once made setup fail)."""
    for kind in ("none", "fp16"):
        runs = []
        for allreduce in ("flat", "hierarchical"):
            raw = spec(tmp_path / f"{kind}-{allreduce}", allreduce=allreduce, workers=2)
            raw["compression"] = {"kind": kind}
            raw["train"]["precision"] = "fp32"
            out = tmp_path / f"{kind}-{allreduce}-out"
            summary = run_processes(config_from_dict(raw), world_size=2, out_dir=out)
            assert "cross_node_bytes_per_step" not in summary
            runs.append(torch.load(out / "model.pt", weights_only=True))
        assert max_difference(*runs) == 0


def test_auto_stays_flat_when_every_rank_has_a_node_of_its_own(tmp_path: Path) -> None:
    raw = spec(tmp_path, allreduce="auto", workers=2)
    summary = run_processes(
        config_from_dict(raw), world_size=2, out_dir=tmp_path / "out", ranks_per_node=1
    )
    assert "cross_node_bytes_per_step" not in summary and "allreduce_auto" not in summary


def test_compressed_only_across_nodes_equals_one_rank_per_node_with_that_compression(
    tmp_path: Path,
) -> None:
    """Rank r of 4 reads samples [4r, 4r + 4) of each global batch, so node k (ranks 2k,
    2k + 1) reads what rank k of 2 reads with micro-batches of 8. Each leader hands
    random-k (its coordinates drawn from the seed and the step, as rank k's are) its
    node's mean gradient (the node's sum · n / W), with
    error feedback and SGD's momentum kept on the leader, as rank k does with its own.
    Float32 (the codecs encode float32): the runs differ by the rounding of a mean of 8
    taken as two means of 4. SGD, as Adam's update would hide a wrongly scaled sum."""
    from trainstack.compression.sparsify import RandK

    compression = {"kind": "randk", "ratio": 0.25, "min_numel": 64}
    optim = {"kind": "sgd", "lr": 0.5, "momentum": 0.9, "warmup_steps": 2, "grad_clip": 0}
    nodes = spec(tmp_path / "n", allreduce="hierarchical", workers=4)
    per_node = spec(tmp_path / "p", workers=2, micro=8)
    for raw in (nodes, per_node):
        raw.update(compression=compression, optim=optim)
        raw["train"]["precision"] = "fp32"
    summary = run_processes(
        config_from_dict(nodes), world_size=4, out_dir=tmp_path / "n", ranks_per_node=2
    )
    run_processes(config_from_dict(per_node), world_size=2, out_dir=tmp_path / "p")
    weights = torch.load(tmp_path / "n" / "model.pt", weights_only=True)
    reference = torch.load(tmp_path / "p" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"compressed across nodes vs one rank per node: {diff:.3g}")
    assert diff < 1e-5
    assert_trained(reference, per_node)
    # Across the 2 leaders: random-k's values all-reduced (its indices come from the seed),
    # tensors under min_numel all-reduced dense in fp32; a ring of 2 sends each once.
    model = build_model(config_from_dict(nodes).model, vocab_size=16, seed=0)
    shapes = [p.shape for p in model.parameters()]
    dense = sum(4 * s.numel() for s in shapes if s.numel() < 64)
    sparse = sum(RandK(0.25, seed=0).payload_bytes(s) for s in shapes if s.numel() >= 64)
    assert summary["cross_node_bytes_per_step"] == dense + sparse
