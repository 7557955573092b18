"""`data.kind: text` with a Hugging Face `tokenizers` file trained here, end to end on a
Ray worker group: the driver prepares the files, the workers read only the prepared
token files, the model learns, and the summary reports bits per byte next to gzip -9
and xz -9 on the same held-out bytes. The run is also where a worker-group run's own
reporting is held: `strategy.kind: auto`'s choice (DDP) in the summary and MLflow,
throughput from the steady state's steps, the start-up's parts, one progress record
per window. (A tracking server that does not answer: `test_user_models_on_ray`.)"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import mlflow
import pytest

from trainstack.config import config_from_dict
from trainstack.runtime.launcher import run_job
from trainstack.runtime.progress import ProgressDisplay

VOCAB = 300
LINES = [
    "def area(width, height):\n    return width * height\n",
    "for item in items:\n    total += item.price * item.count\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "if value is None:\n    raise ValueError('value is required')\n",
]


def train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(LINES * 10, trainer=trainer)
    tokenizer.save(str(path))


def test_text_with_a_bpe_tokenizer_trains_on_the_layout_auto_picks_and_reports_it(
    ray_cluster: None, tmp_path: Path
) -> None:
    data = tmp_path / "code"
    data.mkdir()
    for i in range(6):  # the lines in a different order per file: there is something to learn
        (data / f"m{i}.py").write_text("".join(LINES[(i + k) % 4] for k in range(4)) * 12)
    tokenizer = tmp_path / "tokenizer.json"
    train_tokenizer(tokenizer)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in data.iterdir())
    raw = {
        "name": "bpe-text",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {
            "kind": "text",
            "train": [str(data / "*.py")],
            "val_fraction": 0.2,
            "tokenizer": str(tokenizer),
            "vocab_size": vocab,
            "eval_samples": 8,
        },
        "train": {"steps": 60, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 5},
        "strategy": {"kind": "auto"},  # the plan picks DDP for a model this small
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "log": {"every_steps": 10},
    }
    cfg = config_from_dict(raw)
    stream = io.StringIO()
    summary = run_job(cfg, display=ProgressDisplay(mode="jsonl", stream=stream))
    # Untrained, the held-out loss is about ln(vocab) = 5.7 nats; the files repeat four
    # lines, so a trained model predicts most tokens (measured: 1.17 after 60 steps,
    # 73% of held-out tokens right).
    assert summary["eval_loss"] < 2.0 and summary["eval_accuracy"] > 0.5, summary
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert summary["eval_tokens"] == 8 * 16 and summary["eval_bytes"] > summary["eval_tokens"]
    bits = summary["eval_loss"] * summary["eval_tokens"] / summary["eval_bytes"] / math.log(2)
    assert math.isclose(summary["eval_bits_per_byte"], bits, rel_tol=1e-9)
    # On so few bytes the compressors' headers dominate (measured: gzip 5.93, xz 8.0).
    assert (
        summary["eval_bits_per_byte"] < summary["gzip_bits_per_byte"] < summary["xz_bits_per_byte"]
    )
    prepared = list((tmp_path / "runs" / "prepared").glob("*/meta.json"))
    assert len(prepared) == 1 and f'"vocab_size": {vocab}' in prepared[0].read_text()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in data.iterdir()) == before

    # The layout `auto` chose, said in the summary and in MLflow.
    assert summary["strategy"] == "ddp"
    choice = summary["strategy_choice"]
    assert choice.startswith("strategy.kind=auto chose ddp 2 (strategy.kind=ddp")
    run = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri).get_run(summary["mlflow_run_id"])
    assert run.data.tags["trainstack.strategy_choice"] == choice
    assert run.data.params["strategy.kind"] == "ddp"
    # Throughput counts the global batch (every worker's tokens) over the steady state's
    # mean step, which the steps after warm-up take no more than the whole training time.
    samples, tokens = cfg.train.global_batch_size, cfg.train.global_batch_size * 16
    step_s = summary["step_time_s"]
    assert summary["tokens_per_s"] == pytest.approx(tokens / step_s, rel=1e-9)
    assert summary["samples_per_s"] == pytest.approx(samples / step_s, rel=1e-9)
    assert 0 < step_s * (cfg.train.steps - 3) < summary["train_s"] < summary["wall_s"]
    assert summary["mfu"] is None  # CPU: no known peak FLOP/s
    # Start-up, part by part, adds up to the time to the first step, within the run's
    # wall time (one machine: the driver's and the workers' clocks agree).
    startup = summary["startup"]
    parts = ("checks_s", "ray_connect_s", "worker_group_start_s", "model_build_s", "first_step_s")
    assert all(startup[part] >= 0 for part in parts), startup
    assert sum(startup[part] for part in parts) == pytest.approx(startup["to_first_step_s"])
    assert summary["time_to_first_step_s"] == startup["to_first_step_s"] < summary["wall_s"]
    assert startup["worker_group_start_s"] > 0.5  # the group's processes start and import torch
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert records[-1]["loss"] < records[0]["loss"]
    for r in records:  # each window: the global batch's tokens over its mean step
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-9)
        assert r["peak_mem_bytes"] > 0
