"""Live training metrics on Ray's Prometheus endpoint, through `ray.util.metrics`.

Every series is named `trainstack_<what>_<unit>` here; Ray's exporter publishes it as
`ray_trainstack_...` (counters with `_total`, histograms as `_bucket`, `_sum` and
`_count`), next to Ray's own series, on each node's metrics port. Tags:

- `job_name`: the spec's `name` (not `job`: Prometheus gives every scraped series a
  `job` label of its own, the scrape job's, and would rename ours `exported_job`);
- `run_id`: `run_id_for(run_dir)`, the first 12 hex digits of the sha256 of the run's
  resolved directory (`storage_path/name`). Every worker computes the same id, and it
  stays the same across worker-group restarts and resumes of that run (which is what
  "one run" means here: one checkpoint directory); it needs no MLflow;
- `rank`: the worker (a parameter-server worker's index), or `shard` for a
  parameter-server shard, or `component` for restarts.

A process that is not connected to Ray (the local gloo harness, plain unit tests)
records nothing, and never imports Ray for it. Recording never breaks training: the
first error prints one warning line and turns that object's telemetry off.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import torch

from trainstack.config import JobConfig
from trainstack.observe.throughput import peak_memory_bytes

RANK_TAGS = ("job_name", "run_id", "rank")
SHARD_TAGS = ("job_name", "run_id", "shard")
RESTART_TAGS = ("job_name", "run_id", "component")

Component = Literal["worker_group", "ps_worker", "ps_shard"]
"""What restarted: a Ray Train worker group (counted by the driver), or one
parameter-server actor (counted by the restarted actor itself)."""


@dataclass(frozen=True, kw_only=True)
class ExportedSeries:
    """One exported metric: its name before Ray's `ray_` prefix, kind and tags."""

    name: str
    kind: Literal["gauge", "counter", "histogram"]
    description: str
    tags: tuple[str, ...] = RANK_TAGS
    boundaries: tuple[float, ...] = ()
    """Histogram bucket upper bounds."""

    @property
    def exported_names(self) -> tuple[str, ...]:
        """The names Ray's Prometheus exporter gives it."""
        base = f"ray_{self.name}"
        if self.kind == "counter":
            return (f"{base}_total",)
        if self.kind == "histogram":
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (base,)


LOSS = ExportedSeries(
    name="trainstack_loss",
    kind="gauge",
    description="Training loss over the last log window (sync: mean over the group).",
)
EVAL_LOSS = ExportedSeries(
    name="trainstack_eval_loss",
    kind="gauge",
    description="Held-out loss at the last evaluation step.",
)
TOKENS_PER_SECOND = ExportedSeries(
    name="trainstack_tokens_per_second",
    kind="gauge",
    description="Tokens per second this rank trains; the job's throughput is the sum over ranks.",
)
SAMPLES_PER_SECOND = ExportedSeries(
    name="trainstack_samples_per_second",
    kind="gauge",
    description="Samples per second this rank trains; the job's throughput is the sum over ranks.",
)
MFU = ExportedSeries(
    name="trainstack_mfu_ratio",
    kind="gauge",
    description="Model FLOPs utilisation (0-1); only where the device's peak FLOP/s is known.",
)
STEP_TIME = ExportedSeries(
    name="trainstack_step_time_seconds",
    kind="gauge",
    description="Mean wall time of one optimizer step (ps: one push) over the last log window.",
)
COMM_EXPOSED = ExportedSeries(
    name="trainstack_comm_exposed_seconds",
    kind="gauge",
    description="Communication time per step not hidden behind compute (ps: push + pull).",
)
COMM_EXPOSED_RATIO = ExportedSeries(
    name="trainstack_comm_exposed_ratio",
    kind="gauge",
    description="Exposed communication time over step time (0-1).",
)
PEAK_MEMORY = ExportedSeries(
    name="trainstack_peak_memory_bytes",
    kind="gauge",
    description="Peak memory of this rank: allocated GPU memory, or peak RSS on CPU.",
)
WIRE_BYTES = ExportedSeries(
    name="trainstack_step_wire_bytes",
    kind="gauge",
    description="Bytes this rank put on the wire per step, as measured (ps: pushed gradients).",
)
COMPRESSION_RATIO = ExportedSeries(
    name="trainstack_compression_ratio",
    kind="gauge",
    description="Dense fp32 gradient bytes over bytes on the wire (1: uncompressed).",
)
MOE_LOAD_CV = ExportedSeries(
    name="trainstack_moe_load_cv",
    kind="gauge",
    description="MoE routing balance: coefficient of variation of the experts' loads (0: even).",
)
MOE_DROP_RATE = ExportedSeries(
    name="trainstack_moe_drop_rate",
    kind="gauge",
    description="MoE: share of routed assignments dropped by full experts (0-1).",
)
CHECKPOINT_SAVE = ExportedSeries(
    name="trainstack_checkpoint_save_seconds",
    kind="gauge",
    description="Seconds the training thread spent on this rank's last checkpoint save "
    "(with checkpoint.async_save, the copy to host memory and any wait for the save before; "
    "else the whole write).",
)
TIME_SPENT = ExportedSeries(
    name="trainstack_time_spent_seconds",
    kind="gauge",
    description="This worker group's seconds so far in training steps (after its first), "
    "held-out evaluation and checkpoint stalls (tag part: steps, eval, checkpoint): the "
    "live part of goodput.",
    tags=(*RANK_TAGS, "part"),
)
RESTARTS = ExportedSeries(
    name="trainstack_restarts",
    kind="counter",
    description="Restarts after a failure: of the worker group, or of a ps worker or shard.",
    tags=RESTART_TAGS,
)
PS_UPDATES_PER_SECOND = ExportedSeries(
    name="trainstack_ps_updates_per_second",
    kind="gauge",
    description="Updates a parameter-server shard applied per second, over about a second.",
    tags=SHARD_TAGS,
)
PS_STALENESS = ExportedSeries(
    name="trainstack_ps_staleness_updates",
    kind="histogram",
    description="Staleness of each push at a shard: its updates since the worker pulled.",
    tags=SHARD_TAGS,
    # Half-integer bounds put each integer staleness up to 4 in a bucket of its own.
    boundaries=(0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5, 32.5, 64.5),
)
PS_QUEUE_DEPTH = ExportedSeries(
    name="trainstack_ps_shard_queue_depth",
    kind="gauge",
    description="Mean pushes waiting at or being applied by a shard, over about a second "
    "(Little's law: pushes' seconds from send to applied, over the window).",
    tags=SHARD_TAGS,
)

