"""What a job needs of the machine it runs on, checked on the driver before Ray starts.

A local run starts an embedded Ray instance on this machine, so everything the
workers will ask for can be compared with what the machine has:

- **Workers.** The Train worker group (or the parameter server's worker actors)
  reserves `num_workers × cpus_per_worker` CPUs and, with `use_gpu`, one GPU per
  worker; the controller, the event queue and the parameter-server shards and clock
  reserve none. More than the machine has would wait forever for room that never
  comes, so it is refused.
- **Memory.** An estimate of the model state the workers hold (`model_state`):
  parameters, gradients and optimizer state, from the parameter count (by formula for
  the built-in models, from a meta-device build for the others). Activations, data
  and the frameworks' own memory come on top, so the estimate is a floor: a job
  refused here could never run; a job accepted may still run out of memory.

On a cluster (`--address`) the machines are not known before connecting: the
launcher says what is missing while the workers wait for room, for up to
`scaling.start_timeout_s` (`cluster_wait_note`, `worker_group_start_timeout`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trainstack.compat.ray import is_worker_group_start_timeout
from trainstack.config import ConfigError, JobConfig
from trainstack.kinds import kind_of, model_kind_of
from trainstack.machine import local_cpus, local_gpus, local_memory_bytes
from trainstack.planner.choose import layout_of
from trainstack.planner.memory import model_state_bytes, parameter_server_bytes
from trainstack.planner.workload import expert_shape, state_element_bytes, trainable_parameter_count
from trainstack.planner.workload import parameter_count as planned_parameter_count
from trainstack.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class ModelState:
    """Bytes of model state a job holds, estimated from its parameter count."""

    params: int
    per_worker: int
    """Bytes one worker holds: its parameters, gradients and optimizer state."""
    on_device: int
    """The part of `per_worker` on the worker's GPU (offloaded state is in host memory)."""
    elsewhere: int
    """Bytes held outside the workers: the parameter-server shards' parameters and
    optimizer state."""
    what: str
    """What is counted, for messages: `parameters, gradients and AdamW state`."""


def parameter_count(cfg: JobConfig) -> int | None:
    """The model's parameters without allocating them (the planner's count); None when
    the plan cannot count them (a model that does not build: the real build in
    pre-flight then says why; `model.pretrained`, whose weights are not read here)."""
    try:
        return planned_parameter_count(cfg)
    except ConfigError:
        return None


def model_state(cfg: JobConfig, params: int, *, trainable: int | None = None) -> ModelState:
    """Per-worker bytes of `params` parameters, `trainable` of them trained (LoRA; None:
    all), under the job's layout and optimizer: the planner's model
    (`planner/memory.py`, its table), the one `trainstack plan`, `strategy.kind: auto`
    and this pre-flight check all use. A parameter-server worker holds weights and
    gradients, and its shards the weights and optimizer state."""
    element, optimizer, weight = state_element_bytes(cfg)
    layout = layout_of(cfg)
    if layout is None:  # the parameter server
        per_worker, elsewhere = parameter_server_bytes(params=params, optimizer_bytes=optimizer)
        on_device = per_worker
    else:
        moe = expert_shape(cfg)
        state = model_state_bytes(
            layout,
            params=params,
            element_bytes=element,
            optimizer_bytes=optimizer,
            weight_bytes=weight,
            expert_params=moe.expert_params if moe else 0,
            trainable=trainable,
            reference_copy=cfg.frozen_reference,
        )
        per_worker, on_device, elsewhere = state.total, state.device, 0
    optim = "AdamW" if cfg.optim.kind == "adamw" else "SGD momentum"
    what = "parameters and gradients"
    if optimizer and layout is not None:
        what = f"parameters, gradients and {optim} state"
    return ModelState(
        params=params,
        per_worker=per_worker,
        on_device=on_device,
        elsewhere=elsewhere,
        what=what,
    )


# ---- this machine -------------------------------------------------------------------


