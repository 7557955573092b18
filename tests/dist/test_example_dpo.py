"""The fine-tuning example as a user runs it (examples/specs/chat_lora.yaml, then
chat_dpo.yaml, then examples/check_preferences.py), on gloo processes instead of Ray: a
tiny "pretrained" Llama learns the chat set's sums through LoRA adapters, they are
merged into a new base, DPO on preference pairs (the right sum chosen, one off rejected)
trains new adapters over it, and the exported adapter, loaded by peft over the base,
prefers the chosen answer of held-out pairs more often than the base does.

The bound: at least 10 points over the base (measured: 69% -> 85%). An untrained DPO
run cannot reach it: its adapters add nothing, so it prefers exactly what the base does.
A broken loss, here the same run with chosen and rejected swapped, ends below the base."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from trainstack.cli.app import main as cli
from trainstack.config import load_config
from trainstack.runtime.gloo_processes import run_processes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BOUND = 0.10
"""Held-out preference accuracy over the base's, at least."""


def run_spec(name: str, data: Path, runs: Path, out: Path, *sets: str) -> dict[str, Any]:
    """examples/specs/`name`, its data under `data` and its runs under `runs`."""
    text = (EXAMPLES / "specs" / name).read_text().replace("data/chat", str(data))
    spec = out.with_suffix(".yaml")
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(text)
    cfg = load_config(str(spec), [f"checkpoint.storage_path={runs}", *sets])
    summary: dict[str, Any] = run_processes(cfg, world_size=2, out_dir=out)
    return summary


@pytest.mark.slow
def test_the_examples_dpo_adapter_prefers_the_right_sums(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import check_preferences

    import prepare_chat

    data = tmp_path / "chat"
    prepare_chat.main(data)
    runs = tmp_path / "runs"
    sft = run_spec("chat_lora.yaml", data, runs, tmp_path / "sft")
    print(f"SFT with LoRA: held-out loss {sft['eval_loss']:.3f}")
    merged = ["--merge", "--out", str(tmp_path / "sft.pt"), "--hf-dir", str(data / "sft")]
    assert cli(["export", str(runs / "chat-lora"), *merged]) == 0

    results = {}
    pairs = [json.loads(line) for line in (data / "pairs.jsonl").read_text().splitlines()]
    swapped = [{**p, "chosen": p["rejected"], "rejected": p["chosen"]} for p in pairs]
    (data / "swapped.jsonl").write_text("".join(json.dumps(p) + "\n" for p in swapped))
    for run, sets in (("chat-dpo", ()), ("chat-dpo-swapped", ("name=chat-dpo-swapped",))):
        if run.endswith("swapped"):
            sets = (*sets, f"data.train={data / 'swapped.jsonl'}")
        dpo = run_spec("chat_dpo.yaml", data, runs, tmp_path / run, *sets)
        adapter = tmp_path / f"{run}-adapter"
        assert cli(["export", str(runs / run), "--adapter-dir", str(adapter)]) == 0
        results[run] = check_preferences.main(
            str(data / "sft"), str(adapter), str(data / "pairs_val.jsonl")
        )
        print(run, {k: round(v, 3) for k, v in dpo.items() if k.startswith("eval_")})

    tuned, broken = results["chat-dpo"], results["chat-dpo-swapped"]
    assert tuned["after"] >= tuned["before"] + BOUND, tuned
    assert broken["after"] < broken["before"], broken  # the broken loss fails the bound
