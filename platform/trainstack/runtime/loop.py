"""The per-worker training loop: the same code under Ray Train and plain torch.distributed.

Read it top to bottom as the steps of a run: build data and model, hand them to the
strategy, step, log on log steps, evaluate on held-out data, summarise.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack import checkpoint as ckpt
from trainstack.config import JobConfig, config_to_dict
from trainstack.data import Source, build_corpus
from trainstack.data.bits_per_byte import summary_bits_per_byte
from trainstack.data.ray_source import RaySource
from trainstack.data.ray_stream import RayStepBatches
from trainstack.data.sharding import ShardedBatches, eval_batches
from trainstack.faults import FaultInjector
from trainstack.kinds import data_kind_of
from trainstack.models import build_model, compiled_blocks, num_params
from trainstack.models.flops import flops_per_token as training_flops_per_token
from trainstack.models.on_meta import has_meta_parameters
from trainstack.observe.prometheus import RunTelemetry
from trainstack.observe.throughput import ThroughputMeter, device_peak_flops, mfu, peak_memory_bytes
from trainstack.run_events import FirstStep, Start
from trainstack.runtime.checkpointing import CheckpointSaver, CheckpointStore
from trainstack.runtime.expert_load import ExpertLoad
from trainstack.storage import Location
from trainstack.strategies import Strategy, WorkerContext, build_strategy
from trainstack.strategies.base import (
    LoadsPretrainedParts,
    PlacesReference,
    ReportsLayout,
    StepOutput,
    weight_dtype,
)
from trainstack.tasks import attach_reference, build_task

LogFn = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True)
class TrainOutcome:
    summary: dict[str, Any]
    """The run's figures; rank 0's are the ones reported."""
    strategy: Strategy
    """The trained strategy, holding the final model and optimizer state."""


def fit_to_group(cfg: JobConfig, world_size: int) -> tuple[JobConfig, str | None]:
    """An elastic run's spec for a group of `world_size` workers, and a note saying what
    changed (None when nothing did): the global batch stays, so each worker takes G / N
    samples in micro-batches of the largest size <= `train.micro_batch_size` dividing it.
    A fixed group gets `cfg` back unchanged."""
    s, t = cfg.scaling, cfg.train
    if not s.elastic:
        return cfg, None
    per_worker = t.global_batch_size // world_size  # validation: every size divides G
    micro = max(b for b in range(1, min(t.micro_batch_size, per_worker) + 1) if per_worker % b == 0)
    if world_size == s.num_workers and micro == t.micro_batch_size:
        return cfg, None
    fitted = dataclasses.replace(
        cfg,
        scaling=dataclasses.replace(s, num_workers=world_size),
        train=dataclasses.replace(t, micro_batch_size=micro),
    )
    accum = per_worker // micro
    return fitted, (
        f"elastic: {world_size} of up to {s.num_workers} workers, {per_worker} samples each "
        f"per step ({accum} × {micro}); global batch {t.global_batch_size}"
    )


def _probe_sample(cfg: JobConfig, corpus: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample to count the model's FLOPs on: the first held-out one, else (no
    evaluation, no held-out data) the first training one. A Ray Data shard's held-out
    rows always hold one (a training row when the run has no held-out data)."""
    if cfg.data.eval_samples > 0 or isinstance(corpus, RaySource):
        return eval_batches(
            corpus, count=1, seq_len=cfg.model.block_size, micro_batch_size=1, rank=0, world_size=1
        )[0]
    return corpus.train_batch(0, 1, seq_len=cfg.model.block_size)


