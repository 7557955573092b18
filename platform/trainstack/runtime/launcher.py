"""Runs a synchronous-strategy job on a Ray Train V2 worker group.

The driver connects to Ray (an address, else an embedded local instance), starts a
`TorchTrainer` with one actor per worker, and renders rank 0's progress records,
which travel through a small Ray queue actor while `fit()` runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from ray.train.torch import TorchTrainer
from ray.util.queue import Empty, Queue

from trainstack.config import JobConfig, config_from_dict, config_to_dict
from trainstack.runtime.loop import train
from trainstack.runtime.progress import ProgressDisplay
from trainstack.strategies import WorkerContext


class RunFailedError(RuntimeError):
    """The worker group failed for good (after any allowed restarts)."""


def connect(address: str | None) -> bool:
    """Connect to Ray; return True when this call started an embedded local instance."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    # "local": a new instance even when a `ray start` cluster runs on this machine.
    ray.init(address="local", log_to_driver=True)
    return True


def _train_worker(loop_config: dict[str, Any]) -> None:
    """Body of each Ray Train worker actor."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)  # no per-report INFO lines
    cfg = config_from_dict(loop_config["spec"])
    context = ray.train.get_context()
    ctx = WorkerContext(
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        device=ray.train.torch.get_device(),
    )
    progress: Queue = loop_config["progress"]

    def on_log(record: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # progress is best-effort; training goes on
            progress.put_nowait(record)

    outcome = train(cfg, ctx, on_log=on_log)
    # Ray Train V2 hands the driver only metrics that come with a checkpoint, so rank 0
    # attaches the final weights; every rank must call report(): it is a barrier.
    with tempfile.TemporaryDirectory(prefix="trainstack-final-") as tmp:
        checkpoint = None
        if ctx.rank == 0:
            torch.save(outcome.strategy.unwrapped_model().state_dict(), Path(tmp) / "model.pt")
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(outcome.summary, checkpoint=checkpoint, checkpoint_dir_name="final")


def run_job(
    cfg: JobConfig, *, address: str | None = None, display: ProgressDisplay | None = None
) -> dict[str, Any]:
    """Train `cfg` on a Ray worker group; return the summary. Raises RunFailedError."""
    wall_start = time.perf_counter()
    started_local = connect(address)
    storage = Path(cfg.checkpoint.storage_path).expanduser().resolve()
    progress = Queue(actor_options={"num_cpus": 0})
    resources: dict[str, float] = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop_per_worker=_train_worker,
        train_loop_config={"spec": config_to_dict(cfg), "progress": progress},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker=resources,
        ),
        run_config=ray.train.RunConfig(
            name=cfg.name,
            storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=cfg.failure.max_failures),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except Exception as err:  # surfaced on the driver's thread below
            outcome["error"] = err

    fitting = threading.Thread(target=fit, name="trainstack-fit", daemon=True)
    fitting.start()
    try:
        while fitting.is_alive():
            _drain(progress, display, timeout=0.5)
        _drain(progress, display, timeout=0)
    finally:
        if display is not None:
            display.close()
        ray.kill(progress.actor)  # type: ignore[arg-type]
        if started_local:
            ray.shutdown()

    if "error" in outcome:
        raise RunFailedError(f"training failed: {outcome['error']}") from outcome["error"]
    result = outcome["result"]
    if result.error is not None:
        raise RunFailedError(f"training failed: {result.error}")
    summary = dict(result.metrics or {})
    summary["wall_s"] = time.perf_counter() - wall_start
    summary["run_dir"] = str(storage / cfg.name)
    summary["final_checkpoint"] = result.checkpoint.path if result.checkpoint else None
    return summary


def _drain(queue: Queue, display: ProgressDisplay | None, *, timeout: float) -> None:
    """Show every record waiting in the queue (waiting up to `timeout` for the first)."""
    try:
        record = queue.get(timeout=timeout) if timeout else queue.get_nowait()
    except Empty:
        return
    while True:
        if display is not None:
            display.update(record)
        try:
            record = queue.get_nowait()
        except Empty:
            return