def check_fits_this_machine(cfg: JobConfig) -> None:
    """Raise ConfigError when the workers can never all run on this machine: more CPUs
    or GPUs than it has, or more model state than its memory (or its GPU's)."""
    check_local_resources(cfg, cpus=local_cpus(), gpus=local_gpus())
    params = parameter_count(cfg)
    if params is None:
        return
    state = model_state(cfg, params, trainable=trainable_parameter_count(cfg))
    if uses_gpus(cfg):
        if torch.cuda.is_available():
            device = torch.cuda.get_device_properties(0)
            check_model_fits(cfg, state, memory=device.total_memory, where=f"one {device.name}")
        return
    check_model_fits(cfg, state, memory=local_memory_bytes(), where="this machine")


def uses_gpus(cfg: JobConfig) -> bool:
    """Whether each worker reserves a GPU (a parameter server's shards stay on CPU)."""
    return cfg.scaling.use_gpu


def check_local_resources(cfg: JobConfig, *, cpus: float, gpus: int) -> None:
    """The workers' reservations against an embedded instance with `cpus` and `gpus`."""
    s = cfg.scaling
    if s.resources_per_worker:
        name = next(iter(s.resources_per_worker))
        raise ConfigError(
            f"scaling.resources_per_worker.{name}: the local Ray instance this run starts "
            "advertises no custom resources; run on a cluster whose nodes do (--address), or "
            "drop scaling.resources_per_worker"
        )
    needed = starting_workers(cfg) * s.cpus_per_worker
    if needed > cpus + 1e-9:
        raise ConfigError(
            f"scaling.num_workers × scaling.cpus_per_worker = {starting_workers(cfg)} × "
            f"{s.cpus_per_worker:g} = {needed:g} CPUs, but the local Ray instance this run "
            f"starts has this machine's {cpus:g}; allowed: num_workers × cpus_per_worker "
            f"<= {cpus:g} (or run on a cluster with --address)"
        )
    if uses_gpus(cfg) and s.num_workers > gpus:
        raise ConfigError(
            f"scaling.num_workers={s.num_workers} with scaling.use_gpu=true needs "
            f"{s.num_workers} GPUs, but this machine has {gpus} that torch can use; allowed: "
            f"num_workers <= {gpus}, use_gpu=false, or a cluster (--address)"
        )


def check_model_fits(cfg: JobConfig, state: ModelState, *, memory: int, where: str) -> None:
    """Raise ConfigError when the model state is more than `memory`: a GPU's for each
    GPU worker, else this machine's for all the workers and shards together."""
    m, workers = cfg.model, cfg.scaling.num_workers
    model = f"model.kind={m.kind}"
    if model_kind_of(cfg).builtin:
        model += f" (n_layer={m.n_layer}, n_embd={m.n_embd}, vocab {cfg.data.vocab_size})"
    figure = (
        f"{model}: about {format_bytes(state.per_worker)} of {state.what} per worker "
        f"({state.params:,} parameters)"
    )
    hint = "use a smaller model or fewer workers"
    if not kind_of(cfg).shards_state:
        hint = "use a smaller model, fewer workers, or strategy.kind=zero (sharded state)"
    if uses_gpus(cfg):
        if state.on_device > memory:
            raise ConfigError(f"{figure}, more than the {format_bytes(memory)} of {where}; {hint}")
        return
    total = workers * state.per_worker + state.elsewhere
    if total <= memory:
        return
    together = ""
    if workers > 1 or state.elsewhere:
        shards = " and the parameter-server shards" if state.elsewhere else ""
        together = f", {format_bytes(total)} for the {workers} worker(s){shards} together"
    raise ConfigError(
        f"{figure}{together}, more than the {format_bytes(memory)} {where} has; {hint}"
    )


# ---- a cluster --------------------------------------------------------------------


def starting_workers(cfg: JobConfig) -> int:
    """Workers the run needs room for to start: an elastic group's minimum, else all."""
    return cfg.scaling.min_workers or cfg.scaling.num_workers


def worker_resources(cfg: JobConfig) -> dict[str, float]:
    """What the workers the run starts with reserve together, by Ray resource name."""
    s, n = cfg.scaling, starting_workers(cfg)
    needs = {"CPU": n * s.cpus_per_worker}
    if uses_gpus(cfg):
        needs["GPU"] = float(n)
    for name, amount in s.resources_per_worker.items():
        needs[name] = n * amount
    return needs