def train(
    cfg: JobConfig,
    ctx: WorkerContext,
    *,
    run_dir: Path,
    store: CheckpointStore,
    checkpoints: Location | None = None,
    resume_from: Location | None = None,
    on_event: LogFn | None = None,
) -> TrainOutcome:
    """Run the job on this worker, resuming from the newest valid checkpoint in
    `checkpoints` (else `resume_from`, else from scratch); return its summary and trained
    strategy. `checkpoints` is where the store puts them (default: `run_dir`, the run's
    local directory, which also holds fault markers and telemetry).

    `on_event` gets rank 0's log records and run events (start, first step, injected
    faults) as dicts; records have a "step", events an "event" key.
    """
    emit = on_event or (lambda record: None)
    entered = time.time()
    spec = config_to_dict(cfg)  # what checkpoints record: the run's spec, not this group's
    cfg, group_note = fit_to_group(cfg, ctx.world_size)
    torch.set_num_threads(cfg.scaling.torch_threads)
    corpus: Source = (  # ray: held-out rows from Ray Train's `val` dataset
        RaySource.from_shard(cfg.data) if data_kind_of(cfg).streams else build_corpus(cfg.data)
    )
    task = build_task(cfg)
    seq_len = cfg.model.block_size
    strategy = build_strategy(cfg, ctx)
    model = build_job_model(cfg, strategy)
    flops_per_token = training_flops_per_token(model, _probe_sample(cfg, corpus), task=task)
    params = num_params(model)
    shapes = ckpt.parameter_shapes(model)

    set_up_strategy(cfg, strategy, model)
    checkpoints = run_dir if checkpoints is None else checkpoints
    restored, notes = _restore(cfg, ctx, strategy, checkpoints=checkpoints, resume_from=resume_from)
    start_step = restored.step if restored else 0
    if isinstance(strategy, ReportsLayout):
        notes = [*strategy.layout_notes(), *notes]
    if cfg.train.compile:
        compiled = compiled_blocks(strategy.unwrapped_model())
        notes = [f"train.compile: {len(compiled)} blocks compiled with torch.compile", *notes]
    if group_note is not None:
        notes = [group_note, *notes]
    if ctx.rank == 0:
        emit(
            Start(
                resumed_from_step=start_step,
                world_size=ctx.world_size,
                notes=notes,
                worker_entered=entered,
            ).to_record()
        )
    # Replicas split the samples; ranks of one replica (a pipeline) see the same ones.
    replicas = cfg.data_parallel_size
    batches: ShardedBatches | RayStepBatches
    if isinstance(corpus, RaySource):  # rows streamed from this rank's shard, resumed by count
        batches = RayStepBatches.for_worker(cfg, ctx, restored=restored)
    else:
        batches = ShardedBatches.for_job(
            cfg,
            corpus,
            rank=cfg.data_parallel_rank(ctx.rank),
            world_size=replicas,
            samples_seen=restored.samples_seen if restored else 0,
        )
    meter = ThroughputMeter(
        tokens_per_step=cfg.train.global_batch_size * cfg.tokens_per_sample,
        samples_per_step=cfg.train.global_batch_size,
    )
    peak_flops = device_peak_flops(ctx.device)
    faults = FaultInjector(cfg, rank=ctx.rank, marker_dir=run_dir / "faults", on_fire=emit)
    telemetry = RunTelemetry.for_rank(
        cfg, rank=ctx.rank, world_size=ctx.world_size, run_dir=run_dir
    )

    def achieved_mfu(tokens_per_s: float) -> float | None:
        return mfu(
            flops_per_token=flops_per_token,
            tokens_per_s=tokens_per_s,
            peak_flops=peak_flops,
            world_size=ctx.world_size,
        )

    saver = CheckpointSaver(
        rank=ctx.rank,
        distributed=ctx.is_distributed,
        store=store,
        checkpoints=checkpoints,
        keep=cfg.checkpoint.keep,
        background=cfg.checkpoint.async_save,
    )

    def save(step: int, metrics: dict[str, Any]) -> None:
        seen = batches.cursor.samples_seen
        data = {
            "fingerprint": corpus.fingerprint,
            "epoch": data_epoch(corpus, seen, seq_len=seq_len),
            **(batches.position() if isinstance(batches, RayStepBatches) else {}),
        }

        def manifest(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
            return ckpt.build_manifest(
                step=step,
                samples_seen=seen,
                tokens_seen=seen * cfg.tokens_per_sample,
                spec=spec,
                model_shapes=shapes,
                data=data,
                strategy=strategy.name,
                world_size=ctx.world_size,
                files=entries,
                metrics=metrics,
                lora=ckpt.lora_base(cfg) if cfg.model.lora.rank else None,
            )

        def files() -> dict[str, Any]:
            return {
                **strategy.checkpoint_files(),
                ckpt.rank_file("rng", ctx.rank): ckpt.rng_state(),
            }

        saver.save(
            files,
            name=ckpt.dir_name(step),
            metrics=metrics,
            manifest=manifest,
            written=lambda: faults.while_saving(step),
        )
        telemetry.record_checkpoint(saver.times.last_stall_s)

    # This worker group's seconds in training steps (less its first, which start-up or
    # the restart counts) and in evaluation: with the saver's stall, what goodput reads.
    spent = {"steps_s": 0.0, "eval_s": 0.0}

    def time_spent() -> dict[str, float]:
        return {
            "time_steps_s": spent["steps_s"],
            "time_eval_s": spent["eval_s"],
            "time_checkpoint_s": saver.times.stall_s,
        }

    def held_out() -> dict[str, float]:
        """The task's metrics on the held-out samples (a collective); {} without them."""
        if cfg.data.eval_samples == 0:
            return {}
        started = time.perf_counter()
        try:
            return _evaluate()
        finally:
            spent["eval_s"] += time.perf_counter() - started

    def _evaluate() -> dict[str, float]:
        batches = eval_batches(
            corpus,
            count=cfg.data.eval_samples,
            seq_len=seq_len,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=cfg.data_parallel_rank(ctx.rank),
            world_size=replicas,
        )
        return strategy.evaluate(batches).metrics(task)

    if restored is not None and start_step >= cfg.train.steps:
        summary = dict(restored.manifest["metrics"])  # the run had finished: report it again
        save(start_step, summary)
        saver.wait()
        return TrainOutcome(summary=summary, strategy=strategy)

    routing = ExpertLoad.of(strategy.unwrapped_model(), device=ctx.device)
    run_start = time.perf_counter()
    train_loss = math.nan
    record: dict[str, Any] = {}
    for step in range(start_step, cfg.train.steps):
        faults.before_step(step + 1, settle=saver.wait)
        step_start = time.perf_counter()
        out = strategy.train_step(batches.next_step())
        step_s = time.perf_counter() - step_start
        meter.record(step_s)
        if step > start_step:
            spent["steps_s"] += step_s
        if routing is not None:
            routing.after_step()  # a collective: every rank calls it

        done = step + 1
        if done == start_step + 1 and ctx.rank == 0:
            emit(FirstStep(step=done).to_record())
        for event in out.events if ctx.rank == 0 else ():
            emit({**event.to_record(), "step": done})
        if done % cfg.log.every_steps == 0 or done == cfg.train.steps:
            train_loss = strategy.global_mean(out.loss)  # a collective: every rank calls it
            window = meter.window()
            record = {
                "step": done,
                "steps": cfg.train.steps,
                "loss": train_loss,
                "lr": out.lr,
                "grad_norm": out.grad_norm,
                **window,
                "mfu": achieved_mfu(window["tokens_per_s"]),
                "peak_mem_bytes": peak_memory_bytes(ctx.device),
                "elapsed_s": time.perf_counter() - run_start,
                **_comm_metrics(out),
                **(routing.metrics() if routing is not None else {}),
            }
            evals = cfg.log.eval_every_steps
            if evals and done % evals == 0 and done < cfg.train.steps:
                record.update(held_out())
            record.update(time_spent())
            if ctx.rank == 0:
                emit(record)
            telemetry.record_step(record)  # every rank: dashboard series tagged by rank
        every = cfg.checkpoint.every_steps
        if every and done % every == 0 and done < cfg.train.steps:
            save(done, record or {"step": done})
    train_s = time.perf_counter() - run_start

    evaluation = held_out()
    eval_loss = evaluation.get("eval_loss")
    steady = meter.steady_state()
    summary = {
        "final_loss": eval_loss if eval_loss is not None else train_loss,
        "final_train_loss": train_loss,
        "eval_loss": eval_loss,
        **evaluation,
        **summary_bits_per_byte(cfg, eval_loss),  # text: against gzip -9 and xz -9
        "task": cfg.task.kind,
        "entropy_floor": corpus.loss_floor(seq_len),
        "steps": cfg.train.steps,
        "resumed_from_step": start_step,
        "tokens_per_s": steady["tokens_per_s"],
        "samples_per_s": steady["samples_per_s"],
        "step_time_s": steady["step_time_s"],
        "step_time_p50_s": steady["step_time_p50_s"],
        "mfu": achieved_mfu(steady["tokens_per_s"]),
        "world_size": ctx.world_size,
        "strategy": cfg.strategy.kind,
        "device": ctx.device.type,
        "params": params,
        "flops_per_token": flops_per_token,
        "comm_bytes_per_step": strategy.comm_bytes_per_step(),
        "peak_mem_bytes": peak_memory_bytes(ctx.device),
        "model_state_bytes": strategy.model_state_bytes(),
        "train_s": train_s,
        **_comm_metrics(out),
        **(strategy.run_metrics() if isinstance(strategy, ReportsLayout) else {}),
        **(routing.run_metrics() if routing is not None else {}),
    }
    if isinstance(batches, RayStepBatches):
        summary["rows_consumed"] = batches.cursor.samples_seen  # steps x global batch, once
    saver.wait()  # the loop's last save lands (the final one would wait for it anyway)
    summary.update(saver.times.metrics())  # the loop's saves: the final one is not in them
    summary.update(time_spent())
    save(cfg.train.steps, summary)
    saver.wait()  # the run's last checkpoint is committed before the run reports its end
    return TrainOutcome(summary=summary, strategy=strategy)


def build_job_model(cfg: JobConfig, strategy: Strategy) -> nn.Module:
    """The job's model as `strategy` takes it: a `model.pretrained` that the strategy
    reads rank by rank (`LoadsPretrainedParts`) with its parameters on the meta device,
    else whole. With `model.lora` every rank reads the whole folder before the strategy
    shards the model: the adapters are added to the loaded model; so does DPO's frozen
    reference, a copy of the model as loaded."""
    whole = cfg.model.lora.rank or cfg.frozen_reference
    return build_model(
        cfg.model,
        vocab_size=cfg.data.vocab_size,
        seed=cfg.train.seed,
        pretrained_on_meta=isinstance(strategy, LoadsPretrainedParts) and not whole,
    )


def set_up_strategy(cfg: JobConfig, strategy: Strategy, model: nn.Module) -> None:
    """Hand `model` (from `build_job_model`) to the strategy; one with meta parameters is
    then filled from `model.pretrained`, each rank reading its own part. DPO without
    `model.lora` keeps a frozen copy of the model as it starts, placed as the strategy
    places the policy, for its reference (`attach_reference`)."""
    in_parts = has_meta_parameters(model)
    model = model.to(weight_dtype(cfg))
    reference = copy.deepcopy(model) if cfg.frozen_reference else None
    strategy.setup(model)
    if in_parts:
        assert isinstance(strategy, LoadsPretrainedParts)
        strategy.load_pretrained(cfg.model.pretrained)
    if reference is not None:
        assert isinstance(strategy, PlacesReference), f"{strategy.name} holds no reference"
        attach_reference(model, strategy.place_reference(reference))


def data_epoch(corpus: Source, samples_seen: int, *, seq_len: int) -> int:
    """The epoch of the data the next step reads (synthetic streams never repeat: 0)."""
    return corpus.epoch(samples_seen, seq_len=seq_len)


def _comm_metrics(out: StepOutput) -> dict[str, Any]:
    """Measured bytes of the step, where the strategy measures them (every rank sends the
    same amount, so rank 0's figures stand for the group)."""
    if out.bytes_on_wire is None:
        return {}
    return {"bytes_on_wire": out.bytes_on_wire, "compression_ratio": out.compression_ratio}


def _restore(
    cfg: JobConfig,
    ctx: WorkerContext,
    strategy: Strategy,
    *,
    checkpoints: Location,
    resume_from: Location | None,
) -> tuple[ckpt.Checkpoint | None, list[str]]:
    """Load the newest valid checkpoint of this run (else `resume_from`) into the strategy;
    return it and the strategy's notes on what it could not restore.

    Rank 0 chooses and verifies; the others follow its choice.
    """
    choice: list[str | None] = [None]
    if ctx.rank == 0:
        found = ckpt.find_start(
            checkpoints, resume_from=resume_from, on_corrupt=cfg.checkpoint.on_corrupt
        )
        choice[0] = str(found.path) if found else None
    if ctx.is_distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        torch.manual_seed(cfg.train.seed + 1 + ctx.rank)  # dropout differs per rank, repeatably
        return None, []
    restored = ckpt.read(ckpt.location(choice[0], cfg))
    notes = strategy.load_checkpoint(restored)
    rng = ckpt.rank_file("rng", ctx.rank)
    same_layout = restored.manifest["world"]["world_size"] == ctx.world_size
    if same_layout and restored.has(rng):
        ckpt.set_rng_state(restored.load(rng))
    else:
        torch.manual_seed(cfg.train.seed + 1 + ctx.rank + 1_000_003 * restored.step)
    return restored, notes
