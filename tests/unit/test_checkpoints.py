"""Checkpoint rules without training: which checkpoint a rerun may start from (the same
run's spec), and which checkpoints pruning keeps."""

import json
from pathlib import Path
from typing import Any

import pytest

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict, config_to_dict
from trainstack.files import file_sha256

STEPS = 20


def spec(storage: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "demo",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "eval_samples": 8},
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(storage), "every_steps": 5},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def save(directory: Path, *, step: int, raw: dict[str, Any], payload: bytes = b"w") -> Path:
    """A checkpoint as the loop commits it: files, then the manifest listing them."""
    directory.mkdir(parents=True)
    (directory / "model.pt").write_bytes(payload)
    entry = {"sha256": file_sha256(directory / "model.pt"), "size": len(payload)}
    manifest = {
        "format": ckpt.FORMAT_VERSION,
        "step": step,
        "samples_seen": step * 16,
        "spec": config_to_dict(config_from_dict(raw)),
        "files": {"model.pt": entry},
    }
    ckpt.write_manifest(directory, manifest)
    return directory


def start_of(raw: dict[str, Any], *, resume_from: Path | None = None) -> ckpt.Checkpoint | None:
    return ckpt.checked_start(
        config_from_dict(raw), resume_from=resume_from, shapes={}, data_fingerprint=""
    )


def finished_run(tmp_path: Path, *, step: int = STEPS) -> Path:
    raw = spec(tmp_path)
    return save(ckpt.run_dir_for(config_from_dict(raw)) / ckpt.dir_name(step), step=step, raw=raw)