SERIES: tuple[ExportedSeries, ...] = (
    LOSS,
    EVAL_LOSS,
    TOKENS_PER_SECOND,
    SAMPLES_PER_SECOND,
    MFU,
    STEP_TIME,
    COMM_EXPOSED,
    COMM_EXPOSED_RATIO,
    PEAK_MEMORY,
    WIRE_BYTES,
    COMPRESSION_RATIO,
    MOE_LOAD_CV,
    MOE_DROP_RATE,
    CHECKPOINT_SAVE,
    TIME_SPENT,
    RESTARTS,
    PS_UPDATES_PER_SECOND,
    PS_STALENESS,
    PS_QUEUE_DEPTH,
)

SHARD_WINDOW_S = 1.0
"""How long a shard counts updates and push residence before it sets its gauges."""

_instruments: dict[str, Any] = {}
"""This process's `ray.util.metrics` objects, by series name (one per name)."""


def run_id_for(run_dir: Path) -> str:
    """The run's id in the `run_id` tag: a digest of its resolved directory."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]


def ray_connected() -> bool:
    """Whether this process is connected to Ray (without importing Ray to find out)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def actor_was_restarted() -> bool:
    """Whether the Ray actor running this code is a restart after a failure (False
    outside an actor): `RuntimeContext.was_current_actor_reconstructed`, which asks the
    GCS for the actor's restart count. Ray 2.60 reads it through the `actor_id` accessor
    it deprecates, which would warn in the job's log each time: that warning is Ray's
    business, not the job's, and is left out."""
    import ray

    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(context.was_current_actor_reconstructed)


def _instrument(series: ExportedSeries) -> Any:
    made = _instruments.get(series.name)
    if made is None:
        from ray.util import metrics

        if series.kind == "gauge":
            made = metrics.Gauge(series.name, series.description, tag_keys=series.tags)
        elif series.kind == "counter":
            made = metrics.Counter(series.name, series.description, tag_keys=series.tags)
        else:
            made = metrics.Histogram(
                series.name,
                series.description,
                boundaries=list(series.boundaries),
                tag_keys=series.tags,
            )
        _instruments[series.name] = made
    return made


_Self = TypeVar("_Self", bound="_Tagged")
_P = ParamSpec("_P")


