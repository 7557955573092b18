"""Every kind a job spec names, in one table each: `strategy.kind`, `model.kind` and
`data.kind`. The only place a kind is named.

Callers ask the kind's entry (`kind_of(cfg)`, `MODEL_KINDS[...]`, `DATA_KINDS[...]`)
what they need to know instead of comparing strings: where a strategy runs, which
engine trains it, whether it shards model state or lays ranks on a mesh, what it checks
of a built model, what builds it; which task a data source serves and whether it reads
files. Adding a strategy, a model family or a data source is its own module and one
entry here. Pure Python: the spec's checks (below the engines) read these tables too;
the code that builds each kind is named by import path and imported only where a job
uses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from trainstack.config import JobConfig


@dataclass(frozen=True, kw_only=True)
class StrategyKind:
    name: str
    runs_on: Literal["ray_train", "actors", "plan"]
    """`ray_train`: a Ray Train worker group; `actors`: plain Ray actors (the parameter
    server's workers and shards); `plan`: replaced by the plan's layout before anything
    runs (`auto`)."""
    engine: Literal["torch", "deepspeed", "strategy.engine"]
    """Who trains it; `strategy.engine`: the spec's `strategy.engine` says."""
    float64: bool
    """Trains in `train.precision: fp64` (on its torch engine)."""
    shards_state: bool = False
    """Splits parameters, gradients or optimizer state across ranks."""
    mesh: bool = False
    """Lays ranks on a device mesh with `strategy.tensor_parallel` (rank = replica × t +
    tp rank): replicas are not the ranks themselves."""
    resumes_other_runs: bool = True
    """Starts from another run's checkpoint (`--resume-from`)."""
    dense_hooks: bool = False
    """Sends each replica's whole gradient through a DDP communication hook (where
    compression applies AdamW's moments on each rank, warms up, clips locally and
    adapts to the link)."""
    compresses: bool = False
    """Takes `compression:` (a DDP hook, or the parameter server's pushes)."""
    object_store_checkpoints: bool = True
    """Keeps its checkpoints in an object store as well as a shared filesystem."""
    build: str = ""
    """`module:callable(cfg, ctx) -> Strategy` run on each worker; empty for kinds that
    do not run as a worker group's strategy."""
    model_checks: tuple[str, ...] = ()
    """`module:callable(cfg, model)` pre-flight runs on the built model before Ray starts."""

    def engine_of(self, cfg: JobConfig) -> str:
        return cfg.strategy.engine if self.engine == "strategy.engine" else self.engine

    def builder(self) -> Callable[..., Any]:
        return load(self.build)

    def checks(self) -> list[Callable[..., None]]:
        return [load(path) for path in self.model_checks]


KINDS: dict[str, StrategyKind] = {
    k.name: k
    for k in (
        StrategyKind(
            name="ddp",
            runs_on="ray_train",
            engine="torch",
            float64=True,
            dense_hooks=True,
            compresses=True,
            build="trainstack.strategies.ddp:DDPStrategy",
        ),
        StrategyKind(
            name="zero",
            runs_on="ray_train",
            engine="deepspeed",
            float64=False,
            shards_state=True,
            build="trainstack.strategies.zero:ZeROStrategy",
        ),
        StrategyKind(
            name="fsdp",
            runs_on="ray_train",
            engine="torch",
            float64=True,
            shards_state=True,
            mesh=True,
            build="trainstack.strategies.fsdp:FSDPStrategy",
            model_checks=("trainstack.strategies.tensor_parallel:check_model_splits",),
        ),
        StrategyKind(
            name="pipeline",
            runs_on="ray_train",
            engine="strategy.engine",
            float64=True,
            mesh=True,
            build="trainstack.strategies:build_pipeline",
            model_checks=("trainstack.strategies.pipeline_split:check_pipeline_model",),
        ),
        StrategyKind(
            name="ps",
            runs_on="actors",
            engine="torch",
            float64=False,
            resumes_other_runs=False,
            compresses=True,
            object_store_checkpoints=False,
            model_checks=("trainstack.ps.partition:check_shards",),
        ),
        StrategyKind(name="auto", runs_on="plan", engine="torch", float64=False),
    )
}
"""Every `strategy.kind`, by name."""


def kind_of(cfg: JobConfig) -> StrategyKind:
    return KINDS[cfg.strategy.kind]


def kinds_that(has: Callable[[StrategyKind], bool], *, last: str = ", ") -> str:
    """The names of the kinds with a property, for a message's `allowed:` (`last` joins
    the last two: "ddp or ps")."""
    names = [k.name for k in KINDS.values() if has(k)]
    return last.join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)


def load(path: str) -> Any:
    """What `module:attribute` names (the module imported on first use)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True, kw_only=True)
class ModelKind:
    name: str
    build: str
    """`module:callable(cfg, *, vocab_size) -> nn.Module`."""
    builtin: bool = False
    """Its structure follows from the spec alone: parameters counted by formula
    (`count_parameters`), blocks known."""
    tensor_parallel: bool = False
    """Has a tensor-parallel plan (`strategy.tensor_parallel` > 1)."""

    def builder(self) -> Any:
        return load(self.build)


MODEL_KINDS: dict[str, ModelKind] = {
    k.name: k
    for k in (
        ModelKind(
            name="gpt", build="trainstack.models.gpt:GPT", builtin=True, tensor_parallel=True
        ),
        ModelKind(name="mlp", build="trainstack.models.mlp:WindowMLP", builtin=True),
        ModelKind(name="custom", build="trainstack.models.custom:build_custom_model"),
        ModelKind(name="hf", build="trainstack.models.hf:build_hf_model", tensor_parallel=True),
    )
}
"""Every `model.kind`, by name."""


@dataclass(frozen=True, kw_only=True)
class DataKind:
    name: str
    build: str
    """`module:Class` whose `from_config(data_section)` builds the corpus."""
    task: Literal["lm", "classify", ""]
    """The task its samples are for (empty: either, as the user's own dataset says)."""
    files: bool = False
    """Reads the user's files (`data.train` / `data.val`, resolved against the spec)."""


DATA_KINDS: dict[str, DataKind] = {
    k.name: k
    for k in (
        DataKind(name="markov", build="trainstack.data.markov:MarkovCorpus", task="lm"),
        DataKind(name="clusters", build="trainstack.data.clusters:ClustersCorpus", task="classify"),
        DataKind(name="tokens", build="trainstack.data.tokens:TokenCorpus", task="lm", files=True),
        DataKind(name="text", build="trainstack.data.text:TextCorpus", task="lm", files=True),
        DataKind(
            name="arrays", build="trainstack.data.arrays:ArrayCorpus", task="classify", files=True
        ),
        DataKind(name="ray", build="trainstack.data.ray_source:RaySource", task="lm", files=True),
        DataKind(name="custom", build="trainstack.data.custom_dataset:DatasetCorpus", task=""),
    )
}
"""Every `data.kind`, by name (`ray`: pre-flight's view; workers stream through
`data.ray_stream`)."""
