"""Background checkpoints write exactly what synchronous ones write: for DDP (whole
files), FSDP over two ranks (DCP's sharded save, its collectives on the saver's own
gloo group) and ZeRO-2 (DeepSpeed's partitioned optimizer state), every file of every
checkpoint has the same sha256 whether the step waited for the write or not, and the
runs train the same weights. Gloo processes, no Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import assert_trained

STEPS = 6


def spec(storage: Path, *, strategy: dict[str, Any], background: bool) -> dict[str, Any]:
    return {
        "name": "async-ckpt",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 4},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.1},
        "strategy": strategy,
        "scaling": {"num_workers": 2},
        "checkpoint": {
            "every_steps": 2,
            "keep": 10,
            "storage_path": str(storage),
            "async_save": background,
        },
        "log": {"every_steps": 1},
    }


def checkpoint_contents(storage: Path) -> dict[str, dict[str, Any]]:
    """What each checkpoint holds, file by file (each verified against its manifest):
    a torch file's loaded contents (its bytes name the temporary file it was written
    as), DCP's index by what it indexes, any other file by its sha256. Of a rank's RNG
    file, the torch and numpy states: Python's `random`, which training never draws
    from, starts from the OS's entropy in each process."""
    found = {}
    for folder in sorted((storage / "async-ckpt").glob("checkpoint_*")):
        manifest = json.loads((folder / ckpt.MANIFEST).read_text())
        saved = ckpt.verify(folder)
        contents: dict[str, Any] = {}
        for name, entry in manifest["files"].items():
            if name.startswith("rng/"):
                rng = saved.load(name)
                contents[name] = (rng["torch"], rng["numpy"]["keys"])
            elif name.endswith(".pt"):
                contents[name] = saved.load(name)
            elif name.endswith("/.metadata"):
                reader = dcp.FileSystemReader(folder / name.removesuffix("/.metadata"))
                contents[name] = reader.read_metadata().state_dict_metadata
            else:
                contents[name] = entry["sha256"]
        found[folder.name] = contents
    return found


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal nests of dicts, lists and tensors (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize(
    "strategy",
    [{"kind": "ddp"}, {"kind": "fsdp"}, {"kind": "zero", "stage": 2}],
    ids=["ddp", "fsdp", "zero2"],
)
def test_a_background_checkpoint_is_the_synchronous_one_file_for_file(
    tmp_path: Path, strategy: dict[str, Any]
) -> None:
    summaries = {}
    for background in (False, True):
        raw = spec(tmp_path / str(background), strategy=strategy, background=background)
        out = tmp_path / f"out-{background}"
        summaries[background] = run_processes(config_from_dict(raw), world_size=2, out_dir=out)

    synchronous, background = (checkpoint_contents(tmp_path / str(b)) for b in (False, True))
    assert list(synchronous) == [ckpt.dir_name(s) for s in (2, 4, 6)]
    assert_same(background, synchronous)
    assert summaries[True]["checkpoint_saves"] == 2  # steps 2 and 4; the final one follows
    weights = torch.load(tmp_path / "out-True" / "model.pt", weights_only=True)
    assert_trained(weights, spec(tmp_path, strategy=strategy, background=True))