def _best_effort(
    method: Callable[Concatenate[_Self, _P], None],
) -> Callable[Concatenate[_Self, _P], None]:
    """Run `method` only while telemetry is on; its first error turns telemetry off."""

    @functools.wraps(method)
    def guarded(self: _Self, *args: _P.args, **kwargs: _P.kwargs) -> None:
        if not self.enabled:
            return
        try:
            method(self, *args, **kwargs)
        except Exception as err:  # metrics are best-effort: training goes on
            self.enabled = False
            print(
                f"trainstack: metrics export off for this process ({type(err).__name__}: "
                f"{err}); training continues",
                file=sys.stderr,
                flush=True,
            )

    return guarded


@dataclass(kw_only=True)
class _Tagged:
    """Records series under one set of tag values."""

    tags: dict[str, str]
    enabled: bool

    @_best_effort
    def record_restart(self, component: Component) -> None:
        """`component` of this run restarted after a failure."""
        self._inc(RESTARTS, {**self.tags, "component": component})

    @_best_effort
    def record_actor_start(self, component: Component) -> None:
        """Count a restart when the Ray actor running this is one (its first start is not)."""
        if actor_was_restarted():
            self._inc(RESTARTS, {**self.tags, "component": component})

    def _set(self, series: ExportedSeries, value: float | None, **tags: str) -> None:
        """Set `series` to `value` (skipped when None), with `tags` beside the run's."""
        if value is not None:
            _instrument(series).set(float(value), tags=self._tags(series, **tags))

    def _observe(self, series: ExportedSeries, value: float) -> None:
        _instrument(series).observe(float(value), tags=self._tags(series))

    def _inc(self, series: ExportedSeries, tags: dict[str, str]) -> None:
        _instrument(series).inc(1.0, tags={key: tags[key] for key in series.tags})

    def _tags(self, series: ExportedSeries, **extra: str) -> dict[str, str]:
        tags = {**self.tags, **extra}
        return {key: tags[key] for key in series.tags}


@dataclass(kw_only=True)
class RunTelemetry(_Tagged):
    """A training worker's series (tag `rank`); the driver's one counts group restarts."""

    throughput_share: float = 1.0
    """The part of a log record's (the group's) throughput this rank trains."""

    @classmethod
    def for_rank(cls, cfg: JobConfig, *, rank: int, world_size: int, run_dir: Path) -> RunTelemetry:
        """A synchronous-strategy worker's telemetry; off without a Ray connection."""
        return cls(
            tags=_run_tags(cfg, run_dir, rank=str(rank)),
            enabled=ray_connected(),
            throughput_share=1.0 / world_size,
        )

    @classmethod
    def for_driver(cls, cfg: JobConfig, *, run_dir: Path) -> RunTelemetry:
        """The driver's: it sees the worker group restart."""
        return cls(tags=_run_tags(cfg, run_dir, rank="driver"), enabled=ray_connected())

    @_best_effort
    def record_step(self, record: Mapping[str, Any]) -> None:
        """Set the step series from one of the training loop's log records (whose
        throughput is the group's: every rank steps in lock-step)."""
        share = self.throughput_share
        self._set(LOSS, record["loss"])
        self._set(EVAL_LOSS, record.get("eval_loss"))
        self._set(TOKENS_PER_SECOND, record["tokens_per_s"] * share)
        self._set(SAMPLES_PER_SECOND, record["samples_per_s"] * share)
        self._set(MFU, record.get("mfu"))
        self._set(STEP_TIME, record["step_time_s"])
        self._set(PEAK_MEMORY, record["peak_mem_bytes"])
        self._set(WIRE_BYTES, record.get("bytes_on_wire"))
        self._set(COMPRESSION_RATIO, record.get("compression_ratio"))
        self._set(MOE_LOAD_CV, record.get("moe_load_cv"))
        self._set(MOE_DROP_RATE, record.get("moe_drop_rate"))
        for part in ("steps", "eval", "checkpoint"):
            self._set(TIME_SPENT, record.get(f"time_{part}_s"), part=part)

    @_best_effort
    def record_checkpoint(self, seconds: float) -> None:
        """This rank took `seconds` to save a checkpoint."""
        self._set(CHECKPOINT_SAVE, seconds)


@dataclass(kw_only=True)
class PushWindow:
    """What a parameter-server worker did since its last log step."""

    steps: int = 0
    step_s: float = 0.0
    loss_sum: float = 0.0
    comm_s_total: float = 0.0
    bytes_sent_total: int = 0
    dense_bytes_total: int = 0
    """Running totals where the window began."""


