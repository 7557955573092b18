"""Pre-flight checks a large built-in model by its shapes alone: built on the meta
device (no weights initialised on the driver), not run on a sample; a small one is
still built and run as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainstack.config import config_from_dict
from trainstack.data.tokens import write_token_file
from trainstack.models.gpt import GPT
from trainstack.runtime import preflight as preflight_module
from trainstack.runtime.preflight import META_BUILD_PARAMS, preflight


def spec(tmp_path: Path, *, width: int) -> dict[str, Any]:
    tokens = tmp_path / "tokens.bin"
    write_token_file(tokens, np.random.default_rng(0).integers(0, 8000, 20_000))
    return {
        "model": {"n_layer": 12, "n_head": 8, "n_embd": width, "block_size": 128},
        "data": {
            "kind": "tokens",
            "train": [str(tokens)],
            "vocab_size": 8000,
            "val_fraction": 0.1,
            "eval_samples": 4,
        },
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "scaling": {"num_workers": 1},
    }


@pytest.mark.parametrize(("width", "runs_a_sample"), [(768, False), (64, True)])
def test_a_large_builtin_model_is_checked_on_the_meta_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int, runs_a_sample: bool
) -> None:
    ran: list[bool] = []
    original = preflight_module.check_model_runs
    monkeypatch.setattr(
        preflight_module, "check_model_runs", lambda *a, **k: ran.append(True) or original(*a, **k)
    )
    cfg = config_from_dict(spec(tmp_path, width=width))
    params, _ = GPT.count_parameters(cfg.model, vocab_size=8000)
    assert (params > META_BUILD_PARAMS) is not runs_a_sample
    report = preflight(cfg)
    assert report.params == params
    assert report.shapes["tok_emb.weight"] == [8000, width]
    assert bool(ran) is runs_a_sample