def cluster_shortfall(cfg: JobConfig, free: dict[str, float]) -> str | None:
    """What the workers need that `free` (Ray's available resources) lacks, in words;
    None when they fit (by totals: one node's share is Ray's to place)."""
    missing = [
        f"{need:g} {name} ({free.get(name, 0.0):g} free)"
        for name, need in worker_resources(cfg).items()
        if need > free.get(name, 0.0) + 1e-9
    ]
    return " and ".join(missing) or None


def cluster_wait_note(cfg: JobConfig, free: dict[str, float]) -> str | None:
    """The line to show while the workers wait for room on a cluster, or None."""
    short = cluster_shortfall(cfg, free)
    if short is None:
        return None
    timeout = cfg.scaling.start_timeout_s
    limit = f"up to scaling.start_timeout_s={timeout:g} s" if timeout else "with no time limit"
    return f"waiting for room on the cluster ({limit}): {_starting(cfg)} need {short}"


def start_timeout_message(cfg: JobConfig) -> str:
    """Why a run ended when its workers found no room within `scaling.start_timeout_s`."""
    needs = " and ".join(f"{need:g} {name}" for name, need in worker_resources(cfg).items())
    return (
        f"the cluster did not make room for {_starting(cfg)} "
        f"({needs}) within scaling.start_timeout_s={cfg.scaling.start_timeout_s:g} s; free or "
        "add resources, lower scaling.num_workers, or raise scaling.start_timeout_s "
        "(0: wait forever)"
    )


def _starting(cfg: JobConfig) -> str:
    s = cfg.scaling
    if s.elastic:
        return f"scaling.min_workers={s.min_workers} (elastic, up to {s.num_workers})"
    return f"scaling.num_workers={s.num_workers}"


ELASTIC_ATTEMPT_S = 60.0
"""The longest one start attempt of an elastic group waits. Ray 2.60 sizes a restart
from cluster resources its autoscaling coordinator refreshes every 20 s, so the restart
after a node loss may ask for the workers the lost node held; that attempt ends after
this long and the next is sized from what the cluster has then."""


def attempt_timeout_s(cfg: JobConfig) -> float:
    """How long one start attempt of the worker group waits for room (0: forever):
    `scaling.start_timeout_s`, at most `ELASTIC_ATTEMPT_S` for an elastic group."""
    timeout = cfg.scaling.start_timeout_s
    if cfg.scaling.elastic:
        return min(timeout, ELASTIC_ATTEMPT_S) if timeout else ELASTIC_ATTEMPT_S
    return timeout


def is_start_timeout(error: BaseException) -> bool:
    """Whether Ray Train gave up because the worker group found no room in time: the
    failure a `ray.train.ControllerError` carries is Ray Train's start timeout."""
    return is_worker_group_start_timeout(getattr(error, "controller_failure", None))


WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
"""Ray Train's setting (its start-timeout error names it) for how long the controller
waits for a worker group's placement group, in seconds; default 60."""

HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
"""Ray Train's setting for how often its controller polls the worker group, in seconds;
default 2. A poll is when the controller takes a worker's report (a rank's next report
waits until the one before is taken), sees the group finish, and sees a worker fail."""


def controller_env(cfg: JobConfig) -> dict[str, str]:
    """The Ray Train settings a run's controller gets from the driver's environment:
    the worker-group start timeout (`attempt_timeout_s`: 0 keeps Ray's default, a 60 s
    wait retried forever) and the poll interval (`failure.health_check_s`)."""
    env = {HEALTH_CHECK_INTERVAL_ENV: str(cfg.failure.health_check_s)}
    timeout_s = attempt_timeout_s(cfg)
    if timeout_s:
        env[WORKER_GROUP_START_TIMEOUT_ENV] = str(timeout_s)
    return env


@contextlib.contextmanager
def controller_settings(cfg: JobConfig) -> Iterator[None]:
    """`controller_env(cfg)` in the driver's environment for the fit inside, then as it
    was. Ray Train reads these settings there when it starts the controller and hands
    them on to it. With the controller allowed no retries
    (`FailureConfig(controller_failure_limit=0)`), running out of start time ends the run."""
    env = controller_env(cfg)
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
