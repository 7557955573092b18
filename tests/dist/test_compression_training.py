"""Compression inside real DDP training (gloo processes): it converges, it sends fewer
bytes, and its per-rank state survives a killed worker exactly."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

# The tolerance each method is held to: final held-out loss relative to uncompressed
# DDP after the same 300 steps, with the defaults (error feedback, AdamW's moments on
# the ranks). Measured: casts 0.00%, qsgd 4-bit 0.07%, sign 0.12%, powersgd r4 0.20%,
# top-k 1% 0.43% (2.32% compressing raw gradients), random-k 10% 2.86% (docs/compression.md
# states the same).
# bf16 (0.00%) is the same `Cast` codec as fp16 in another dtype (both round-trip in
# tests/unit/test_compression.py): fp16, whose range is the narrower, trains here.
TOLERANCE = {
    "fp16": 0.005,
    "qsgd": 0.01,
    "sign": 0.01,
    "powersgd": 0.01,
    "topk": 0.01,
    "randk": 0.05,
}
SETTINGS: dict[str, dict[str, Any]] = {
    "qsgd": {"bits": 4},
    "powersgd": {"rank": 4},
    "topk": {"ratio": 0.01},
    "randk": {"ratio": 0.1},
    # killed inside the warm-up, with AdamW's moments on the ranks
    "topk-dgc": {"kind": "topk", "ratio": 0.01, "momentum_correction": True, "warmup_steps": 16},
    # killed after moving to top-k 1% at step 10 on a modelled 1 Mbit/s link: there dense
    # is modelled about 3 s a step slower (0.4 MB of gradient), which no codec time a
    # loaded CPU measures comes near, so the choice never turns on the machine's speed (at
    # 50 Mbit/s the margin was 64 ms: a starved run measured more and went back to dense)
    "auto": {"kind": "auto", "ratio": 0.01, "auto_link_gbit": 0.001},
    # the link timed, not given
    "auto-measured": {"kind": "auto", "ratio": 0.01},
}


def spec(storage: Path, kind: str, *, steps: int = 300, kill: int | None = None) -> dict:
    compression = {"kind": kind, "min_numel": 256, **SETTINGS.get(kind, {})}
    return {
        "name": f"compress-{kind}",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 128},
        "train": {"steps": steps, "global_batch_size": 32, "micro_batch_size": 16},
        "optim": {"lr": 3e-3, "warmup_steps": 10},
        "scaling": {"num_workers": 2},
        # Saves every 5 steps for the kill tests; the 300-step runs save at the end only.
        "checkpoint": {"storage_path": str(storage), "every_steps": 5 if steps <= 20 else 0},
        "log": {"every_steps": 1 if steps <= 20 else 50},
        "compression": compression,
        "faults": {"kill_at_steps": [kill], "rank": 1} if kill else {},
    }


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("dense")
    return run_processes(config_from_dict(spec(path, "none")), world_size=2, out_dir=path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TOLERANCE))
def test_error_feedback_training_ends_near_the_dense_loss_with_fewer_bytes(
    kind: str, dense: dict[str, Any], tmp_path: Path
) -> None:
    summary = run_processes(config_from_dict(spec(tmp_path, kind)), world_size=2, out_dir=tmp_path)
    gap = summary["final_loss"] / dense["final_loss"] - 1
    assert gap <= TOLERANCE[kind], f"{kind}: {100 * gap:.2f}% above dense"
    assert summary["bytes_on_wire"] < dense["bytes_on_wire"] / 1.9
    assert summary["compression_ratio"] == pytest.approx(
        dense["bytes_on_wire"] / summary["bytes_on_wire"], rel=1e-6
    )


def events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["topk-dgc", "powersgd", "auto"])
def test_killed_worker_resumes_compressed_training_bitwise(kind: str, tmp_path: Path) -> None:
    run_processes(
        config_from_dict(spec(tmp_path / "a", kind, steps=20)), world_size=2, out_dir=tmp_path / "a"
    )
    killed = config_from_dict(spec(tmp_path / "b", kind, steps=20, kill=13))
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(killed, world_size=2, out_dir=tmp_path / "b")
    run_processes(killed, world_size=2, out_dir=tmp_path / "b")

    starts = [e for e in events(tmp_path / "b") if e.get("event") == "start"]
    assert [s["resumed_from_step"] for s in starts] == [0, 10]
    # residuals, warm-up, moments and PowerSGD state restored: no note beyond the layout's
    assert starts[1]["notes"] == starts[0]["notes"]
    assert starts[0]["notes"][0].startswith(f"compression: {kind.split('-')[0]}")
    losses = {e["step"]: e["loss"] for e in events(tmp_path / "b") if "event" not in e}
    reference = {e["step"]: e["loss"] for e in events(tmp_path / "a") if "event" not in e}
    assert losses == reference
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    assert all(torch.equal(a[name], b[name]) for name in a)
    if kind == "auto":  # the move is an event of the run, once (the kill came after it)
        moves = [e for e in events(tmp_path / "b") if e.get("event") == "compression"]
        assert [(e["step"], e["ratio"]) for e in moves] == [(10, 0.01)], moves
        assert moves[0]["reason"].startswith("top-k 0.01: modelled step")


def test_auto_times_the_link_it_runs_on_and_decides_by_it(tmp_path: Path) -> None:
    """`kind: auto` with no link given: the ranks time all-reduces after step 5 and fit
    the link; the summary reports that measured link, and any move's reason names it.
    Given `auto_link_gbit`, the link is the spec's and nothing is timed."""
    measured = run_processes(
        config_from_dict(spec(tmp_path / "m", "auto-measured", steps=12)),
        world_size=2,
        out_dir=tmp_path / "m",
    )
    link = measured["compression_link"]
    assert link is not None and link["measured"], link  # None: no probe ran
    assert link["bytes_per_s"] > 0 and link["latency_s"] >= 0
    for move in (e for e in events(tmp_path / "m") if e.get("event") == "compression"):
        assert link["description"] in move["reason"] or move["step"] <= 5, move

    modelled = run_processes(
        config_from_dict(spec(tmp_path / "a", "auto", steps=12)),
        world_size=2,
        out_dir=tmp_path / "a",
    )
    assumed = modelled["compression_link"]
    assert not assumed["measured"] and assumed["bytes_per_s"] == 0.001e9 / 8
