"""`data.kind: text` with a Hugging Face `tokenizers` file trained here, end to end on a
Ray worker group: the driver prepares the files, the workers read only the prepared
token files, the model learns, and the summary reports bits per byte next to gzip -9
and xz -9 on the same held-out bytes; all while its MLflow server does not answer, which
never stops training."""

from __future__ import annotations

import math
import socket
from pathlib import Path

from trainstack.config import config_from_dict
from trainstack.runtime.launcher import run_job

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


def test_text_with_a_bpe_tokenizer_trains_on_a_worker_group_with_tracking_down(
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
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"progress": "quiet"},
    }
    with socket.socket() as closed:  # bound, never listening: the server refuses connections
        closed.bind(("127.0.0.1", 0))
        raw["tracking"] = {
            "backend": "mlflow",
            "uri": f"http://127.0.0.1:{closed.getsockname()[1]}",
        }
        summary = run_job(config_from_dict(raw))
    assert summary["mlflow_run_id"] is None
    assert summary["tracking_error"].startswith("mlflow tracking failed")
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
