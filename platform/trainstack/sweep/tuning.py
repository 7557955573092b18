"""A sweep file as Ray Tune objects: search space, searcher, scheduler, trial resources."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler
from ray.tune.search import SearchAlgorithm, Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator

from trainstack.config import ConfigError, JobConfig
from trainstack.sweep.spec import Dimension, Distribution, SweepConfig, flat_spec

NODE_SHARE = 0.001
"""How much of its node's own resource (`node:<IP>`) a trial's driver reserves, and no
CPU: it only drives its run, and a CPU fraction would keep a trial whose workers take
every CPU of the cluster from starting (2 cores: 0.01 leaves 1.99 for two 1-CPU
workers). The node is the sweep driver's (`trial_resources`), so the trials' drivers run
next to the sweep's state and a file-based MLflow store; the workers they start run
anywhere."""


def algorithm(sweep: SweepConfig) -> str:
    """The searcher `auto` stands for: optuna when it is installed, else grid."""
    chosen = sweep.search.algorithm
    optuna_installed = importlib.util.find_spec("optuna") is not None
    if chosen == "auto":
        return "optuna" if optuna_installed else "grid"
    if chosen == "optuna" and not optuna_installed:
        raise ConfigError("search.algorithm=optuna needs Optuna: pip install optuna")
    return chosen


def param_space(sweep: SweepConfig) -> dict[str, Any] | None:
    """grid: `grid` holds every combination of the lists (conditions applied, no
    duplicates) and `sampled` the distributions; random: everything under `sampled`;
    optuna: none (its searcher defines the space as it goes)."""
    kind = algorithm(sweep)
    if kind == "optuna":
        return None
    sampled = {
        dim.key: _domain(dim.distribution) for dim in sweep.space if dim.distribution is not None
    }
    if kind == "random":
        sampled.update(
            {dim.key: tune.choice(list(dim.values)) for dim in sweep.space if dim.values}
        )
        return {"sampled": sampled}
    return {"grid": tune.grid_search(sweep.grid()), "sampled": sampled}


def searcher(sweep: SweepConfig, *, concurrent: int) -> SearchAlgorithm | Searcher:
    """Tune's variant generator (grid, random) or Optuna, `concurrent` trials at a time."""
    if algorithm(sweep) != "optuna":
        return BasicVariantGenerator(random_state=sweep.search.seed, max_concurrent=concurrent)
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(
        space=ConditionalSpace(sweep=sweep),
        metric=sweep.objective.metric,
        mode=sweep.objective.mode,
        seed=sweep.search.seed,
    )


@dataclass(frozen=True, kw_only=True)
class ConditionalSpace:
    """Optuna's define-by-run space (a class, not a closure: Tune pickles the searcher).

    Suggests each key whose conditions hold, in file order; conditions may only name
    earlier keys, so they are decided by then."""

    sweep: SweepConfig

    def __call__(self, trial: Any) -> None:
        view = flat_spec(self.sweep.base)
        for dim in self.sweep.space:
            if dim.applies(view):
                view[dim.key] = _suggest(trial, dim)


def scheduler(sweep: SweepConfig) -> TrialScheduler:
    if sweep.scheduler.kind == "fifo":
        return FIFOScheduler()
    max_t = max(trial_tokens(sweep.trial_config(o, name=sweep.name)) for o in sweep.corner_trials())
    grace = max(1, math.floor(sweep.scheduler.grace_fraction * max_t))
    return ASHAScheduler(
        time_attr="tokens",
        metric=sweep.objective.metric,
        mode=sweep.objective.mode,
        max_t=max_t,
        grace_period=min(grace, max_t),
        reduction_factor=sweep.scheduler.reduction_factor,
    )


def trial_tokens(cfg: JobConfig) -> int:
    return cfg.train.steps * cfg.train.global_batch_size * cfg.tokens_per_sample


def trial_needs(sweep: SweepConfig) -> dict[str, float]:
    """The most CPUs and GPUs any trial's workers reserve (over the space's corners)."""
    cpus, gpus = 0.0, 0.0
    for overrides in sweep.corner_trials():
        cfg = sweep.trial_config(overrides, name=sweep.name)
        cpus = max(cpus, cfg.scaling.num_workers * cfg.scaling.cpus_per_worker)
        gpus = max(gpus, cfg.scaling.num_workers if cfg.scaling.use_gpu else 0)
    return {"CPU": cpus, "GPU": gpus}


def max_concurrent(sweep: SweepConfig, cluster: dict[str, float]) -> int:
    """search.max_concurrent_trials, else how many of the largest trial the cluster holds."""
    if sweep.search.max_concurrent_trials:
        return sweep.search.max_concurrent_trials
    needs = trial_needs(sweep)
    fits = [math.floor(cluster.get(r, 0.0) / n + 1e-9) for r, n in needs.items() if n > 0]
    if min(fits) < 1:
        have = ", ".join(f"{cluster.get(r, 0.0):g} {r}" for r in needs if needs[r] > 0)
        want = ", ".join(f"{n:g} {r}" for r, n in needs.items() if n > 0)
        raise ConfigError(
            f"sweep {sweep.name}: its largest trial needs {want}, the cluster has {have}; "
            "use fewer workers, or set search.max_concurrent_trials on an autoscaling cluster"
        )
    return min(fits)


def trial_resources(node_resource: str) -> dict[str, float]:
    """What a trial's own process (its driver) reserves: a sliver of `node_resource`, the
    sweep driver's node's own resource (`runtime.cluster.this_node_resource`); see
    NODE_SHARE."""
    return {"CPU": 0, node_resource: NODE_SHARE}


def _domain(dist: Distribution) -> Any:
    if dist.kind == "uniform":
        return tune.uniform(dist.low, dist.high)
    if dist.kind == "loguniform":
        return tune.loguniform(dist.low, dist.high)
    if dist.kind == "randint":  # Tune's upper bound is exclusive; ours is included
        return tune.randint(int(dist.low), int(dist.high) + 1)
    return tune.lograndint(int(dist.low), int(dist.high) + 1)


def _suggest(trial: Any, dim: Dimension) -> Any:
    name = f"sampled/{dim.key}"
    dist = dim.distribution
    if dist is None:
        return trial.suggest_categorical(name, list(dim.values))
    log = dist.kind.startswith("log")
    if dist.is_integer:
        return trial.suggest_int(name, int(dist.low), int(dist.high), log=log)
    return trial.suggest_float(name, dist.low, dist.high, log=log)
