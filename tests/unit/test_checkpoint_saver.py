"""The checkpoint saver in one process: a background save returns before its files are
written and commits what the state was when it was asked for, a failed write leaves the
checkpoint before it the newest, and the host copy keeps what a checkpoint must."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.runtime.checkpointing import (
    CheckpointSaver,
    DirectoryCheckpointStore,
    HostStager,
)


def manifest_for(step: int):  # type: ignore[no-untyped-def]
    def manifest(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return ckpt.build_manifest(
            step=step,
            samples_seen=step * 4,
            tokens_seen=step * 64,
            spec={"name": "saver"},
            strategy="ddp",
            world_size=1,
            files=entries,
            metrics={"step": step},
            model_shapes={"w": [8]},
            data={},
        )

    return manifest


class GatedStore(DirectoryCheckpointStore):
    """A directory store whose commit waits until the test opens the gate (or fails the
    commit of `fail_at`, after its files were copied: a crash mid-commit)."""

    def __init__(self, run_dir: Path, *, fail_at: str | None = None) -> None:
        super().__init__(run_dir, rank=0, distributed=False)
        self.gate = threading.Event()
        self.fail_at = fail_at

    def commit(
        self, staging: Path, *, name: str, metrics: dict[str, Any], group: Any = None
    ) -> None:
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the gate never opened: the save ran on the training thread")
        if name == self.fail_at:
            (self.run_dir / f".partial-{name}").mkdir()
            raise OSError(f"disk full while committing {name}")
        super().commit(staging, name=name, metrics=metrics)


def saver(store: DirectoryCheckpointStore, *, background: bool) -> CheckpointSaver:
    return CheckpointSaver(
        rank=0,
        distributed=False,
        store=store,
        checkpoints=store.run_dir,
        keep=5,
        background=background,
    )


def test_a_background_save_returns_first_and_commits_the_state_it_was_given(
    tmp_path: Path,
) -> None:
    store = GatedStore(tmp_path)
    weights = torch.arange(8, dtype=torch.float32)
    save = saver(store, background=True)
    save.save(
        lambda: {"model.pt": {"w": weights}},
        name=ckpt.dir_name(2),
        metrics={},
        manifest=manifest_for(2),
    )
    # The commit is still waiting for the gate: a synchronous save would have timed out.
    assert not (tmp_path / ckpt.dir_name(2)).exists()
    weights.add_(100.0)  # the training thread's next step changes the weights in place
    store.gate.set()
    save.wait()

    saved = ckpt.verify(tmp_path / ckpt.dir_name(2))
    assert torch.equal(saved.load("model.pt")["w"], torch.arange(8, dtype=torch.float32))
    assert save.times.saves == 1 and save.times.write_s > 0


def test_a_synchronous_save_has_committed_when_it_returns(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    store.gate.set()
    save = saver(store, background=False)
    save.save(
        lambda: {"model.pt": {"w": torch.ones(8)}},
        name=ckpt.dir_name(2),
        metrics={},
        manifest=manifest_for(2),
    )
    assert ckpt.verify(tmp_path / ckpt.dir_name(2)).step == 2


def test_a_failed_background_write_fails_the_run_and_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    store = GatedStore(tmp_path, fail_at=ckpt.dir_name(4))
    store.gate.set()
    save = saver(store, background=True)
    for step in (2, 4):
        save.save(
            lambda step=step: {"model.pt": {"w": torch.ones(8) * step}},
            name=ckpt.dir_name(step),
            metrics={},
            manifest=manifest_for(step),
        )
    with pytest.raises(
        RuntimeError,
        match=r"writing a checkpoint failed: disk full while committing checkpoint_0+4",
    ):
        save.wait()
    start = ckpt.find_start(tmp_path, resume_from=None, on_corrupt="fail")
    assert start is not None and start.step == 2
    save.wait()  # the failure is raised once


def test_the_host_copy_keeps_ties_types_and_values_and_reuses_its_buffers() -> None:
    tied = torch.randn(4, 3)
    optimizer_state = {
        "param_groups": [{"lr": 0.1, "params": [0]}],
        "state": {0: {"step": torch.tensor(3.0)}},
    }
    files = {
        "model.pt": OrderedDict(wte=tied, head=tied, bias=torch.zeros(3)),
        "optim.pt": optimizer_state,
    }
    stager = HostStager()
    staged = stager.stage(files)

    model = staged["model.pt"]
    assert type(model) is OrderedDict and list(model) == ["wte", "head", "bias"]
    assert model["wte"] is model["head"] and model["wte"] is not tied  # one copy, tied
    assert torch.equal(model["wte"], tied)
    optimizer_state["param_groups"][0]["lr"] = 0.05  # the scheduler's next step
    assert staged["optim.pt"]["param_groups"][0]["lr"] == 0.1

    pointer = model["bias"].data_ptr()
    files["model.pt"]["bias"] = torch.ones(3)
    again = stager.stage(files)["model.pt"]["bias"]
    assert again.data_ptr() == pointer and torch.equal(again, torch.ones(3))
