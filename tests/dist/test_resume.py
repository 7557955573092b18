"""Checkpoints: exact resume after a killed worker, resume on another world size, and
fallback past corrupt checkpoints. Gloo processes, no Ray."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import trainstack
from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND, max_difference


def spec(
    storage: Path, *, workers: int = 2, micro: int = 4, kill: int | None = None, **train: Any
) -> dict:
    return {
        "name": "resume",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": 20, "global_batch_size": 16, "micro_batch_size": micro, **train},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.1},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_steps": 5, "keep": 10, "storage_path": str(storage)},
        "log": {"every_steps": 1},
        "faults": {"kill_at_steps": [kill], "rank": 1} if kill else {},
    }


def losses(out: Path) -> dict[int, float]:
    """Loss per step; a replayed step keeps its latest value."""
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "event" not in r}


def starts(out: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "start"]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 20 steps of `spec` on two ranks, never killed: the run every resume matches."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_processes(config_from_dict(spec(out)), world_size=2, out_dir=out)
    return out


@pytest.mark.parametrize("mid_save", [False, True], ids=["after-save", "mid-save"])
def test_resume_after_a_killed_worker_is_bitwise_identical(
    tmp_path: Path, uninterrupted: Path, mid_save: bool
) -> None:
    """Rank 1 dies before step 13. Once checkpoint 10 has landed, the rerun resumes from
    it. With `mid_save`, rank 1 dies while checkpoint 10 is still being written in the
    background: nothing of it is committed, and the rerun resumes from checkpoint 5."""
    raw = spec(tmp_path / "b", kill=13)
    raw["faults"]["mid_save"] = mid_save
    killed = config_from_dict(raw)
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(killed, world_size=2, out_dir=tmp_path / "b")
    run_dir = ckpt.run_dir_for(killed)
    newest = ckpt.latest_valid(run_dir, warn=lambda _: None)[0]
    assert newest is not None and newest.step == (5 if mid_save else 10)
    assert (run_dir / ckpt.dir_name(10)).exists() is not mid_save
    run_processes(killed, world_size=2, out_dir=tmp_path / "b")  # the rerun resumes

    assert [s["resumed_from_step"] for s in starts(tmp_path / "b")] == [0, newest.step]
    resumed = losses(tmp_path / "b")
    assert sorted(resumed) == list(range(1, 21))
    assert resumed == losses(uninterrupted)  # every step's loss, exactly
    reference = weights(uninterrupted)
    for name, value in weights(tmp_path / "b").items():
        assert torch.equal(value, reference[name]), name


def test_two_worker_checkpoint_resumes_on_one_worker_without_skipping_data(tmp_path: Path) -> None:
    """In float64: the resumed run is the one-process run within `FP64_BOUND` on any CPU;
    a resume that skipped or repeated a batch would land 1e-3 or more away."""
    fp64 = {"precision": "fp64"}
    one = spec(tmp_path / "ref", workers=1, micro=8, **fp64)
    run_processes(config_from_dict(one), world_size=1, out_dir=tmp_path / "ref")
    two = config_from_dict(spec(tmp_path / "run", workers=2, micro=4, kill=13, **fp64))
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(two, world_size=2, out_dir=tmp_path / "run")
    resumed = config_from_dict(spec(tmp_path / "run", workers=1, micro=8, **fp64))
    run_processes(resumed, world_size=1, out_dir=tmp_path / "run")

    assert [s["resumed_from_step"] for s in starts(tmp_path / "run")] == [0, 10]
    final = ckpt.verify(ckpt.run_dir_for(resumed) / ckpt.dir_name(20))
    assert final.samples_seen == 20 * 16
    assert final.manifest["world"]["world_size"] == 1
    assert max_difference(weights(tmp_path / "run"), weights(tmp_path / "ref")) < FP64_BOUND


def test_corrupt_checkpoints_are_skipped_for_the_newest_valid_one(tmp_path: Path) -> None:
    cfg = config_from_dict(spec(tmp_path, workers=1, micro=8))
    run_processes(cfg, world_size=1, out_dir=tmp_path / "first")
    run_dir = ckpt.run_dir_for(cfg)
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [
        ckpt.dir_name(s) for s in (20, 15, 10, 5)
    ]
    model = run_dir / ckpt.dir_name(20) / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    model.write_bytes(bytes(data))
    (run_dir / ckpt.dir_name(15) / "manifest.json").unlink()  # as if the save was cut short

    warnings: list[str] = []
    start = ckpt.find_start(run_dir, resume_from=None, on_corrupt="fail", warn=warnings.append)
    assert start is not None and start.step == 10
    assert len(warnings) == 2
    assert "checkpoint_00000020" in warnings[0] and "model.pt: sha256" in warnings[0]
    assert "checkpoint_00000015" in warnings[1] and "manifest.json: missing" in warnings[1]

    run_processes(cfg, world_size=1, out_dir=tmp_path / "again")  # resumes at 10, redoes 11..20
    first, again = weights(tmp_path / "first"), weights(tmp_path / "again")
    assert all(torch.equal(again[n], first[n]) for n in first)


def test_no_valid_checkpoint_stops_unless_on_corrupt_restart(tmp_path: Path) -> None:
    cfg = config_from_dict(spec(tmp_path, workers=1, micro=8))
    run_processes(cfg, world_size=1, out_dir=tmp_path / "out")
    run_dir = ckpt.run_dir_for(cfg)
    for path in ckpt.list_checkpoints(run_dir):
        (path / "manifest.json").write_text("{not json")

    with pytest.raises(ckpt.CheckpointError, match="on_corrupt=restart"):
        ckpt.find_start(run_dir, resume_from=None, on_corrupt="fail", warn=lambda m: None)
    warnings: list[str] = []
    assert (
        ckpt.find_start(run_dir, resume_from=None, on_corrupt="restart", warn=warnings.append)
        is None
    )
    assert "starting fresh" in warnings[-1]


def test_checkpoint_files_load_with_weights_only(tmp_path: Path) -> None:
    cfg = config_from_dict(spec(tmp_path, workers=1, micro=8))
    run_processes(cfg, world_size=1, out_dir=tmp_path / "out")
    final = ckpt.verify(ckpt.run_dir_for(cfg) / ckpt.dir_name(20))
    assert set(final.manifest["files"]) == {
        "model.pt",
        "optimizer.pt",
        "scheduler.pt",
        "rng/rank_00000.pt",
    }
    for name in final.manifest["files"]:
        final.load(name)  # torch.load(weights_only=True) accepts every file
    assert final.manifest["spec_sha256"] == ckpt.spec_hash(final.manifest["spec"])
    assert final.manifest["tokens_seen"] == 20 * 16 * 16
    import ray  # the one test here that needs Ray: its version, from Ray itself

    versions = {"trainstack": trainstack.__version__, "torch": torch.__version__}
    assert final.manifest["versions"] == {**versions, "ray": ray.__version__}


def test_a_run_with_another_model_refuses_the_old_checkpoints(tmp_path: Path) -> None:
    raw = spec(tmp_path, workers=1, micro=8)
    run_processes(config_from_dict(raw), world_size=1, out_dir=tmp_path / "out")
    raw["model"]["n_embd"] = 48
    # Compatibility is decided by parameter names and shapes, listed where they differ.
    differs = (
        r"tensors differ: blocks\.0\.attn\.c_proj\.bias \[32\] in the checkpoint, "
        r"\[48\] now"
    )
    with pytest.raises(ckpt.CheckpointError, match=differs):
        run_processes(config_from_dict(raw), world_size=1, out_dir=tmp_path / "again")


def test_resume_is_refused_when_the_data_changed_unless_allowed(tmp_path: Path) -> None:
    """A token file rewritten under the same name between a killed run and its rerun:
    the checkpoint's data fingerprint no longer matches, so the rerun stops with one
    line naming both fingerprints and the override; `data.allow_changed` resumes."""
    import numpy as np

    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(np.random.default_rng(0).integers(0, 16, 20_000, np.uint16).tobytes())
    raw = spec(tmp_path, workers=1, micro=8)
    raw["data"] = {"kind": "tokens", "train": str(corpus), "vocab_size": 16, "eval_samples": 0}
    raw["faults"] = {"kill_at_steps": [13], "rank": 0}
    cfg = config_from_dict(raw)
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(cfg, world_size=1, out_dir=tmp_path / "out")
    saved = ckpt.resolve(ckpt.run_dir_for(cfg)).manifest["data"]["fingerprint"]

    corpus.write_bytes(np.random.default_rng(1).integers(0, 16, 20_000, np.uint16).tobytes())
    with pytest.raises(ckpt.CheckpointError) as refused:
        run_processes(cfg, world_size=1, out_dir=tmp_path / "out")
    message = str(refused.value)
    assert "was trained on other data" in message and "\n" not in message
    assert f"fingerprint {saved[:12]} in the checkpoint" in message
    assert "--set data.allow_changed=true" in message

    allowed = config_from_dict({**raw, "data": {**raw["data"], "allow_changed": True}})
    summary = run_processes(allowed, world_size=1, out_dir=tmp_path / "out")
    assert summary["resumed_from_step"] == 10 and summary["steps"] == 20


def _killed_rank_and_its_peer(rank: int) -> None:
    """Rank 1 dies as an injected fault does (`os._exit(17)`), after its peer has failed
    on the connection it reset (a consequence, raised first)."""
    import os
    import time

    if rank == 1:
        time.sleep(0.3)
        os._exit(17)
    raise RuntimeError("Read error: Connection reset by peer")


def test_a_killed_rank_is_named_whichever_failure_the_harness_sees_first() -> None:
    """Both processes have ended when the harness looks; it names the one that ended on
    its own (the tests above match its "exit code 17"), not the peer that raised because
    of it, whichever of the two torch's join finds first."""
    import time

    import torch.multiprocessing as mp

    from trainstack.runtime.gloo_processes import join

    context = mp.start_processes(
        _killed_rank_and_its_peer, nprocs=2, start_method="forkserver", join=False
    )
    deadline = time.monotonic() + 60  # both end (starting them imports torch: seconds)
    while any(p.exitcode is None for p in context.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p.exitcode for p in context.processes] == [1, 17]
    # both ended: torch's own join finds the peer's exception first here
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with exit code 17"):
        join(context)
