"""`trainstack run jobs/configs/stdlib_gpt.yaml --summary-json`, shortened: a GPT trained
on the Python standard library's own sources learns to use context, ending below what
any model that ignores it can score on the same held-out bytes; the summary (console and
JSON) gives its bits per byte beside gzip -9's and xz -9's, and the text was prepared
once on first use.

That the full run beats gzip -9 (after about 3,250 steps) is measured, not tested: the
docs/data.md's "Bits per byte against gzip and xz" gives the figures, and
`make demo-stdlib` reproduces them."""

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from trainstack import checkpoint as ckpt
from trainstack.config import load_config
from trainstack.data.bits_per_byte import held_out_eval_bytes
from trainstack.data.paths import resolve_data

from user_shell import BIN, ROOT, run

STEPS = 300
"""Of the spec's 10000: 77k training bytes, seconds of training on 2 cores."""


def order0_bits_per_byte(data: bytes) -> float:
    """The fewest bits per byte any context-blind (order-0) model spends on `data`: the
    entropy of its own byte frequencies, the best such model for exactly these bytes."""
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / len(data)
    return float(-(p * np.log2(p)).sum())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_stdlib_gpt_learns_context_on_held_out_bytes_through_the_cli(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    sets = [f"train.steps={STEPS}", f"checkpoint.storage_path={tmp_path / 'runs'}"]
    # Any Ray state-API question the run's processes ask goes to a port this test holds
    # and never listens on, as one asked of another Ray instance on the machine would go
    # unanswered for this run; a helper that asks (Ray Train's placement-group cleaner)
    # then says so on the console, each second.
    with socket.socket() as unanswered:
        unanswered.bind(("127.0.0.1", 0))
        proc = run(
            [
                *(str(BIN / "trainstack"), "run", "jobs/configs/stdlib_gpt.yaml"),
                *("--set", sets[0], "--set", sets[1]),
                *("--summary-json", str(summary_path), "--progress", "lines"),
            ],
            unset=("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",),  # the suite's; here, trainstack's
            RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{unanswered.getsockname()[1]}",
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    # The held-out bytes: the first 256 held-out windows' targets, which the bytes
    # tokenizer makes 256 * 64 bytes (16 KiB, the start of uuid.py on CPython 3.11).
    assert summary["eval_bytes"] == summary["eval_tokens"] == 256 * 64
    spec = resolve_data(load_config(str(ROOT / "jobs/configs/stdlib_gpt.yaml"), sets))
    held_out, _ = held_out_eval_bytes(spec)  # what the run scored, from its prepared tokens
    assert len(held_out) == summary["eval_bytes"]
    # Measured (CPython 3.11 stdlib, 2 CPU workers): 3.627 bits per byte after 300 steps
    # against 4.760 for the best order-0 model of these bytes (an untrained model: 8).
    context_blind = order0_bits_per_byte(held_out)
    assert summary["eval_bits_per_byte"] < context_blind, (summary, context_blind)
    for key in ("steps", "tokens_per_s", "samples_per_s", "mfu", "world_size", "wall_s"):
        assert key in summary, key
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert summary["strategy"] == "ddp" and summary["mfu"] is None  # no peak FLOPs on CPU
    assert f"step {STEPS}/{STEPS}" in proc.stdout
    # The file holds this run's summary: the one it printed, ending at its last checkpoint.
    assert f"{summary['final_loss']:.4f} (held-out)" in proc.stdout
    final = ckpt.verify(Path(summary["final_checkpoint"]))
    assert final.step == STEPS and final.path.is_relative_to(tmp_path / "runs")
    line = next(row for row in proc.stdout.splitlines() if "bits/byte" in row)
    gzip, xz = summary["gzip_bits_per_byte"], summary["xz_bits_per_byte"]
    assert f"{summary['eval_bits_per_byte']:.3f} (held-out)  gzip -9 {gzip:.3f}" in line
    assert f"  xz -9 {xz:.3f}" in line
    prepared = tmp_path / "runs" / "prepared"
    assert len(list(prepared.glob("*/meta.json"))) == 1 and not list(prepared.glob(".partial-*"))
    assert "trainstack: prepared " in proc.stderr  # on first use, before Ray started
    # The embedded instance starts no PreemptionWatcher (nothing drains its one node), so
    # the console has none of the core_worker error lines Ray prints about one.
    assert "PreemptionWatcher" not in proc.stdout + proc.stderr
    # Nor a placement-group cleaner: the instance, and with it the group, ends with the
    # run, and the cleaner's state-API questions (answered by another Ray on the machine,
    # or, here, by no one) never reach the console.
    assert "PlacementGroupCleaner" not in proc.stdout + proc.stderr