@pytest.mark.parametrize(
    ("changes", "listed"),
    [
        ({"strategy": {"kind": "zero"}}, "strategy.kind 'ddp' → 'zero'"),
        (
            {"strategy": {"kind": "pipeline", "microbatches": 2}},
            "strategy.kind 'ddp' → 'pipeline'; strategy.microbatches 4 → 2",
        ),
        ({"compression": {"kind": "topk"}}, "compression.kind 'none' → 'topk'"),
        ({"train": {"steps": 10}}, "train.steps 20 → 10"),
        ({"scaling": {"num_workers": 1}}, "scaling.num_workers 2 → 1"),
        ({"data": {"seed": 7}}, "data.seed 1234 → 7"),
    ],
    ids=["zero", "pipeline", "topk", "fewer-steps", "layout", "data"],
)
def test_rerun_of_a_finished_run_with_another_spec_is_refused_naming_the_keys(
    tmp_path: Path, changes: dict[str, Any], listed: str
) -> None:
    finished_run(tmp_path)
    with pytest.raises(ckpt.CheckpointError) as refused:
        start_of(spec(tmp_path, **changes))
    message = str(refused.value)
    assert "\n" not in message
    assert "run 'demo' already has a checkpoint at step 20 (finished)" in message
    assert f"from another spec: {listed};" in message
    assert "--set name=NEW" in message and f"--resume-from {tmp_path / 'demo'}" in message


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"log": {"every_steps": 1, "progress": "quiet", "eval_every_steps": 5}},
        {"checkpoint": {"every_steps": 2, "keep": 1, "on_corrupt": "restart"}},
        {"failure": {"max_failures": 3}, "faults": {"kill_at_steps": [3], "rank": 1}},
        {"tracking": {"backend": "mlflow", "uri": "sqlite:///x.db"}},
        {"data": {"allow_changed": True, "seed": 7}},
    ],
    ids=["identical", "log", "checkpoint", "failures", "tracking", "data-allowed"],
)
def test_keys_that_change_nothing_the_run_computes_are_neither_refused_nor_listed(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    path = finished_run(tmp_path)
    start = start_of(spec(tmp_path, **changes))
    assert start is not None and start.path == path
    with pytest.raises(ckpt.CheckpointError, match=r"another spec: optim\.lr 0\.003 → 0\.01; to"):
        start_of(spec(tmp_path, **changes, optim={"lr": 0.01}))


def test_layout_counts_against_a_finished_run_unless_more_steps_continue_it(
    tmp_path: Path,
) -> None:
    finished_run(tmp_path)
    other_layout = {"train": {"micro_batch_size": 4}, "scaling": {"num_workers": 1}}
    with pytest.raises(
        ckpt.CheckpointError, match=r"num_workers 2 → 1; train\.micro_batch_size 8 → 4; to"
    ):
        start_of(spec(tmp_path, **other_layout))
    more = spec(tmp_path, **other_layout)
    more["train"]["steps"] = 30
    start = start_of(more)
    assert start is not None and start.step == STEPS


def test_an_unfinished_run_resumes_on_another_world_size_but_not_another_strategy(
    tmp_path: Path,
) -> None:
    finished_run(tmp_path, step=10)
    start = start_of(spec(tmp_path, train={"micro_batch_size": 16}, scaling={"num_workers": 1}))
    assert start is not None and start.step == 10
    with pytest.raises(ckpt.CheckpointError, match=r"step 10 in .*'ddp' → 'zero'"):
        start_of(spec(tmp_path, strategy={"kind": "zero"}))


def test_resume_from_another_run_may_change_the_spec_the_runs_own_checkpoint_may_not(
    tmp_path: Path,
) -> None:
    source = finished_run(tmp_path / "source")
    raw = spec(tmp_path, strategy={"kind": "zero"}, train={"steps": 30})
    start = start_of(raw, resume_from=source)
    assert start is not None and start.path == source
    finished_run(tmp_path)  # now the run has a checkpoint of its own: --resume-from is moot
    with pytest.raises(ckpt.CheckpointError, match=r"strategy\.kind 'ddp' → 'zero'"):
        start_of(raw, resume_from=source)


def test_a_spec_this_version_cannot_read_is_compared_as_written(tmp_path: Path) -> None:
    path = finished_run(tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["spec"]["model"]["retired_key"] = 1
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=r"model\.retired_key 1 → absent"):
        start_of(spec(tmp_path))


# ---- pruning ------------------------------------------------------------------------


def steps_left(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(run_dir)]


def cut_off(path: Path) -> Path:
    """As if the save stopped part-way: a file shorter than its manifest says."""
    (path / "model.pt").write_bytes(b"")
    return path


def test_pruning_keeps_the_only_valid_checkpoint_behind_newer_incomplete_ones(
    tmp_path: Path,
) -> None:
    raw = spec(tmp_path)
    save(tmp_path / ckpt.dir_name(10), step=10, raw=raw)
    cut_off(save(tmp_path / ckpt.dir_name(15), step=15, raw=raw))
    (tmp_path / ckpt.dir_name(20)).mkdir()  # a save in progress: no manifest yet
    ckpt.prune(tmp_path, keep=1)
    assert steps_left(tmp_path) == [20, 15, 10]
    start = ckpt.find_start(tmp_path, resume_from=None, on_corrupt="fail", warn=print)
    assert start is not None and start.step == 10  # past the cut-off 15 and unfinished 20


def test_pruning_keeps_the_newest_valid_ones_and_drops_older_cut_off_saves(
    tmp_path: Path,
) -> None:
    raw = spec(tmp_path)
    for step in (5, 10, 15, 20, 25):
        save(tmp_path / ckpt.dir_name(step), step=step, raw=raw)
    cut_off(tmp_path / ckpt.dir_name(20))
    cut_off(tmp_path / ckpt.dir_name(10))
    ckpt.prune(tmp_path, keep=2)
    assert steps_left(tmp_path) == [25, 15]


def test_pruning_deletes_nothing_when_nothing_verifies(tmp_path: Path) -> None:
    raw = spec(tmp_path)
    for step in (5, 10, 15):
        cut_off(save(tmp_path / ckpt.dir_name(step), step=step, raw=raw))
    ckpt.prune(tmp_path, keep=1)
    assert steps_left(tmp_path) == [15, 10, 5]