@dataclass(kw_only=True)
class PsWorkerTelemetry(_Tagged):
    """A parameter-server worker's series: its own step time, throughput, loss and pushes,
    set every `log.every_steps` of its steps."""

    every_steps: int
    samples_per_step: float
    """This worker's part of a global batch."""
    tokens_per_step: float
    window: PushWindow = field(default_factory=PushWindow)

    @classmethod
    def for_worker(cls, cfg: JobConfig, *, index: int, run_dir: Path) -> PsWorkerTelemetry:
        samples = cfg.train.global_batch_size / cfg.scaling.num_workers
        return cls(
            tags=_run_tags(cfg, run_dir, rank=str(index)),
            enabled=ray_connected(),
            every_steps=cfg.log.every_steps,
            samples_per_step=samples,
            tokens_per_step=samples * cfg.tokens_per_sample,
        )

    @_best_effort
    def record_push_step(
        self,
        *,
        loss: float,
        step_s: float,
        comm_s_total: float,
        bytes_sent_total: int,
        dense_bytes_total: int,
    ) -> None:
        """One step done: its loss and wall time, and the worker's running totals of
        push and pull seconds and of pushed and dense gradient bytes."""
        w = self.window
        w.steps += 1
        w.step_s += step_s
        w.loss_sum += loss
        if w.steps < self.every_steps:
            return
        step = w.step_s / w.steps
        comm = (comm_s_total - w.comm_s_total) / w.steps
        sent = bytes_sent_total - w.bytes_sent_total
        self._set(LOSS, w.loss_sum / w.steps)
        self._set(STEP_TIME, step)
        self._set(TOKENS_PER_SECOND, self.tokens_per_step / step)
        self._set(SAMPLES_PER_SECOND, self.samples_per_step / step)
        self._set(COMM_EXPOSED, comm)
        self._set(COMM_EXPOSED_RATIO, comm / step)
        self._set(WIRE_BYTES, sent / w.steps)
        if sent:
            self._set(COMPRESSION_RATIO, (dense_bytes_total - w.dense_bytes_total) / sent)
        self._set(PEAK_MEMORY, peak_memory_bytes(torch.device("cpu")))
        self.window = PushWindow(
            comm_s_total=comm_s_total,
            bytes_sent_total=bytes_sent_total,
            dense_bytes_total=dense_bytes_total,
        )


@dataclass(kw_only=True)
class ShardTelemetry(_Tagged):
    """A parameter-server shard's series (tag `shard`): staleness of every push, and
    updates/s and queue depth over windows of about `SHARD_WINDOW_S`.

    A shard is a Ray actor that runs one call at a time; the pushes queued behind the
    running one sit in Ray's task queue, out of its sight. So it measures the queue by
    Little's law: the mean number of pushes waiting or being applied over a window is
    the sum of their seconds from the worker's send (`sent_at`, wall clock: across nodes
    this relies on synchronised clocks) to applied, over the window's length.
    """

    window_start: float | None = None
    """When the current window began: at the first push, then at each window's end."""
    updates: int = 0
    residence_s: float = 0.0
    stamped_pushes: int = 0

    @classmethod
    def for_shard(cls, cfg: JobConfig, *, index: int, run_dir: Path) -> ShardTelemetry:
        tags = {"job_name": cfg.name, "run_id": run_id_for(run_dir), "shard": str(index)}
        return cls(tags=tags, enabled=ray_connected())

    @_best_effort
    def record_update(self) -> None:
        """The shard applied one update."""
        if self.window_start is None:
            self.window_start = time.perf_counter()
        self.updates += 1

    @_best_effort
    def record_push(self, *, staleness: int, sent_at: float | None) -> None:
        """A push with `staleness` is done (applied, collected or rejected); it was sent
        at `sent_at` (`time.time()`, None when unknown)."""
        self._observe(PS_STALENESS, staleness)
        now = time.perf_counter()
        if self.window_start is None:
            self.window_start = now
        if sent_at is not None:
            self.residence_s += max(0.0, time.time() - sent_at)
            self.stamped_pushes += 1
        elapsed = now - self.window_start
        if elapsed < SHARD_WINDOW_S:
            return
        self._set(PS_UPDATES_PER_SECOND, self.updates / elapsed)
        if self.stamped_pushes:
            self._set(PS_QUEUE_DEPTH, self.residence_s / elapsed)
        self.window_start = now
        self.updates, self.residence_s, self.stamped_pushes = 0, 0.0, 0


def _run_tags(cfg: JobConfig, run_dir: Path, *, rank: str) -> dict[str, str]:
    return {"job_name": cfg.name, "run_id": run_id_for(run_dir), "rank": rank}
